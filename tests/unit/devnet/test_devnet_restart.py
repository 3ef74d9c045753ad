"""The devnet's restart policy: a role killed with SIGKILL starts again with the same command, environment,
port and log, and the process table records the new pid and the restart count."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from devnet.processes import ProcessTable


def test_a_killed_role_restarts_with_the_same_command_and_environment(tmp_path: Path) -> None:
    table = ProcessTable(tmp_path)
    code = "import os, time; print(os.environ['ROLE_SECRET'], os.getpid(), flush=True); time.sleep(60)"
    first = table.start("relay-0", "relay", [sys.executable, "-c", code], env={"ROLE_SECRET": "s3"}, port=1234,
                        url="http://127.0.0.1:1234")
    try:
        deadline = time.monotonic() + 10
        while "s3 " not in Path(first.log).read_text() and time.monotonic() < deadline:  # it is up and working
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        exited = []
        while not exited and time.monotonic() < deadline:
            exited = list(table.exited())
            time.sleep(0.05)
        assert [e.name for e in exited] == ["relay-0"] and exited[0].exit_code == -signal.SIGKILL
        again = table.restart("relay-0")
        assert again.pid != first.pid and again.alive()
        assert (again.command, again.port, again.url, again.log, again.restarts) == (
            first.command, 1234, "http://127.0.0.1:1234", first.log, 1)
        _, entries = ProcessTable.read(tmp_path)
        assert [(e.pid, e.restarts) for e in entries] == [(again.pid, 1)]
        deadline = time.monotonic() + 10
        while Path(again.log).read_text().count("s3 ") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = Path(again.log).read_text().split()
        assert lines == ["s3", str(first.pid), "s3", str(again.pid)]  # same environment, one log appended to
    finally:
        table.stop_all(["relay-0"], grace_s=2)
