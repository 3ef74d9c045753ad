"""Same seed, same tasks and rewards: in another process (fresh hash salt) and against pinned digests."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import environments

REPO = Path(environments.__file__).resolve().parents[1]
NAMES = ["reverse-text", "arithmetic", "math", "code", "arithmetic+length-max"]
SEED = 0xC0FFEE_2026

SCRIPT = """
import hashlib, json, sys
import environments
out = {}
for name in json.loads(sys.argv[1]):
    env = environments.get(name)
    tasks = env.sample(int(sys.argv[2]), 6)
    rewards = [env.reward(t, t.answer) for t in tasks[:3] if name != "code"]
    out[name] = {"ids": [t.task_id for t in tasks], "rewards": rewards,
                 "digest": hashlib.sha256(json.dumps([t.model_dump(mode="json") for t in tasks],
                                                     sort_keys=True).encode()).hexdigest()}
print(json.dumps(out))
"""

# Pinned so that a change of generator output (or of Python's `random`) is caught, not silently
# forked between node and validator: bump the environment's version when these must change.
PINNED_FIRST_IDS = {
    "reverse-text": "6b4964cdbc280219acac10f94f7433b4",
    "arithmetic": "6a84799ed8d71a94f85b4a922df96df6",
    "math": "6df1bf6f7882d63697a92f305f71dc46",
    "code": "ddc691ce70a7f9d7830768e847af56c4",
    "arithmetic+length-max": "52671bbe5f7e26f6b59e8d96032811a8",
}


def _run_here() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name in NAMES:
        env = environments.get(name)
        tasks = env.sample(SEED, 6)
        rewards = [env.reward(t, t.answer) for t in tasks[:3] if name != "code"]
        out[name] = {"ids": [t.task_id for t in tasks], "rewards": rewards,
                     "digest": hashlib.sha256(json.dumps([t.model_dump(mode="json") for t in tasks],
                                                         sort_keys=True).encode()).hexdigest()}
    return out


def _run_elsewhere(hash_seed: str) -> dict[str, dict[str, object]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(NAMES), str(SEED)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_two_processes_agree() -> None:
    here = _run_here()
    assert _run_elsewhere("1") == here
    assert _run_elsewhere("4242") == here


def test_pinned_tasks() -> None:
    here = _run_here()
    for name, first_id in PINNED_FIRST_IDS.items():
        assert here[name]["ids"][0] == first_id, name  # type: ignore[index]
