"""The node follows the policy over real SHARDCAST relays: it generates with a version's weights once the
chain published that version's manifest hash, refuses a version whose manifest differs from the chain's,
and never generates with weights older than the async window allows."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from netfixtures import free_port, wait_http
from test_node_join import node_config

from bench.loopback import RUN, TINY
from contracts.devchain import dev_identity
from contracts.policy import PolicyHistory
from models.checkpoint import save_checkpoint
from models.loading import load
from node import commands
from node.engines import build_engine
from node.protection import SlashingProtection
from node.weights import PolicyWeights
from node.worker import ValidatorDirectory, Worker
from protocol.canonical import to_hex
from protocol.config import ShardcastWeights
from shardcast.publisher import publish_blocking

# slow tier: one fresh-clone CI run out of three saw the node's work loop make no batch for 60 s at the very
# start (no log line at all, under investigation); the same path runs in the default tier without relays.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
TRAINER_INDEX = 2  # PUBLIC anvil dev account holding TRAINER_ROLE in the test deployment


def _process(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def publish(tmp_path: Path, version: int) -> bytes:
    """Publish a tiny checkpoint as `version` into the origin's store (the trainer's step); its manifest hash."""
    m = load(TINY.model_copy(update={"seed": version}))
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / f"ckpt{version}")
    signed = publish_blocking(ckpt, tmp_path / "origin", identity=dev_identity(TRAINER_INDEX), run_id=RUN.run_id,
                              version=version)
    return signed.manifest.content_hash()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[str, dict[int, bytes]]]:
    """An origin holding v2 of the tiny model, and a relay below it: (relay URL, manifest hashes)."""
    trainer = dev_identity(TRAINER_INDEX)
    hashes = {2: publish(tmp_path, 2)}
    origin_port, relay_port = free_port(), free_port()
    procs = [_process("origin", "--store", str(tmp_path / "origin"), "--run-id", RUN.run_id, "--port",
                      str(origin_port))]
    try:
        wait_http(f"http://127.0.0.1:{origin_port}/health", alive=procs[0])
        procs.append(_process("relay", "--store", str(tmp_path / "relay"), "--port", str(relay_port), "--upstream",
                              f"http://127.0.0.1:{origin_port}", "--trainer", trainer.address, "--run-id", RUN.run_id))
        yield f"http://127.0.0.1:{relay_port}", hashes
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def test_the_node_generates_with_the_chains_version_pulled_over_relays_and_refuses_the_rest(
        published: Pools, deployment_file: Path, make_validator: Any, relay: tuple[str, dict[int, bytes]],
        tmp_path: Path) -> None:
    url, hashes = relay
    trainer = dev_identity(TRAINER_INDEX).address
    source = {"type": "shardcast", "relays": [url], "trainer": trainer, "base_version": 1}
    served = make_validator(weights=source)
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url], run=RUN, model=TINY,
                      max_batches=None, weights=source, submit={"max_pending": 1, "backoff_s": 0.05,
                                                                "max_backoff_s": 0.2, "decide_timeout_s": 5})
    chain = commands.open_chain(cfg)
    weights = PolicyWeights(ShardcastWeights.model_validate(source), TINY, RUN,
                            PolicyHistory(chain.client(node), chain.start_block),
                            lambda spec: build_engine(cfg.engine, spec), cfg.state_dir / "weights")
    failure: list[BaseException] = []
    with httpx.Client(timeout=5) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = Worker(cfg, node, RUN, commands.submission_domain(chain.chain_id, chain.pool, RUN.run_id), weights,
                        db, ValidatorDirectory([served.url], http, commands.validator_role(chain.client(node))))

        def run() -> None:
            try:
                worker.run_loop()
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                failure.append(exc)

        weights.start()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            # v1 is the base model; the relays' v2 is not used before the chain publishes it
            _wait(lambda: worker.tally.batches > 0 or failure or not thread.is_alive(),
                  f"no batch made: {worker.tally}", timeout=120)
            assert not failure, failure
            assert served.wait_decided(to_hex(published.work_key(RUN.run_id, node.address, 1, 0)))["outcome"] == "accepted"
            assert weights.loaded_version is None
            published.trainer.publish_policy(2, hashes[2])
            row = served.wait_decided(to_hex(published.work_key(RUN.run_id, node.address, 2, 0)), timeout=120)
            assert row["outcome"] == "accepted", row  # the validator's prefill with v2's weights agrees
            assert weights.loaded_version == 2

            # v3 on chain names another manifest than the relays serve: refused, v2 is still inside the window
            publish(tmp_path, 3)
            published.trainer.publish_policy(3, hashlib.sha256(b"another checkpoint").digest())
            _wait(lambda: 3 in weights.follower.installed(), "v3 did not reach the node")  # type: ignore[union-attr]
            done_v2 = _records(db, node.address, 2)
            _wait(lambda: _records(db, node.address, 2) >= done_v2 + 2, "the node stopped working on v2")
            # v4 leaves v2 outside the window (async_level 1): the node waits instead of generating stale work
            published.trainer.publish_policy(4, hashlib.sha256(b"not pulled anywhere").digest())
            _wait(lambda: worker.tally.state == "waiting" and "v3 or newer" in worker.tally.detail,
                  f"the node did not wait: {worker.tally}")
            assert "the chain recorded" in worker.tally.detail and "refused" in worker.tally.detail
            stalled = worker.tally.batches
            time.sleep(1.0)
            assert worker.tally.batches == stalled
            assert _records(db, node.address, 3) == 0 and _records(db, node.address, 4) == 0
            assert thread.is_alive() and not failure, failure
        finally:
            worker.stop()
            thread.join(timeout=60)
            weights.stop()
    assert not failure, failure


def _records(db: SlashingProtection, node: str, version: int) -> int:
    """Assignments at `version` this key has signed (from the slashing-protection record)."""
    return sum(1 for entry in db.export(node)["data"] for r in entry["signed"] if int(r["policy_version"]) == version)


def _wait(condition: Any, message: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)
