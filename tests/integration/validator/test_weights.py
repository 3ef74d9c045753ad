"""The validator checks a published version with the weights it pulled over SHARDCAST, and only after the
installed manifest matches the hash the trainer recorded on chain."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from netfixtures import free_port

from bench.loopback import RUN, TINY
from contracts.devchain import dev_identity
from models.checkpoint import save_checkpoint
from models.loading import load
from protocol.model_spec import HFModelSpec
from shardcast.publisher import publish_blocking
from validator.weights import WeightsUnavailable

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[3]
TRAINER_INDEX = 2  # PUBLIC anvil dev account holding TRAINER_ROLE in the test deployment


def test_a_version_pulled_over_shardcast_and_matching_the_chain_is_checked_with_its_weights(
        make_validator, make_node, published, tmp_path):
    trainer = dev_identity(TRAINER_INDEX)
    v2 = load(TINY.model_copy(update={"seed": 2}))
    ckpt = save_checkpoint(v2.model, v2.tokenizer, tmp_path / "ckpt")
    signed = publish_blocking(ckpt, tmp_path / "origin", identity=trainer, run_id=RUN.run_id, version=2)
    port = free_port()
    origin = subprocess.Popen(
        [sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "origin", "--store", str(tmp_path / "origin"),
         "--run-id", RUN.run_id, "--port", str(port)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        honest, lazy = make_node(), make_node()
        v = make_validator(weights={"type": "shardcast", "relays": [f"http://127.0.0.1:{port}"],
                                    "trainer": trainer.address, "base_version": 1})
        with v.client() as c:
            deadline = time.monotonic() + 60
            while not (v.service.weights.dir / "v2").is_dir():  # pulled, but not on chain yet
                assert time.monotonic() < deadline, "the validator did not pull v2"
                time.sleep(0.2)
            assert c.get("/ready").status_code == 200  # v1 (base) is current
            published.trainer.publish_policy(2, signed.manifest.content_hash())
            while c.get("/ready").json()["detail"] != "checking v1..v2":
                assert time.monotonic() < deadline, c.get("/ready").text
                time.sleep(0.2)
        pulled = load(HFModelSpec(name_or_path=str(ckpt)))
        honest.manifest_hash = lazy.manifest_hash = signed.manifest.content_hash()
        good = v.wait_reported(_post(v, honest.build(version=2, model=pulled)[1]))
        assert good["outcome"] == "accepted", good["detail"]
        stale_weights = v.wait_decided(_post(v, lazy.build(version=2)[1]))  # generated with v1's weights
        assert (stale_weights["outcome"], stale_weights["reason"]) == ("rejected_hard", "proof_mismatch")
    finally:
        origin.terminate()
        origin.wait(timeout=10)


def _post(v, data: bytes) -> str:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=v.url, timeout=30) as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code == 202, r.text
        return str(r.json()["work_key"])


def test_with_no_base_version_work_waits_for_the_pulled_weights_and_is_never_checked_with_the_base_model(
        make_validator, make_node):
    """`base_version = -1` (a run started from a trained checkpoint): the chain's v1 is not the base model, so work
    the node made with the base weights is not judged with them (it would pass) nor slashed while v1's weights are
    not here (our failure, never the node's): it waits for them."""
    trainer = dev_identity(TRAINER_INDEX)
    v = make_validator(weights={"type": "shardcast", "relays": [], "trainer": trainer.address, "base_version": -1})
    assert v.service.weights.base is None  # the base weights are not even loaded
    with pytest.raises(WeightsUnavailable):
        v.service.weights.get(1)
    key = _post(v, make_node().build(version=1)[1])
    with v.client() as c:
        deadline = time.monotonic() + 60
        while "policy version 1" not in str((row := c.get(f"/v1/submissions/{key}").json())["detail"]):
            assert row["state"] == "received", row  # never decided with the base model
            assert time.monotonic() < deadline, row
            time.sleep(0.1)
        assert row["state"] == "received" and row["outcome"] is None, row
        assert c.get("/ready").status_code != 200
