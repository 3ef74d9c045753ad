"""`prime-validator` killed with SIGKILL while it is still checking, then started again on the same state:
every submission reaches its final state once (one row, one verdict, on chain once, in the feed once).

The real CLI runs as a subprocess against anvil; checks run one submission at a time
(`--checks.batch-submissions 1`), so the kill lands while most rows are still `received` and one is
leased by the checker. Both ledger backends: SQLite in the state dir, and PostgreSQL (`--ledger-dsn`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import VALIDATOR, Pools
from netfixtures import free_port, wait_http
from pgcluster import pg_cluster, pg_dsn  # noqa: F401 - fixtures of the postgres parameter

from bench.adversaries import SimNode
from bench.loopback import REPORTER_MAX_BACKOFF_S, RUN, TINY
from contracts.devchain import dev_key
from contracts.pool import WorkStatus
from validator.ledger import Ledger

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]
KEY_ENV = "PRIME_TEST_VALIDATOR_KEY"
HONEST, CHEATS = 6, 1
STARTUP_S = 300.0
"""Bounds a start-up that hangs; one that is slow on a busy box is waited for."""


def _flags(prefix: str, values: dict[str, Any]) -> list[str]:
    return [arg for k, v in values.items() for arg in (f"--{prefix}{k.replace('_', '-')}", str(v))]


class ValidatorProcess:
    """`python -m validator.cli` on a loopback port, its output in a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "validator.cli", *argv, "--port", str(self.port)], cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO), KEY_ENV: "0x" + dev_key(
                    VALIDATOR).hex(), "OMP_NUM_THREADS": "1"})
        try:  # while the process lives: its start-up (imports, the model) took over 90 s beside two other suites
            wait_http(f"{self.url}/health", timeout=STARTUP_S, alive=self.proc)
        except AssertionError as exc:
            self.kill()
            raise AssertionError(f"{exc}\n{self.tail()}") from None

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, as an operator stops it; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_target(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Where the validator's ledger lives: its state dir (SQLite) or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return {"path": tmp_path / "state" / "ledger.sqlite"}
    return {"dsn": request.getfixturevalue("pg_dsn")}


@pytest.fixture
def processes() -> Iterator[list[ValidatorProcess]]:
    started: list[ValidatorProcess] = []
    yield started
    for p in started:
        p.kill()


def _states(url: str, keys: list[str]) -> dict[str, dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=10) as c:
        out = {}
        for key in keys:
            r = c.get(f"/v1/submissions/{key}")
            assert r.status_code == 200, (key, r.status_code, r.text)  # no submission is ever lost
            out[key] = r.json()
        return out


def _decided(c: httpx.Client) -> int:
    """Rows this validator has decided, in one request (its running tallies, no ledger scan)."""
    counts = c.get("/v1/audit", params={"rows": "false"}).json()["counts"]
    return int(counts["received"]) - int(counts["pending"])


def test_killed_while_checking_then_restarted_every_row_finishes_once(
    published: Pools, make_node: Any, ledger_target: dict[str, Any], processes: list[ValidatorProcess],
    tmp_path: Path,
) -> None:
    dep = published.deployment.save(tmp_path / "deployment.json")
    state = tmp_path / "state"
    argv = ["--state-dir", str(state), "--chain.deployment", str(dep), "--chain.rpc-url", published.chain.rpc_url,
            "--chain.poll-s", "0.2", "--key.key-env", KEY_ENV, "--checks.batch-submissions", "1",
            "--reporter.interval-s", "0.2", "--reporter.max-backoff-s", str(REPORTER_MAX_BACKOFF_S),
            "--systemic.window-s", "0.5",
            *_flags("run.", RUN.model_dump(exclude_defaults=True)),
            *_flags("model.", {"type": TINY.type, **TINY.model_dump(exclude_defaults=True)})]
    if "dsn" in ledger_target:
        argv += ["--ledger-dsn", ledger_target["dsn"]]
    log = tmp_path / "validator.log"

    honest: SimNode = make_node()
    cheater: SimNode = make_node()
    # The cheats go in the first batch only: a node with a hard verdict not yet on chain is held at intake.
    batch = [honest.build()[1] for _ in range(HONEST)] + [cheater.build(cheat="inflate_reward")[1]
                                                          for _ in range(CHEATS)]
    posted: list[bytes] = []
    keys: list[str] = []
    cheat_keys: list[str] = []
    done = 0  # rows decided (in the ledger) when the batch was posted
    # SIGKILL as soon as the checker has decided one row of the batch, while the rest are still received (one
    # leased). How far the checker got before the kill depends on the box's load (ci once saw every row decided
    # before an 8-request poll came round): the progress is read in one request, the process is stopped
    # (SIGSTOP) the moment it shows, and when the kill still came too late the validator is started again on
    # the same state and a new batch is posted, until a kill lands mid-checking.
    for attempt in range(5):
        first = ValidatorProcess(argv, log)
        processes.append(first)
        with httpx.Client(base_url=first.url, timeout=30) as c:
            answers = [c.post("/v1/submissions", content=data) for data in batch]
            assert [a.status_code for a in answers] == [202] * len(batch), [a.text for a in answers]
            new = [a.json()["work_key"] for a in answers]
            posted += batch
            keys += new
            cheat_keys += new[HONEST:] if attempt == 0 else []
            deadline = time.monotonic() + 120
            while _decided(c) <= done:
                assert time.monotonic() < deadline, f"nothing decided in 120 s\n{first.tail()}"
                time.sleep(0.02)
        first.proc.send_signal(signal.SIGSTOP)  # no further progress from here
        first.kill()
        ledger = Ledger.open(**ledger_target)
        try:
            counts = ledger.counts()
        finally:
            ledger.close()
        if counts.get("state:received", 0) >= 2:  # the kill came mid-checking (one row is leased)
            break
        done = len(keys) - counts.get("state:received", 0)
        batch = [honest.build()[1] for _ in range(HONEST)]
    else:
        raise AssertionError(f"in 5 tries the checker decided every row before the kill: {counts}")
    honest_keys = [k for k in keys if k not in cheat_keys]

    second = ValidatorProcess(argv, log)  # the same state dir, the same ledger
    # each start hid its start-up objects from the collector before serving (validator.server.settle_heap)
    frozen = [int(n) for n in re.findall(r"start-up's (\d+) objects kept out of garbage collection", log.read_text())]
    assert len(frozen) >= 2 and min(frozen) > 100_000, frozen
    processes.append(second)
    deadline = time.monotonic() + 150
    while True:
        rows = _states(second.url, keys)
        if all(r["state"] == "reported" for r in rows.values()):
            break
        assert time.monotonic() < deadline, f"not all reported: {[r['state'] for r in rows.values()]}\n{second.tail()}"
        time.sleep(0.2)

    # every submission has its one final verdict
    assert {k: (rows[k]["outcome"], rows[k]["reason"]) for k in honest_keys} == {
        k: ("accepted", "accepted") for k in honest_keys}, second.tail()
    assert {k: (rows[k]["outcome"], rows[k]["reason"]) for k in cheat_keys} == {
        k: ("rejected_hard", "reward_mismatch") for k in cheat_keys}
    # on chain exactly once: one WorkRecorded per accepted key, one WorkInvalidated per cheat
    for key in honest_keys:
        assert published.admin.get_work(key).status == WorkStatus.ACCEPTED
    for key in cheat_keys:
        assert published.admin.get_work(key).status == WorkStatus.HARD_INVALIDATED
    events = published.admin.events(published.deployment.start_block, names={"WorkRecorded", "WorkInvalidated"})
    recorded = sorted("0x" + bytes(e.args["workKey"]).hex() for e in events if e.name == "WorkRecorded")
    invalidated = sorted("0x" + bytes(e.args["workKey"]).hex() for e in events if e.name == "WorkInvalidated")
    assert recorded == sorted(honest_keys) and invalidated == sorted(cheat_keys)
    # the trainer's feed: one item per accepted key, none for the cheat
    with httpx.Client(base_url=second.url, timeout=30) as c:
        feed = c.get("/v1/feed", params={"after": 0, "limit": 1024}).json()
        assert sorted(i["work_key"] for i in feed["items"]) == sorted(honest_keys)
        # the same bytes posted again after the restart: the same answer, no new row
        again = [c.post("/v1/submissions", content=data) for data in posted]
        assert [a.status_code for a in again] == [200] * len(posted)
        assert [a.json()["verdict"] for a in again] == [rows[k]["verdict"] for k in keys]
    assert second.stop() == 0, second.tail()
    ledger = Ledger.open(**ledger_target)
    try:  # no duplicate and no stray row: exactly the posted submissions, each reported
        assert ledger.counts() == {"state:reported": len(posted), "outcome:accepted": len(honest_keys),
                                   "outcome:rejected_hard": CHEATS}
        assert ledger.feed_size() == len(honest_keys)
    finally:
        ledger.close()
