"""`kill -9` a working `prime-node join` at random moments and restart it on the same state directory: no
assignment is ever signed with two payloads, and every assignment it signed reaches the validator."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chainfixtures import OPERATOR, Pools

from bench.loopback import RUN
from protocol.canonical import to_hex
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[3]


def _signed(db: Path) -> list[tuple[int, int, str]]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as c:
        try:
            return [(int(v), int(n), str(s)) for v, n, s in
                    c.execute("SELECT policy_version, counter, state FROM signed ORDER BY policy_version, counter")]
        except sqlite3.OperationalError:  # the node is creating its tables right now
            return []


def test_kill_9_mid_batch_then_restart_signs_nothing_twice_and_loses_nothing(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    served = make_validator()
    config = tmp_path / "node.toml"
    config.write_text(f"""
state_dir = "{tmp_path / 'state'}"
validators = ["{served.url}"]
[key]
keystore = "{tmp_path / 'node-key.json'}"
scrypt_n = 16
[operator]
key_env = "TEST_OPERATOR_KEY"
[chain]
deployment = "{deployment_file}"
rpc_url = "{published.chain.rpc_url}"
poll_s = 0.2
[submit]
attempts = 3
backoff_s = 0.05
max_backoff_s = 0.5
decide_timeout_s = 120
[monitor]
port = 0
[preflight]
skip = true
""")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PRIME_KEYSTORE_PASSWORD": "pw",
           "TEST_OPERATOR_KEY": published.chain.account(OPERATOR).account.key.hex()}
    db = tmp_path / "state" / "protection.sqlite"
    rng = random.Random(7)
    kills = 0

    def tail(log: Path) -> str:
        return log.read_text(errors="replace")[-3000:]

    for life in range(3):  # a few lives, each killed with SIGKILL once it has signed something more
        before = len(_signed(db))
        log = tmp_path / f"life-{life}.log"  # a file, not a pipe nobody reads: a full pipe would block the node
        with log.open("wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "node.cli", "join", "--config", str(config)], cwd=REPO,
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 180
        while len(_signed(db)) <= before:
            assert proc.poll() is None, tail(log)
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the node signed nothing new in 180 s: {tail(log)}")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in generating, recording, sealing or posting
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kills += 1
    # the last life runs to completion: resends what the others left, then two more batches
    log = tmp_path / "last.log"
    with log.open("wb") as err:
        try:
            last = subprocess.run([sys.executable, "-m", "node.cli", "join", "--config", str(config),
                                   "--max-batches", "2"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the last life did not finish in 300 s: {tail(log)}") from None
    assert last.returncode == 0, tail(log)

    records = _signed(db)
    node = Identity.load_keystore(tmp_path / "node-key.json", "pw").address
    counters = [n for v, n, _ in records if v == 1]
    assert kills == 3 and counters == list(range(len(counters))) and len(counters) >= kills + 2
    for version, counter, state in records:
        row = served.wait_decided(to_hex(published.work_key(RUN.run_id, node, version, counter)))
        assert row["outcome"] == "accepted", row  # one payload per assignment, none lost
        assert state == "decided"
    assert "equivocation" not in json.dumps(served.service.ledger.node_summary(node))
