"""The trainer publishes its checkpoints through SHARDCAST: signed versions an origin serves and a node pulls."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.errors import ConfigError, KeystoreError
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.manifest import SignedManifest
from tests.unit.trainer.rollout_factory import directory_run_config, write_step_files
from trainer.config import ShardcastPublish
from trainer.publish import ShardcastPublisher

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3

PUBLISH = """
[checkpoint]
dir = "{ckpt}"
keep = 2
[publish]
type = "shardcast"
store = "{store}"
run_id = "run-7"
key_env = "TEST_TRAINER_KEY"
retention = 2
"""


@pytest.mark.timeout(180)
def test_trainer_checkpoints_reach_a_node_through_origin_and_relay(tmp_path: Path) -> None:
    trainer = Identity.create()  # a throwaway key for this test only
    rollouts, ckpt, store = tmp_path / "rollouts", tmp_path / "ckpt", tmp_path / "origin"
    write_step_files(rollouts, STEPS, groups=2, size=4, vocab=320)
    cfg = tmp_path / "c.toml"
    cfg.write_text(directory_run_config(steps=STEPS, rollouts=rollouts, extra=PUBLISH.format(ckpt=ckpt, store=store)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TEST_TRAINER_KEY": "0x" + bytes(trainer.account.key).hex()}
    subprocess.run([sys.executable, "-m", "trainer.cli", "--config", str(cfg), "--metrics-file",
                    str(tmp_path / "m.jsonl")], env=env, check=True, timeout=150, capture_output=True)

    # Version numbers are the trainer's steps; retention kept the newest two and the bases a kept delta version needs,
    # down to its anchor (which versions travel as deltas depends on how many weights a step moved); nothing private
    # left the trainer.
    versions = sorted(int(p.name) for p in (store / "versions").iterdir())
    manifests = {v: SignedManifest.parse((store / "versions" / str(v) / "manifest.json").read_bytes())
                 for v in versions}
    assert versions[-2:] == [STEPS - 1, STEPS]
    needed = set()
    for version in (STEPS - 1, STEPS):
        while True:
            needed.add(version)
            ref = manifests[version].manifest.delta
            if ref is None:
                break
            version = ref.base_version
    assert set(versions) == needed
    assert not (store / ".trainer-staging").exists()
    for version, signed in manifests.items():
        signed.verify(trainer.address, run_id="run-7", version=version)
        names = {f.path for f in signed.manifest.weight_files} | {f.path for f in signed.manifest.files}
        assert "model.safetensors" in names
        assert not names & {"optimizer.pt", "rng.pt", "trainer_state.json"}

    async def broadcast() -> Path:
        async with Origin(store, run_id="run-7", port=0) as origin, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", port=0) as relay:
            client = Client([relay.url], trainer=trainer.address, run_id="run-7", out_dir=tmp_path / "node",
                            progress=False, wait_s=30)
            result = await client.pull()
            assert result.version == STEPS
            return result.path

    pulled = asyncio.run(asyncio.wait_for(broadcast(), 90))
    final = ckpt / f"step-{STEPS}"
    for name in ("model.safetensors", "config.json"):
        assert (pulled / name).read_bytes() == (final / name).read_bytes()
    assert not (pulled / "optimizer.pt").exists()


def test_publisher_needs_exactly_one_key_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        ShardcastPublisher(ShardcastPublish(store=tmp_path / "s"))
    with pytest.raises(ConfigError, match="exactly one"):
        ShardcastPublisher(ShardcastPublish(store=tmp_path / "s", keystore=tmp_path / "k.json", key_env="X"))


def test_wrong_keystore_password_fails_when_the_publisher_is_built(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keystore = tmp_path / "trainer.json"
    Identity.create().save_keystore(keystore, "right-password")
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "wrong-password")
    with pytest.raises(KeystoreError):
        ShardcastPublisher(ShardcastPublish(store=tmp_path / "s", keystore=keystore))
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "right-password")
    assert ShardcastPublisher(ShardcastPublish(store=tmp_path / "s", keystore=keystore)).identity.address
