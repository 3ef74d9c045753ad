"""The devnet's process table: a role and its children stop together, and the table says so."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from devnet.processes import ProcessTable, stop_groups

# a parent that starts a child (the child ignores nothing: it is the group that is signalled)
PARENT = ("import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring SIGTERM', flush=True); "
            "time.sleep(600)")


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan killed with its group waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.timeout(60)
def test_stopping_a_role_stops_its_children_and_is_recorded(tmp_path: Path) -> None:
    table = ProcessTable(tmp_path)
    entry = table.start("role", "node", [sys.executable, "-c", PARENT])
    deadline = time.monotonic() + 20
    while len(entry.group_members()) < 2:
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    members = entry.group_members()
    header, entries = ProcessTable.read(tmp_path)
    assert [e.name for e in entries] == ["role"] and entries[0].pid == entry.pid and entries[0].alive()
    table.stop_all(["role"], grace_s=5)
    assert not any(running(pid) for pid in members)
    _, entries = ProcessTable.read(tmp_path)
    assert entries[0].stopped_at is not None and not entries[0].alive()


@pytest.mark.timeout(60)
def test_a_group_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    table = ProcessTable(tmp_path)
    entry = table.start("stubborn", "relay", [sys.executable, "-c", STUBBORN])
    deadline = time.monotonic() + 30  # its handler is installed once it says so (a loaded machine: seconds)
    while "ignoring SIGTERM" not in Path(entry.log).read_text():
        assert time.monotonic() < deadline, "the stubborn process never started"
        time.sleep(0.02)
    assert stop_groups([entry], grace_s=0.5) == ["stubborn"]
    assert not entry.group_members()


@pytest.mark.timeout(60)
def test_an_exited_supervisor_not_yet_reaped_is_not_running() -> None:
    """`prime-devnet down` waits for the supervisor to end: one that exited but whose parent has not reaped it yet
    (a test that started `up` and now runs `down`) is done, or `down` waited 120 s for a zombie."""
    import subprocess

    from devnet.processes import proc_start_time
    from devnet.processes import running as supervisor_running

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = proc_start_time(proc.pid)
        assert supervisor_running(proc.pid, start)
        assert not supervisor_running(proc.pid, (start or 0) + 1)  # a recycled pid is not ours
        proc.kill()
        deadline = time.monotonic() + 30
        while running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_start_time(proc.pid) == start  # a zombie: still in /proc, same start time, not reaped
        assert not supervisor_running(proc.pid, start)
    finally:
        proc.kill()
        proc.wait()
