"""The trainer under `torchrun` from a test (importable from any test: `tests/` is on sys.path via its conftest): two
CPU processes over gloo, rendezvous on a free loopback port. A failed launch fails the test with the ranks' stderr,
not only the exit status (CI of 173fc11 showed `returned non-zero exit status 1` and nothing else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from netfixtures import free_port

ROOT = Path(__file__).resolve().parents[1]


def trainer_env() -> dict[str, str]:
    """The environment a trainer process of a test runs in (one torch thread, the repository importable)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(args: list[str], cwd: Path, timeout: float, nproc: int = 2) -> None:
    """Run `torchrun --nproc-per-node nproc <args>` (e.g. `["-m", "trainer.cli", "--config", ...]`) in `cwd`."""
    env = trainer_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *args]
    r = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True)
    if r.returncode != 0:
        tail = r.stderr.decode(errors="replace")[-8000:]
        raise AssertionError(f"torchrun exited {r.returncode}: {' '.join(cmd[1:])}\n--- stderr (tail) ---\n{tail}")
