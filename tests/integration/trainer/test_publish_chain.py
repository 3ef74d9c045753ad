"""The trainer records each SHARDCAST version on chain (`publishPolicy`, by the manifest-signing key) and
announces it over discovery; a resumed trainer does not try to record a version twice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from chainfaults import Background, manual_mining, pending, wait_for
from chainfixtures import TRAINER, Pools

from bench.loopback import TINY
from discovery.admission import Trust
from discovery.config import DiscoveryConfig
from discovery.service import Discovery
from models.checkpoint import save_checkpoint
from models.loading import load
from protocol.errors import ConfigError
from protocol.rollout import submission_domain
from shardcast.manifest import SignedManifest
from trainer import publish as publish_module
from trainer.config import ShardcastPublish
from trainer.publish import ShardcastPublisher

pytestmark = pytest.mark.timeout(120)


def test_each_version_is_recorded_on_chain_and_announced(published: Pools, deployment_file: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = published.chain.account(TRAINER)
    monkeypatch.setenv("TEST_TRAINER_KEY", trainer.account.key.hex())
    m = load(TINY)
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / "step-2")
    settings = ShardcastPublish.model_validate({
        "store": tmp_path / "origin", "run_id": "test-run", "key_env": "TEST_TRAINER_KEY",
        "chain": {"deployment": deployment_file, "rpc_url": published.chain.rpc_url},
        "announce_urls": ["http://127.0.0.1:8600"],
        "discovery": {"enabled": True, "listen": ["/ip4/127.0.0.1/tcp/0"], "reannounce_s": 1.0, "target_peers": 0}})
    publisher = ShardcastPublisher(settings)
    assert publisher.discovery is not None
    domain = submission_domain(published.deployment.chain_id, published.deployment.pool, "test-run")
    listener = Discovery(DiscoveryConfig(enabled=True, bootstrap=publisher.discovery.addrs, reannounce_s=1.0,
                                         target_peers=0), identity=None, domain=domain,
                         trust=Trust(trainer=trainer.address), state_dir=tmp_path / "listener")
    listener.start()
    try:
        publisher.publish(2, ckpt)
        version, manifest = published.admin.policy()
        assert version == 2 and manifest != b"\x00" * 32
        deadline = time.monotonic() + 30
        while (current := listener.board.current_policy()) is None:
            assert time.monotonic() < deadline, "the announcement did not arrive"
            time.sleep(0.1)
        assert current.body.policy_version == 2 and bytes(current.body.manifest_hash) == manifest  # type: ignore[union-attr]
        # a trainer resumed into a fresh store publishes v2 again: the chain, already at v2, is not asked twice
        again = ShardcastPublisher(settings.model_copy(update={"store": tmp_path / "origin2",
                                                               "discovery": DiscoveryConfig()}))
        again.publish(2, ckpt)
        again.close()
        assert published.admin.policy() == (2, manifest)
    finally:
        listener.stop()
        publisher.close()


def test_a_version_stored_before_a_kill_but_not_on_chain_is_recorded_as_stored_when_handed_again(
        published: Pools, deployment_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer killed between signing version 2 into its store and `publishPolicy` (publishing runs on a thread
    after the checkpoint is saved) resumed at step 2 and never published it: nodes waited for v2 on chain, the
    trainer for their v2 rollouts (`bench.faults`, CI run 54). The resumed run hands its checkpoint again
    (`trainer.runner.republish_resumed`); the publisher records the stored manifest, not a second signature."""
    monkeypatch.setenv("TEST_TRAINER_KEY", published.chain.account(TRAINER).account.key.hex())
    m = load(TINY)
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / "step-2")
    offline = ShardcastPublish.model_validate({"store": tmp_path / "origin", "run_id": "test-run",
                                               "key_env": "TEST_TRAINER_KEY"})
    ShardcastPublisher(offline).publish(2, ckpt)  # signed into the store; the process dies before the chain
    manifest = (tmp_path / "origin" / "versions" / "2" / "manifest.json").read_bytes()
    assert published.admin.policy()[0] == 1
    resumed = ShardcastPublisher(offline.model_copy(update={"chain": ShardcastPublish.model_validate({
        "chain": {"deployment": deployment_file, "rpc_url": published.chain.rpc_url}}).chain}))
    try:
        resumed.publish(2, ckpt)
    finally:
        resumed.close()
    version, recorded = published.admin.policy()
    assert version == 2 and recorded == SignedManifest.parse(manifest).manifest.content_hash()
    assert (tmp_path / "origin" / "versions" / "2" / "manifest.json").read_bytes() == manifest


