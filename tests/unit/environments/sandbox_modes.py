"""The code sandbox's isolation modes this machine can run, for tests that need one or all."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from environments.sandbox import SandboxLimits, SandboxUnavailableError, run_sandboxed


@functools.cache
def namespaces_refused() -> str | None:
    """Why namespace mode cannot run here, or None when it can (probed once with a real run)."""
    if os.geteuid() != 0:
        return "namespace mode needs root"
    try:
        run_sandboxed("def f():\n    return 1", "f", [[]], SandboxLimits(isolation="namespaces"))
    except SandboxUnavailableError as exc:
        return f"namespace mode unavailable here: {exc}"
    return None


def skip_unless_mode(mode: str) -> None:
    """Skip the calling test when `mode` cannot (or, as root, should not) run on this machine."""
    if mode == "namespaces" and (why := namespaces_refused()):
        pytest.skip(why)
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("uid mode needs root (it switches the candidate to a uid of its own)")
    if mode == "none" and os.geteuid() == 0:
        pytest.skip("as root, mode none would run hostile test code as root; the uid mode covers the fallback")


def candidate_processes(uid: int) -> list[int]:
    """Live processes running as `uid` (a candidate's own uid; no other run shares it). Zombies are
    dead: one orphaned by a killed supervisor waits for the machine's init to reap it."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry))
    return pids
