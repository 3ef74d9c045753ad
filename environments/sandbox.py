"""Running untrusted Python in separate, locked-down processes and collecting its return values.

The grader never executes candidate code itself. It starts a supervisor (`python -I -S -c
<sandbox_harness>`) in a new session with a scrubbed environment and no inherited descriptors,
sends it the code and the hidden *inputs*, and reads control lines back; the supervisor forks the
candidate, which locks itself down before running the code (see `sandbox_harness` for the layers and
the README for what holds in which mode). Expected outputs never leave the grader.

Outcomes are split by whose fault they are:
- the candidate's (its code failed to compile, raised, ran out of wall or CPU time, memory or disk,
  crashed, wrote garbage): a `SandboxResult` whose failed inputs count as wrong;
- the grader's (no isolation available, the supervisor could not start in time, died, or broke
  its protocol): `UngradableError` (`SandboxUnavailableError` when isolation is missing), never a
  reward, so a loaded or misconfigured grader cannot fail an honest answer.
"""

from __future__ import annotations

import base64
import binascii
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
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from protocol.canonical import parse_json
from protocol.errors import ConfigError, ProtocolError, UngradableError

log = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("sandbox_harness.py").read_text()

IsolationMode = Literal["auto", "namespaces", "uid", "none"]
ISOLATION_ENV = "PRIME_SANDBOX_ISOLATION"
"""Environment variable that sets the default `SandboxLimits.isolation` (an operator's switch)."""
_GRACE_S = 5.0
"""How long past the candidate's wall time the grader waits for the supervisor's final report."""
_CONTROL = frozenset({"isolation", "result", "end", "unavailable", "failed"})
_warned: set[str] = set()


class SandboxUnavailableError(UngradableError):
    """The sandbox cannot isolate candidates here (not root, or namespaces refused when required)."""

    code = "sandbox_unavailable"


def _isolation_default() -> str:
    value = os.environ.get(ISOLATION_ENV, "auto")
    if value not in get_args(IsolationMode):
        raise ConfigError(f"{ISOLATION_ENV}={value!r}: choose one of {', '.join(get_args(IsolationMode))}")
    return value