def test_a_key_without_the_trainer_role_stops_the_trainer_before_its_first_step(
        published: Pools, deployment_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_TRAINER_KEY", published.chain.account(5).account.key.hex())
    settings = ShardcastPublish.model_validate({
        "store": tmp_path / "origin", "key_env": "TEST_TRAINER_KEY",
        "chain": {"deployment": deployment_file, "rpc_url": published.chain.rpc_url}})
    with pytest.raises(ConfigError, match="TRAINER_ROLE"):
        ShardcastPublisher(settings)


def _chain_publisher(published: Pools, deployment_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     **transactor: float) -> ShardcastPublisher:
    monkeypatch.setenv("TEST_TRAINER_KEY", published.chain.account(TRAINER).account.key.hex())
    settings = ShardcastPublish.model_validate({
        "store": tmp_path / "origin", "run_id": "test-run", "key_env": "TEST_TRAINER_KEY",
        "chain": {"deployment": deployment_file, "rpc_url": published.chain.rpc_url}})
    publisher = ShardcastPublisher(settings)
    for name, value in transactor.items():
        setattr(publisher.pool.tx, name, value)
    return publisher


def test_publish_policy_survives_a_dropped_transaction(published: Pools, deployment_file: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    chain, trainer = published.chain, published.chain.account(TRAINER)
    m = load(TINY)
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / "step-3")
    publisher = _chain_publisher(published, deployment_file, tmp_path, monkeypatch, probe_s=0.1)
    try:
        with manual_mining(chain):
            send = Background(lambda: publisher.publish(3, ckpt))
            wait_for(lambda: len(pending(chain, trainer.address)) == 1, "publishPolicy in the pool", timeout=60)
            chain.rpc("anvil_dropAllTransactions")
            wait_for(lambda: len(pending(chain, trainer.address)) == 1, "publishPolicy sent again")
            assert publisher.pool.tx.resent == 1
            chain.rpc("evm_mine")
            send.result()
        version, manifest = published.admin.policy()
        assert version == 3 and any(manifest)
    finally:
        publisher.close()


def test_publish_policy_is_tried_again_after_no_receipt(published: Pools, deployment_file: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured failure: `no receipt ... after 120s` and the version never recorded. Now the publisher
    tries again until the chain shows it (here the first copy lands once blocks come again)."""
    chain = published.chain
    m = load(TINY)
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / "step-4")
    publisher = _chain_publisher(published, deployment_file, tmp_path, monkeypatch, receipt_timeout=0.3,
                                 probe_s=600.0)
    try:
        with manual_mining(chain):
            send = Background(lambda: publisher.publish(4, ckpt))
            wait_for(lambda: publisher.record_retries >= 1, "publishPolicy tried again", timeout=60)
            chain.rpc("evm_mine")
            send.result()
        assert published.admin.policy()[0] == 4
    finally:
        publisher.close()


def test_a_version_a_deep_rollback_removed_while_the_trainer_was_down_is_recorded_again(
        published: Pools, deployment_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39 item 1: a 32-block revert took `publishPolicy(3)` away (deeper than any confirmation count) while
    the trainer was down; restarted on its store, it sends it again without waiting for a new step (nodes need
    the version on chain to make the work that step waits for)."""
    chain = published.chain
    m = load(TINY)
    ckpt = save_checkpoint(m.model, m.tokenizer, tmp_path / "step-3")
    before = published.admin.policy()
    snapshot = chain.snapshot()
    first = _chain_publisher(published, deployment_file, tmp_path, monkeypatch)
    try:
        first.publish(3, ckpt)  # returns once version 3 is on chain
        recorded = published.admin.policy()
        assert recorded[0] == 3
    finally:
        first.close()
    chain.rpc("anvil_mine", [hex(32)])
    chain.revert(snapshot)
    assert published.admin.policy() == before
    restarted = _chain_publisher(published, deployment_file, tmp_path, monkeypatch)
    try:
        wait_for(lambda: published.admin.policy() == recorded, "version 3 on chain again", timeout=60)
    finally:
        restarted.close()


def test_a_closed_publisher_sends_nothing_more(published: Pools, deployment_file: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """CI run 45: a publisher closed while its reconcile pass ran went on after `close`, found its publishPolicy
    gone (the next test's chain had been reverted under it) and sent it again there: that test read v3 where it
    published v2. `close` now returns only once the pass under way has ended."""
    monkeypatch.setattr(publish_module, "RECONCILE_S", 0.05)
    publisher = _chain_publisher(published, deployment_file, tmp_path, monkeypatch)
    real, started, ended = publisher.pool.tx.reconcile, threading.Event(), threading.Event()

    def slow_reconcile() -> int:
        started.set()
        time.sleep(1.0)  # a pass that takes a while (RPC calls on a loaded box)
        try:
            return int(real())
        finally:
            ended.set()

    publisher.pool.tx.reconcile = slow_reconcile
    assert started.wait(60), "no reconcile pass began"
    publisher.close()
    assert ended.is_set(), "close returned while a reconcile pass was still running"
