"""The devnet's process table: every role runs as its own process group, recorded in
`<state_dir>/processes.json` so that `prime-devnet status|down` (another terminal) and a fault suite
(`kill -9` of one role) can find each one by name.

Each entry: name, role, pid (= its process group id: started with `start_new_session`), the process's
start time (from /proc, so a recycled pid is never signalled), port, url, command, log file, and
`stopped_at` once the devnet stopped it. A role's children (none today) share its group, so stopping a
group leaves no orphan.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from devnet.tomlfile import write_atomic

log = logging.getLogger(__name__)

TABLE = "processes.json"


def proc_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def running(pid: int, start_time: int | None) -> bool:
    """`pid` is still the process that started at `start_time` and has not exited (a zombie, exited but not yet
    reaped by its parent, has not the right to be waited for)."""
    if start_time is None or proc_start_time(pid) != start_time:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class Entry:
    name: str
    role: str
    pid: int
    start_time: int | None
    command: list[str]
    log: str
    port: int | None = None
    url: str | None = None
    started_at: float = field(default_factory=time.time)
    stopped_at: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    """Times the devnet restarted this role after its process died (`up --restart`)."""

    def alive(self) -> bool:
        """The recorded process still runs (same pid and start time) and is not a zombie."""
        return running(self.pid, self.start_time)

    def group_members(self) -> list[int]:
        """Live pids in this entry's process group (its children included)."""
        members = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
            except (OSError, ValueError):
                continue
            if int(fields[2]) == self.pid and fields[0] != "Z":
                members.append(int(d.name))
        return members


class ProcessTable:
    """Starts roles in their own process groups and stops them; persisted after every change."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.logs = self.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, Entry] = {}
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._env: dict[str, tuple[dict[str, str] | None, Path | None]] = {}

    # -- persistence ------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self.state_dir / TABLE

    def save(self) -> None:
        data = {"supervisor": os.getpid(), "supervisor_start_time": proc_start_time(os.getpid()),
                "processes": [asdict(e) for e in self.entries.values()]}
        write_atomic(self.path, json.dumps(data, indent=1) + "\n")

    @staticmethod
    def read(state_dir: Path) -> tuple[dict[str, Any], list[Entry]]:
        """(the file's header: supervisor pid and start time, its entries); empty when there is none."""
        try:
            data = json.loads((Path(state_dir) / TABLE).read_text())
        except (OSError, ValueError):
            return {}, []
        return data, [Entry(**e) for e in data.get("processes", [])]

    # -- starting ---------------------------------------------------------------------------------

    def start(self, name: str, role: str, command: Sequence[str], *, env: dict[str, str] | None = None,
              port: int | None = None, url: str | None = None, cwd: Path | None = None) -> Entry:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
        entry = Entry(name, role, proc.pid, proc_start_time(proc.pid), list(command), str(log_path), port, url)
        self.entries[name] = entry
        self._popen[name] = proc
        self._env[name] = (env, cwd)
        self.save()
        log.info("started %s (pid %d%s)", name, proc.pid, f", {url}" if url else "")
        return entry

    def restart(self, name: str) -> Entry:
        """Start an exited role again with the same command, environment, port and log (appended to)."""
        old = self.entries[name]
        env, cwd = self._env[name]
        entry = self.start(name, old.role, old.command, env=env, port=old.port, url=old.url, cwd=cwd)
        entry.restarts = old.restarts + 1
        self.save()
        return entry

    def run(self, name: str, command: Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float = 120.0) -> None:
        """A one-shot job (the deploy): its output goes to its log; RuntimeError if it fails."""
        entry = self.start(name, "job", command, env=env)
        proc = self._popen[name]
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop_entry(entry)
            raise RuntimeError(f"{name} did not finish within {timeout:.0f} s; see {entry.log}") from None
        entry.stopped_at, entry.exit_code = time.time(), code
        self.save()
        if code != 0:
            raise RuntimeError(f"{name} failed with exit code {code}: {tail(Path(entry.log))}")

    def exited(self) -> Iterator[Entry]:
        """Started roles (not jobs, not stopped on purpose) whose process has exited."""
        for name, e in self.entries.items():
            proc = self._popen.get(name)
            if e.role != "job" and e.stopped_at is None and proc is not None and proc.poll() is not None:
                e.exit_code, e.stopped_at = proc.returncode, time.time()
                self.save()
                yield e

    # -- stopping ---------------------------------------------------------------------------------

    def stop_entry(self, entry: Entry, grace_s: float = 10.0) -> None:
        stop_groups([entry], grace_s)
        proc = self._popen.get(entry.name)
        if proc is not None:
            try:
                entry.exit_code = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                entry.exit_code = None
        entry.stopped_at = entry.stopped_at or time.time()

    def stop_all(self, order: Sequence[str], grace_s: float = 10.0) -> None:
        """SIGTERM role by role in `order` (names; the rest after), each group given `grace_s`, then SIGKILL."""
        names = [n for n in order if n in self.entries] + [n for n in self.entries if n not in order]
        for name in names:
            entry = self.entries[name]
            if entry.stopped_at is not None and not entry.group_members():
                continue
            self.stop_entry(entry, grace_s)
        self.save()


def stop_groups(entries: Sequence[Entry], grace_s: float = 10.0) -> list[str]:
    """SIGTERM each entry's process group, wait up to `grace_s` for all, SIGKILL what is left; the names of
    the groups that needed SIGKILL. Never signals a pid that no longer is the recorded process. Zombies (exited,
    not yet reaped by their parent) count as gone."""
    live = [e for e in entries if e.alive() or e.group_members()]
    for e in live:
        _signal_group(e, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(e.group_members() for e in live):
        time.sleep(0.1)
    killed = []
    for e in live:
        if e.group_members():
            killed.append(e.name)
            _signal_group(e, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(e.group_members() for e in live):
        time.sleep(0.05)
    return killed


def _signal_group(entry: Entry, sig: signal.Signals) -> None:
    # The group id is the leader's pid. If the leader is gone, its group may live on (children); a group id
    # is not reused while any member lives, so signalling it is safe as long as members remain.
    if not entry.alive() and not entry.group_members():
        return
    try:
        os.killpg(entry.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
