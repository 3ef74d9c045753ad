"""Running untrusted Python in a separate, locked-down process and collecting its return values.

The grader never executes candidate code itself. It starts `python -I -S -c <sandbox_harness>` in a
new session, sends the code and the hidden *inputs* on stdin, reads one JSON line per input back
(bounded in bytes), and kills the whole process group at the wall-clock deadline. Expected outputs
never leave the grader. What the child enforces is described in `sandbox_harness`; the README
lists which layers hold where (root with namespaces here; rlimits and audit hooks elsewhere).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

log = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("sandbox_harness.py").read_text()
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class SandboxLimits(BaseModel):
    """Limits for one sandboxed run (one candidate against all its hidden inputs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = 10.0
    """Wall-clock seconds for the whole run, interpreter start included; then the group is killed."""
    cpu_s: int = 5
    """RLIMIT_CPU seconds (SIGXCPU/SIGKILL beyond it)."""
    memory_bytes: int = 512 * 2**20
    """RLIMIT_AS: address space of the child."""
    file_bytes: int = 2**20
    """RLIMIT_FSIZE: largest file the child may write."""
    tmpfs_bytes: int = 4 * 2**20
    """Size of each fresh tmpfs (the working directory's and the ones hiding host directories)."""
    output_bytes: int = 4 * 2**20
    """Most bytes read back from the child; past this the run is killed (oversize output)."""
    max_result_bytes: int = 2**20
    """Largest single JSON result line; a bigger return value counts as an error for that input."""
    isolate: bool = True
    """Use namespaces and drop to `nobody` when running as root; False leaves only the rlimits and
    the audit hook (how the sandbox runs for a non-root grader; tests use it to check those alone)."""
    hidden_dirs: tuple[str, ...] = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run", _REPO_ROOT)
    """Directories covered by an empty tmpfs inside the sandbox (needs mount namespaces)."""


class SandboxResult(BaseModel):
    """What came back from one run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    values: tuple[JsonValue, ...]
    """Per input: `{"value": v}` or `{"error": "ExceptionName"}`, or `{"error": "missing"}` when the
    child died, timed out or never answered for that input."""
    isolation: dict[str, Any] = Field(default_factory=dict)
    """The layers the child reports active (netns, hidden dirs, uid, rlimits, audit)."""
    fatal: str | None = None
    """Why the whole run failed: compile/exec error type, `timeout`, `oversize_output`, `crashed`."""
    wall_s: float = 0.0
    """Wall time of the run."""


def run_sandboxed(code: str, entry_point: str, inputs: list[list[JsonValue]],
                  limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `entry_point(*args)` from `code` for each `args` in `inputs`, in a locked-down child."""
    limits = limits or SandboxLimits()
    request = json.dumps({
        "code": code, "entry_point": entry_point, "inputs": inputs,
        "hidden": [d for d in limits.hidden_dirs if os.path.isdir(d)],
        "isolate": limits.isolate,
        "fallback_workdir": "",  # filled below when namespaces are unavailable
        "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                   "file_bytes": limits.file_bytes, "tmpfs_bytes": limits.tmpfs_bytes,
                   "max_result_bytes": limits.max_result_bytes},
    })
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prime-sandbox-") as fallback:
        os.chmod(fallback, 0o777)  # the child may have dropped to `nobody`
        request = request.replace('"fallback_workdir": ""', f'"fallback_workdir": {json.dumps(fallback)}', 1)
        raw, fatal = _communicate(request.encode(), limits)
    results: dict[int, JsonValue] = {}
    isolation: dict[str, Any] = {}
    for line in raw.split(b"\n"):
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # a torn last line after a kill, or bytes the candidate wrote to the channel
        if not isinstance(msg, dict):
            continue
        if "isolation" in msg and not isolation and isinstance(msg["isolation"], dict):
            isolation = msg["isolation"]
        elif "fatal" in msg and fatal is None:
            fatal = str(msg["fatal"])[:100]
        elif isinstance(msg.get("i"), int) and msg["i"] not in results:
            # First line per input wins; the harness writes it, though code could race it there.
            results[msg["i"]] = {k: msg[k] for k in ("value", "error") if k in msg}
    values = tuple(results.get(i, {"error": "missing"}) for i in range(len(inputs)))
    return SandboxResult(values=values, isolation=isolation, fatal=fatal,
                         wall_s=time.monotonic() - started)


def _communicate(request: bytes, limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Start the child, feed it, read its output within the limits, and always kill its group."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, cwd="/", env=env, start_new_session=True, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    fatal: str | None = None
    deadline = time.monotonic() + limits.wall_s
    try:
        try:
            proc.stdin.write(request)  # the child reads all of stdin before anything else
            proc.stdin.close()
        except OSError:
            fatal = "crashed"
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while fatal is None:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    fatal = "timeout"
                    break
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > limits.output_bytes:
                    fatal = "oversize_output"
                    break
                chunks.append(chunk)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.stdout.close()
        proc.wait()
    if fatal is None and proc.returncode not in (0, -signal.SIGKILL):
        # Killed by RLIMIT_CPU (SIGXCPU), a segfault from deep recursion, os._exit(n)...
        fatal = "crashed" if proc.returncode < 0 else None
    return b"".join(chunks), fatal
