"""The benchmarks' `--smoke` runs, started in the background when the session's tests are collected.

Each `python -m bench.<name> --smoke --json out.json` is a subprocess that costs seconds to minutes of CPU (a
whole devnet for `faults` and `learning`), and most of the suite waits on servers and subprocesses, so
the runs start as soon as collection ends (`tests/conftest.py`), at a lower CPU priority (nice 10), and
soak up the CPU the suite leaves idle; `tests/unit/bench/test_bench_smoke.py` then only waits for its
program's result. Two run at a time: one lane for the programs that start a devnet (never two devnets
beside each other), one for the rest. Once a smoke test waits, the suite has nothing else to do, so every
run still going (and every one still to start) is put back to normal priority (`hurry`): on a box busy
with other work a niced run would crawl.

Only the selected tests' programs run (`-k`, `-m`, a single file: whatever pytest selected).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TEST = "test_smoke_mode_runs_and_writes_its_json"
"""The test (`tests/unit/bench/test_bench_smoke.py`) whose `name` parameters say which programs to run."""
DEVNETS = frozenset({"faults", "learning"})
"""Programs whose smoke starts a whole devnet: they run one after another in a lane of their own."""
TIMEOUT_S = 900
"""A smoke run is killed after running this long at normal priority: counted from its start, or, for a run
started niced in the background, from when a test first waits (`hurry`), whichever is later. Before that a
niced run may get almost no CPU on a busy box, and the session's end stops it anyway (`stop`)."""
NICE = 10

Result = tuple[int, str, str]


class Smoke:
    """One program's smoke run; `run()` returns (exit code, stdout, stderr) and leaves its JSON at `out`."""

    def __init__(self, name: str, work: Path, hurried: threading.Event | None = None,
                 hurried_time: list[float] | None = None) -> None:
        self.name, self.work, self.out = name, work, work / "out.json"
        self.proc: subprocess.Popen[str] | None = None
        self.stopped = threading.Event()
        self.hurried = hurried or threading.Event()
        self.hurried_time = hurried_time if hurried_time is not None else []
        """When `hurried` was set (one shared list, empty until then)."""

    def run(self, nice: int = 0) -> Result:
        if self.stopped.is_set():
            return -1, "", "not started: the session ended"
        nice = 0 if self.hurried.is_set() else nice
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"bench.{self.name}", "--smoke", "--json", str(self.out)],
            cwd=self.work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        started = time.monotonic()
        while True:
            try:
                stdout, stderr = self.proc.communicate(timeout=5)  # retried: no output is lost (subprocess docs)
                return self.proc.returncode, stdout, stderr
            except subprocess.TimeoutExpired:
                if self.hurried.is_set() or not nice:
                    since = max(started, self.hurried_at() if nice else started)
                    if time.monotonic() - since > TIMEOUT_S:
                        break
        self.stop()
        stdout, stderr = self.proc.communicate()
        return self.proc.returncode, stdout, stderr + f"\nkilled after {TIMEOUT_S} s at normal priority"

    def hurried_at(self) -> float:
        return self.hurried_time[0] if self.hurried_time else time.monotonic()

    def _tree(self) -> list[psutil.Process]:
        """The run's process and everything it started (a devnet's roles live in process groups of their own)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def renice(self) -> None:
        """Back to normal priority (raising priority needs root or CAP_SYS_NICE; elsewhere it stays niced)."""
        for p in self._tree():
            try:
                p.nice(0)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def stop(self) -> None:
        """Kill the run and everything it started."""
        self.stopped.set()
        if self.proc is None:
            return
        for p in self._tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


class Background:
    """The session's smoke runs: name -> (run, future of its result)."""

    def __init__(self, names: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
        self.hurried = threading.Event()
        self.hurried_time: list[float] = []
        self.runs = {n: Smoke(n, self.dir / n, self.hurried, self.hurried_time) for n in names}
        for run in self.runs.values():
            run.work.mkdir()
        self.lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"bench-smoke-{i}") for i in range(2)]
        self.futures: dict[str, Future[Result]] = {}
        for name in sorted(names):
            lane = self.lanes[0 if name in DEVNETS else 1]
            self.futures[name] = lane.submit(self.runs[name].run, NICE)

    def hurry(self) -> None:
        """A test waits: every run from now on at normal priority (see the module docstring)."""
        if not self.hurried_time:
            self.hurried_time.append(time.monotonic())
        self.hurried.set()
        for run in self.runs.values():
            run.renice()

    def stop(self) -> None:
        for run in self.runs.values():
            run.stop()
        for lane in self.lanes:
            lane.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)


_started: Background | None = None


def start(names: list[str]) -> None:
    """Start the smoke runs of `names` (called once, when collection ends)."""
    global _started
    if names and _started is None:
        _started = Background(names)


def started() -> Background | None:
    return _started


def stop() -> None:
    global _started
    if _started is not None:
        _started.stop()
        _started = None