class SandboxLimits(BaseModel):
    """Limits for one sandboxed run (one candidate against all its hidden inputs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = 10.0
    """Wall-clock seconds for the candidate, from the moment it is locked down; then it is killed."""
    start_s: float = 30.0
    """Seconds the sandbox may take to start (interpreter, namespaces, lock-down). Past it the run is
    ungradable: a slow start is the grader's load, not the candidate's fault."""
    cpu_s: int = 5
    """RLIMIT_CPU seconds (SIGKILL at the limit)."""
    memory_bytes: int = 512 * 2**20
    """RLIMIT_AS: address space of the candidate."""
    file_bytes: int = 2**20
    """RLIMIT_FSIZE: largest file the candidate may write."""
    workdir_bytes: int = 4 * 2**20
    """Total size of the working directory: a tmpfs of this size with namespaces; otherwise the
    supervisor measures it every 20 ms and kills the candidate past it (`workdir_full`)."""
    workdir_files: int = 256
    """Most files and directories in the working directory (tmpfs inodes, or the same check)."""
    output_bytes: int = 4 * 2**20
    """Most bytes the candidate may send back; past this it is killed (`oversize_output`)."""
    max_result_bytes: int = 2**20
    """Largest single JSON result line; a bigger return value counts as an error for that input."""
    isolation: IsolationMode = Field(default_factory=_isolation_default, validate_default=True)
    """`auto` (default; env PRIME_SANDBOX_ISOLATION overrides it): namespaces when root may create
    them, else a per-run uid; refused when the grader is not root. `namespaces`/`uid` require that
    mode. `none`: the candidate runs as the grader's own user (it can read the grader's files and
    environment and signal it); only for trusted code or a grader that is itself in a throwaway VM."""


class SandboxResult(BaseModel):
    """What came back from one run (the candidate's outcome; grader failures raise instead)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    values: tuple[JsonValue, ...]
    """Per input: `{"value": v}` or `{"error": "ExceptionName"}`; `{"error": "missing"}` when the
    candidate died, timed out or never answered for that input; `{"error": "malformed"}` for a line
    that is not a result."""
    isolation: dict[str, Any] = Field(default_factory=dict)
    """The layers the candidate process had (mode, netns, pidns, proc, root, uid, rlimits, audit)."""
    fatal: str | None = None
    """Why the run stopped early: the code's compile/exec error type, `timeout`, `oversize_output`,
    `workdir_full`, `crashed`."""
    wall_s: float = 0.0
    """Wall time of the run."""


def resolve_isolation(requested: str, euid: int) -> str:
    """The mode to ask the supervisor for; `SandboxUnavailableError` when it cannot be had here."""
    if requested == "none":
        if "none" not in _warned:
            _warned.add("none")
            log.warning("code sandbox: isolation=none, candidates run as this process's user and can "
                        "read its environment and files and signal it")
        return "none"
    if euid != 0:
        raise SandboxUnavailableError(
            f"the code sandbox needs root to isolate candidates (isolation={requested!r}, euid {euid}): "
            "run the grader as root, e.g. in a container (with CAP_SYS_ADMIN for namespaces), or accept "
            f"running candidate code as this user with {ISOLATION_ENV}=none or "
            "SandboxLimits(isolation='none')")
    return requested


def run_sandboxed(code: str, entry_point: str, inputs: list[list[JsonValue]],
                  limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `entry_point(*args)` from `code` for each `args` in `inputs`, in a locked-down child.

    Raises `UngradableError` when the sandbox itself failed (see the module docstring).
    """
    limits = limits or SandboxLimits()
    mode = resolve_isolation(limits.isolation, os.geteuid())
    started = time.monotonic()
    # The working directory without namespaces (with them, a tmpfs inside the sandbox is used).
    with tempfile.TemporaryDirectory(prefix="prime-sandbox-", ignore_cleanup_errors=True) as workdir:
        request = json.dumps({
            "code": code, "entry_point": entry_point, "inputs": inputs, "mode": mode,
            "workdir": workdir, "wall_s": limits.wall_s, "start_s": limits.start_s,
            "max_result_bytes": limits.max_result_bytes,
            "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                       "file_bytes": limits.file_bytes, "workdir_bytes": limits.workdir_bytes,
                       "workdir_files": limits.workdir_files, "output_bytes": limits.output_bytes},
        }).encode()
        messages = _supervise(request, limits)
    return _result(messages, len(inputs), time.monotonic() - started)


def _supervise(request: bytes, limits: SandboxLimits) -> list[dict[str, Any]]:
    """Start the supervisor, feed it, collect its control lines, and always kill its group."""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True, close_fds=True)
    except OSError as exc:  # EAGAIN, ENOMEM, EMFILE, an interpreter we may not run...
        raise UngradableError(f"code sandbox could not start: {exc}") from exc
    assert proc.stdin is not None and proc.stdout is not None
    messages: list[dict[str, Any]] = []
    # Base64 of the candidate's bytes plus our own small lines: twice its budget is ample.
    budget = 2 * limits.output_bytes + 2**20
    deadline = time.monotonic() + limits.start_s + _GRACE_S
    buf = b""
    size = 0
    try:
        try:
            proc.stdin.write(request)  # the supervisor reads all of stdin before anything else
            proc.stdin.close()
        except OSError as exc:
            raise UngradableError(f"code sandbox died at start: {exc}") from exc
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while not messages or not ({"end", "unavailable", "failed"} & messages[-1].keys()):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise UngradableError(
                        "code sandbox did not report in time" if messages
                        else f"code sandbox did not start within {limits.start_s:.0f} s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise UngradableError(f"code sandbox supervisor died (exit {proc.poll()})")
                size += len(chunk)
                if size > budget:
                    raise UngradableError("code sandbox supervisor sent more than its budget")
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = _control(line)
                    if "isolation" in msg:  # the candidate's clock starts now
                        deadline = time.monotonic() + limits.wall_s + _GRACE_S
                    messages.append(msg)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.stdout.close()
        proc.wait()
    if "unavailable" in messages[-1]:
        raise SandboxUnavailableError(f"code sandbox cannot isolate here: {messages[-1]['unavailable']}")
    if "failed" in messages[-1]:
        raise UngradableError(f"code sandbox could not start the candidate: {messages[-1]['failed']}")
    return messages


def _control(line: bytes) -> dict[str, Any]:
    """One supervisor line. Only the supervisor can write this pipe, so a bad line is our failure."""
    try:
        msg = parse_json(line)
    except ProtocolError as exc:
        raise UngradableError(f"code sandbox supervisor sent a malformed line: {exc}") from exc
    if not isinstance(msg, dict) or len(msg) != 1 or not _CONTROL & msg.keys():
        raise UngradableError("code sandbox supervisor sent an unknown message")
    return msg


def _candidate_line(encoded: object) -> dict[str, JsonValue]:
    """One line the candidate wrote: its claim about one input. Anything odd is its own error."""
    try:
        raw = base64.b64decode(str(encoded), validate=True)
        msg = parse_json(raw)
    except (ProtocolError, binascii.Error, ValueError):
        return {"error": "malformed"}
    if isinstance(msg, dict) and "value" in msg:
        return {"value": msg["value"]}
    if isinstance(msg, dict) and isinstance(msg.get("error"), str):
        return {"error": msg["error"][:100]}
    if isinstance(msg, dict) and isinstance(msg.get("fatal"), str):
        return {"fatal": msg["fatal"][:100]}
    return {"error": "malformed"}


def _result(messages: list[dict[str, Any]], n_inputs: int, wall_s: float) -> SandboxResult:
    isolation = messages[0].get("isolation") if messages else None
    end = messages[-1]["end"] if messages else None
    if not isinstance(isolation, dict) or not isinstance(end, dict):
        raise UngradableError("code sandbox supervisor broke its protocol")
    mode = isolation.get("mode")
    if mode == "uid" and "uid" not in _warned:
        _warned.add("uid")
        log.warning("code sandbox: namespaces unavailable, candidates are isolated by a per-run uid "
                    "only (no network or file system namespaces; see environments/README.md)")
    lines = [_candidate_line(m.get("result")) for m in messages[1:-1]]
    fatal = end.get("fatal")
    if lines and "fatal" in lines[0]:  # the code did not compile or its module body raised
        fatal = str(lines.pop(0)["fatal"])
        lines = []
    lines = [{"error": "malformed"} if "fatal" in v else v for v in lines]
    values = tuple(lines[i] if i < len(lines) else {"error": "missing"} for i in range(n_inputs))
    return SandboxResult(values=values, isolation=isolation,
                         fatal=None if fatal is None else str(fatal), wall_s=wall_s)
