"""A network run started from a trained checkpoint (`prime-devnet up --init`): the tiny model of another seed (same
architecture, other weights) is version 0. The trainer publishes it through the origin and on chain; nodes and
validators pull it over the relay like any later version; the nodes' v0 work, made with the checkpoint's weights,
is accepted by both validators and nothing is slashed, and the same work would not verify against the base model
(the seed-0 weights every role would otherwise have used for v0). Slow tier: a devnet on 2 cores, ~2-4 min."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from benchload import load_bench
from safetensors.torch import load_file

from contracts.deployment import Deployment
from contracts.devchain import dev_identity
from contracts.policy import PolicyHistory
from contracts.pool import PoolClient
from contracts.transactor import connect
from devnet.network import TINY
from environments import get as get_environment
from models.checkpoint import load_checkpoint, save_checkpoint
from models.loading import LoadedModel, load
from models.sampling import SamplingParams
from protocol.envelope import Envelope
from protocol.model_spec import TinyModelSpec
from protocol.rollout import RunSpec, Submission
from protocol.seeds import sampling_seed, task_seed
from shardcast.manifest import SignedManifest
from toploc.thresholds import ToplocThresholds
from toploc.validation import Rollout, measure
from validator.assignment import prompt_tokens
from validator.config import CheckSettings


def _failures(loaded: LoadedModel, sub: Submission, run: RunSpec, chain_id: int, pool: str) -> list[str]:
    """The validator's model checks of `sub` (TOPLOC, sampling replay) run with `loaded`'s weights: what fails."""
    env = get_environment(run.env, run.env_version)
    tasks = env.sample(task_seed(sub.node, sub.policy_version, sub.counter, run_id=run.run_id, chain_id=chain_id,
                                 pool=pool, manifest_hash=bytes(sub.manifest_hash)), run.tasks_per_batch)
    rollouts = [Rollout(prompt_tokens(loaded, task), list(s.tokens), list(s.proofs),
                        sampling_seed(sub.node, sub.policy_version, task.task_id, i, run_id=run.run_id,
                                      chain_id=chain_id, pool=pool, counter=sub.counter,
                                      manifest_hash=bytes(sub.manifest_hash)), run.max_new_tokens)
                for task, tr in zip(tasks, sub.tasks, strict=True) for i, s in enumerate(tr.samples)]
    c = CheckSettings()
    th = ToplocThresholds(max_exp_mismatches=c.max_exp_mismatches, max_mant_err_mean=c.max_mant_err_mean,
                          max_mant_err_median=c.max_mant_err_median,
                          sampling_margin_tolerance=c.sampling_margin_tolerance,
                          max_sampling_mismatches=c.max_sampling_mismatches)
    reports = measure(loaded, rollouts, SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p),
                      th)
    out = []
    for j, rep in enumerate(reports):
        assert rep.error is None, rep.error
        if th.failing_chunks(rep.proofs):
            out.append(f"sample {j}: proof")
        if th.sampling_failed(rep.sampling):
            out.append(f"sample {j}: sampling")
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_started_from_a_checkpoint_generates_and_checks_v0_with_the_checkpoint(tmp_path: Path) -> None:
    base_spec = TinyModelSpec.model_validate(TINY)
    init = load(base_spec.model_copy(update={"seed": 1}))
    ckpt = save_checkpoint(init.model, init.tokenizer, tmp_path / "init")
    ckpt_weights = load_file(ckpt / "model.safetensors")
    base = load(base_spec)
    assert not torch.equal(ckpt_weights["model.embed_tokens.weight"], base.model.model.embed_tokens.weight)

    churn = load_bench("churn")
    run = churn.Run(tmp_path / "devnet", False, 10.0, ["--init", str(ckpt), "--nodes", "2", "--validators", "2",
                                                     "--trainer.max-steps", "2"])
    try:
        run.up()
        run.wait("a step trained on v0 work", lambda: run.step() >= 0, 600)
        layout = run.layout
        assert layout.init == str(ckpt.resolve())

        # v0 on chain is the manifest the trainer signed for the checkpoint's weights, served by the relay
        dep = Deployment.load(Path(layout.deployment))
        pool = PoolClient(connect(layout.rpc_url), dep.pool, dev_identity(0))  # reads only (DEV ONLY key)
        history = PolicyHistory(pool, dep.start_block)
        history.refresh()
        signed = SignedManifest.parse(httpx.get(f"{layout.relays[0]}/v/0/manifest", timeout=10).content)
        assert signed.manifest.version == 0 and signed.signer.lower() == layout.trainer["address"].lower()
        assert history.manifest_hash(0) == signed.manifest.content_hash()

        # nodes and validators pulled v0 over the relay: its weights are the checkpoint's, not the base model's
        for name in [n["name"] for n in layout.nodes] + [v["name"] for v in layout.validators]:
            pulled = load_file(run.state / name / "weights" / "v0" / "model.safetensors")
            assert pulled.keys() == ckpt_weights.keys(), name
            assert all(torch.equal(pulled[k], ckpt_weights[k]) for k in pulled), name

        # both nodes' v0 work accepted, nothing rejected hard, nothing slashed
        accepted: list[tuple[str, dict[str, Any]]] = []
        for v in layout.validators:
            items = httpx.get(v["url"] + "/v1/submissions", timeout=10).json()["items"]
            assert not [i for i in items if i["outcome"] == "rejected_hard"], items
            accepted += [(v["url"], i) for i in items if i["policy_version"] == 0 and i["outcome"] == "accepted"]
        assert {i["node"].lower() for _, i in accepted} == {n["address"].lower() for n in layout.nodes}, accepted
        events = {e.name for e in pool.events(dep.start_block)}
        assert not events & {"WorkInvalidated", "StakeSlashed", "SlashEscrowed", "NodeEjected"}, events

        # the same v0 work verifies with the checkpoint's weights and would not with the base model's
        url, item = accepted[0]
        row = httpx.get(f"{url}/v1/submissions/{item['work_key']}", timeout=10).json()
        envelope = Envelope.model_validate_json(httpx.get(f"{url}/v1/envelopes/{row['submission_hash']}",
                                                          timeout=10).content)
        sub = Submission.model_validate(envelope.body)
        run_spec = RunSpec.model_validate(layout.run)
        assert _failures(load_checkpoint(ckpt), sub, run_spec, dep.chain_id, dep.pool) == []
        assert _failures(base, sub, run_spec, dep.chain_id, dep.pool) != []

        audit = run.audit(120)
        assert audit["ok"], audit["mismatches"]
    finally:
        run.stop()
