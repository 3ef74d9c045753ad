"""Validator cost: cheap checks, full checks against the node's generation, and a junk flood.

Everything runs against a real anvil pool (`contracts.devchain.DevChain`, `deploy_pool` like the
integration tests), with honest submissions built the way a node builds them (generate with
`models.engine.Engine`, grade, prove with `toploc.validation.prove`, seal a `Submission`).

1. Cheap checks: submissions/s through `Intake.receive` (size, envelope, signature, sender gate,
   replay guard, assignment, schema, the `received` ledger row), in-process on the pre-built honest
   submissions of each model (a fresh ledger and replay guard each round), and once over HTTP
   against the validator served by uvicorn in a subprocess (intake only, no checker running).
2. Full checks vs generation: rollout tokens/s of `Checker.check_pending` (reward recomputation,
   batched prefill with TOPLOC, sampling replay, termination and logprob checks, signed verdicts,
   ledger) against tokens/s of `Engine.generate` producing the same rollouts (one submission per
   generate call, as a node does), same model, threads and dtype, in this run. The ratio
   `validation_over_generation` is check time / generation time for the same tokens. Both dtypes are
   run by default (`--dtype both`; `auto`: the faster dense matmul here, for node and validator alike);
   rows are keyed `model:dtype` then. Check time is broken down by stage (exclusive times, from the
   pipeline's public timing hook `Core.timer`, a `protocol.timing.StageTimer`), and the model's part
   (body + LM head: the matmul FLOPs the check runs, each distinct prompt once) is given in GFLOP/s and
   as a fraction of this machine's matmul peak in that dtype (`matmul_peak`: the best of the
   `models.kernels` paths on a 1024 x 1024 weight at 512 rows, the better of the start and the end).
   `check_floor_at_peak` is the lowest check/generation this machine allows for this work: the check's
   matmul FLOPs at that peak, with everything else (attention, replay, TOPLOC, ledger) free, over the
   measured generation time. Where it is above a goal, no validator code reaches the goal here.
3. Junk flood: N junk POSTs (malformed bytes, forged signatures, correctly signed submissions of
   unregistered nodes, oversized bodies declared and chunked) at a running validator (a subprocess,
   all its loops on, like `prime-validator`); its VmRSS is sampled from /proc during the flood
   (`bench.validator_http`).

The anchors are in the same run: generation for full checks; the RSS before the flood for memory.
Sender rate limits are lifted (`rate_per_node`) so cheap-check throughput measures the checks.

    python -m bench.validator --json out.json          # tiny + SmolLM2, 10,000 junk (~15 minutes)
    python -m bench.validator --quick                  # tiny only, fewer rollouts (~2 minutes)
    python -m bench.validator --smoke --json out.json  # every stage once on the smallest inputs (seconds)
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench import validator_http as vhttp  # the validator as a process: HTTP intake and the junk flood

TOKEN = 10**18
ADMIN, VALIDATOR, TRAINER, OPERATOR, TREASURY = 0, vhttp.VALIDATOR, 2, 3, 9  # PUBLIC anvil dev accounts


# -- timing helpers ---------------------------------------------------------------------------------


# The pipeline's own timing hook (`Core.timer`, `protocol.timing.StageTimer`) fills these labels; a rename
# there fails here loudly (a missing key when a table row is looked up), never silently.
INTAKE_STAGES = {
    "intake.parse": "envelope parse + canonical check",
    "intake.open": "body validation + signature recovery",
    "intake.gate": "sender gate + replay guard (SQLite)",
    "intake.lookup": "submission hash + ledger lookups",
    "intake.assignment": "assignment",
    "intake.cheap_checks": "run, version, manifest, tasks, schema",
    "intake.insert": "ledger insert (SQLite commit)",
    "intake.receipt": "signed receipt of the answer",
}
CHECK_STAGES = {
    "check.ledger": "ledger claim + decide",
    "check.rewards": "rewards (decode + grade)",
    "check.measure": "batching, prompts, padding",
    "measure.prefill": "prefill (model body)",
    "measure.lm_head": "lm head logits",
    "measure.toploc": "TOPLOC verify",
    "measure.sampling": "sampling replay",
    "measure.termination": "termination",
    "measure.logprobs": "logprobs + per-sequence glue",
    "check.verdict": "verdict measurements + feed item",
    "verdict.seal": "signing verdicts + feed items",
    "check.parse": "parsing stored envelopes",
    "check.tasks": "task sampling",
}


def labelled(timer: Any, names: dict[str, str]) -> dict[str, float]:
    """The timer's seconds under the bench's labels (a label the pipeline no longer fills reads 0)."""
    unknown = set(timer.times) - set(names)
    if unknown:
        raise RuntimeError(f"the pipeline timed stages this bench does not know: {sorted(unknown)}")
    return {label: timer.times.get(key, 0.0) for key, label in names.items()}


def matmul_gflops(dtype: str, seconds: float, n: int = 512) -> float:
    """Dense n x n matmul GFLOP/s in `dtype` (small n: bf16 without AMX runs at < 1 GFLOP/s)."""
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    torch.mm(a, b)
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        k += 1
    return 2 * n**3 * k / (time.perf_counter() - t0) / 1e9


def matmul_peak(dtype: str, seconds: float) -> dict[str, Any]:
    """The best GFLOP/s of any `models.kernels` path in `dtype` on a dense 1024 x 1024 weight at 512 rows (the
    fastest of many single calls: other processes on a shared box only ever slow a call down)."""
    import torch

    from models.kernels import Linear, candidates

    dt = getattr(torch, dtype)
    w, x = (torch.randn(1024, 1024) * 0.02).to(dt), torch.randn(512, 1024).to(dt)
    rates: dict[str, float] = {}
    with torch.inference_mode():
        for path in candidates(dt):
            lin = Linear(w, None, path)
            lin(x)
            fastest, t0 = math.inf, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                t1 = time.perf_counter()
                lin(x)
                fastest = min(fastest, time.perf_counter() - t1)
            rates[path] = 2 * 512 * 1024 * 1024 / fastest / 1e9
    best = max(rates, key=lambda p: rates[p])
    return {"gflops": rates[best], "path": best, "paths": rates}


# -- chain and validator --------------------------------------------------------------------------


class Chain:
    """anvil + the pool deployed like the integration tests, some registered nodes, policy v1."""

    def __init__(self, n_nodes: int, manifest: bytes, fund_rewards: int = 100 * TOKEN) -> None:
        from contracts.deployment import PoolSettings, deploy_pool
        from contracts.devchain import DevChain
        from contracts.pool import PoolClient
        from contracts.transactor import Transactor, connect
        from protocol.identity import Identity

        self.devchain = DevChain.start()
        c = self.devchain
        settings = PoolSettings(min_stake=10 * TOKEN, unbonding_period=300, invalidation_window=100,
                                reward_lock_period=200, reward_per_unit=10**15, slash_penalty=4 * TOKEN)
        self.deployment = deploy_pool(
            Transactor(connect(c.rpc_url), c.account(ADMIN)), treasury=c.account(TREASURY).address,
            settings=settings, validators=[c.account(VALIDATOR).address], trainers=[c.account(TRAINER).address],
            mint={c.account(i).address: 1000 * TOKEN for i in (ADMIN, OPERATOR)}, fund_rewards=fund_rewards)
        operator = PoolClient(connect(c.rpc_url), self.deployment.pool, c.account(OPERATOR))
        # Fixed node keys, so the same tasks (and so the same rollouts) come up in every run.
        self.nodes = [Identity.from_key(hashlib.sha256(f"bench node {i}".encode()).digest()) for i in range(n_nodes)]
        for node in self.nodes:
            operator.register(node, settings.min_stake)
        PoolClient(connect(c.rpc_url), self.deployment.pool, c.account(TRAINER)).publish_policy(1, manifest)
        self.rpc_url = c.rpc_url
        self.validator = c.account(VALIDATOR)

    def stop(self) -> None:
        self.devchain.stop()


def validator_config(state_dir: Path, deployment: Path, rpc_url: str, run: Any, model: Any, dtype: str,
                     threads: int) -> Any:
    from validator.config import ValidatorConfig

    return ValidatorConfig.model_validate({
        "state_dir": state_dir, "run": run, "model": model, "dtype": dtype, "threads": threads,
        "chain": {"deployment": deployment, "rpc_url": rpc_url, "poll_s": 0.5},
        "key": {"key_env": vhttp.KEY_ENV}, "reporter": {"enabled": False},
        "max_age_s": 3600.0,  # submissions are built minutes before they are checked
        "rate_per_node": 1e9, "rate_burst": 10**9,  # measure the checks, not the sender limit
        # the bench posts without upload headers from one address: the anonymous pool out of the way too
        "gate": {"anonymous_slots": 1024, "anonymous_slots_per_address": 1024},
        # bf16: honest replay margins drift up to ~0.3 here (node decode vs validator prefill round differently),
        # so the EOS near-tie band is the sampling tolerance, as checks.eos_tie_drift's docs ask of bf16 nodes;
        # at the fp32 default (0.01) an honest skipped near-tie EOS (margin 0.08) was slashed, on either path
        **({"checks": {"eos_tie_drift": 0.5}} if dtype == "bfloat16" else {}),
    })


def fresh_pipeline(service: Any, state: Path) -> tuple[Any, Callable[[], None]]:
    """A new validator core (`validator.core.Core`) on the service's chain view and loaded model, with a new
    ledger and replay guard."""
    from protocol.nonce import NonceCounter
    from protocol.replay import ReplayGuard
    from validator.core import Core
    from validator.ledger import Ledger

    state.mkdir(parents=True)
    ledger = Ledger.open(path=state / "ledger.sqlite")
    replay, nonces = ReplayGuard(state / "replay.sqlite"), NonceCounter(state / "nonces.sqlite")
    p = Core.build(service.cfg, service.identity, ledger, service.chain, service.weights, domain=service.domain,
                   replay_guard=replay, nonces=nonces)

    def close() -> None:
        ledger.close()
        replay.close()
        nonces.close()

    return p, close


# -- the node side ----------------------------------------------------------------------------------


class NodeSide:
    """Honest submissions built like `SimNode.build`; `generate_pass` re-times `Engine.generate` alone."""

    def __init__(self, loaded: Any, nodes: list[Any], n_subs: int, run: Any, chain_id: int, pool: str,
                 manifest: bytes) -> None:
        from environments import get as get_environment
        from environments import render_prompt
        from models.engine import Engine
        from models.sampling import SamplingParams
        from protocol.seeds import sampling_seed, task_seed

        self.loaded, self.run = loaded, run
        self.env = get_environment(run.env, run.env_version)
        self.params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
        self.engine = Engine(loaded)
        self.jobs = []
        for i in range(n_subs):
            node, counter = nodes[i % len(nodes)], i // len(nodes)
            where = {"run_id": run.run_id, "chain_id": chain_id, "pool": pool}
            tasks = self.env.sample(task_seed(node.address, 1, counter, manifest_hash=manifest, **where),
                                    run.tasks_per_batch)
            prompts, seeds = [], []
            for task in tasks:
                ids = render_prompt(loaded.tokenizer, task, tokenize=True)
                ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
                for s in range(run.samples_per_task):
                    prompts.append(ids)
                    seeds.append(sampling_seed(node.address, 1, task.task_id, s, counter=counter,
                                               manifest_hash=manifest, **where))
            self.jobs.append((node, counter, tasks, prompts, seeds))
        self.engine.generate([self.jobs[0][3][0]], self.params, [1], 4)  # warm-up
        self.tokens = self.prompt_tokens = self.distinct_prompt_tokens = self.sequences = 0

    def build(self, domain: str, manifest: bytes) -> tuple[list[bytes], float, float]:
        """(sealed submissions, seconds in Engine.generate, seconds grading + proving + sealing)."""
        from protocol.envelope import seal
        from protocol.nonce import random_nonce
        from protocol.rollout import SampleRollout, Submission, TaskRollouts
        from toploc.validation import prove

        run, datas, gen_s, node_s = self.run, [], 0.0, 0.0
        for node, counter, tasks, prompts, seeds in self.jobs:
            t0 = time.perf_counter()
            gens = self.engine.generate(prompts, self.params, seeds, run.max_new_tokens)
            t1 = time.perf_counter()
            task_rollouts = []
            for t, task in enumerate(tasks):
                samples = []
                for g in gens[t * run.samples_per_task : (t + 1) * run.samples_per_task]:
                    text = str(self.loaded.tokenizer.decode(g.tokens, skip_special_tokens=True))
                    samples.append(SampleRollout(
                        tokens=tuple(g.tokens), logprobs=tuple(g.logprobs), finish_reason=g.finish_reason,
                        reward=self.env.reward(task, text, completion_tokens=len(g.tokens)),
                        proofs=tuple(prove(g.hidden_states))))
                task_rollouts.append(TaskRollouts(task_id=task.task_id, samples=tuple(samples)))
            sub = Submission(run_id=run.run_id, node=node.address, policy_version=1, manifest_hash=manifest,
                             counter=counter, env=run.env, env_version=run.env_version, tasks=tuple(task_rollouts))
            datas.append(seal(node, sub, domain=domain, nonce=random_nonce()).to_bytes())
            gen_s, node_s = gen_s + t1 - t0, node_s + time.perf_counter() - t1
            self.tokens += sum(len(g.tokens) for g in gens)
            self.prompt_tokens += sum(len(p) for p in prompts)
            self.distinct_prompt_tokens += sum(len(p) for p in prompts[:: run.samples_per_task])
            self.sequences += len(gens)
        return datas, gen_s, node_s

    def generate_pass(self) -> float:
        """Seconds of `Engine.generate` for the same prompts and seeds (the same tokens again)."""
        gen_s = 0.0
        for _, _, _, prompts, seeds in self.jobs:
            t0 = time.perf_counter()
            self.engine.generate(prompts, self.params, seeds, self.run.max_new_tokens)
            gen_s += time.perf_counter() - t0
        return gen_s


def model_flops(loaded: Any, prompt: int, completion: int, sequences: int, distinct_prompt: int) -> dict[str, float]:
    """Matmul FLOPs (attention left out: short sequences) of generating vs checking the same rollouts."""
    m = loaded.model
    embed = m.get_input_embeddings().weight
    head = m.get_output_embeddings().weight
    tied = head.data_ptr() == embed.data_ptr()
    body = sum(p.numel() for p in m.parameters()) - embed.numel() - (0 if tied else head.numel())
    return {
        "body_params": body, "head_params": head.numel(),
        # the engine: every prompt and generated token through the body, the head once per generated token
        "generation": 2 * body * (prompt + completion) + 2 * head.numel() * completion,
        # the check: each distinct prompt once and every completion but its last token through the body
        # (models.scoring), the head on every completion position
        "check": 2 * body * (distinct_prompt + completion - sequences) + 2 * head.numel() * completion,
    }


def check_floor(flops: dict[str, float], peak_gflops: float, generation_s: float) -> float:
    """check/generation if the check's matmuls ran at `peak_gflops` and nothing else took any time."""
    return flops["check"] / (peak_gflops * 1e9) / generation_s


# -- in-process checks ------------------------------------------------------------------------------


def time_intake(service: Any, datas: list[bytes], state: Path, profile: bool = False) -> tuple[float, Any, Any]:
    """Seconds to take all `datas` in on a fresh pipeline (all must be 202); returns the pipeline and, with
    `profile`, the stage timer the pipeline filled (its public hook)."""
    from protocol.timing import StageTimer

    p, close = fresh_pipeline(service, state)
    timer = StageTimer() if profile else None
    p.timer = timer
    t0 = time.perf_counter()
    for d in datas:
        a = p.intake.receive(d)
        if a.status != 202:
            raise RuntimeError(f"honest submission refused at intake: {a.status} {a.body}")
    dt = time.perf_counter() - t0
    p.timer = None
    return dt, (p, close), timer


def time_checks(p: Any, n: int) -> tuple[float, Any]:
    """Seconds of `check_pending` until all `n` received rows are decided, with the stage timer it filled."""
    from protocol.timing import StageTimer

    timer = StageTimer()
    p.timer = timer
    decided, t0 = 0, time.perf_counter()
    while decided < n:
        got = p.checker.check_pending()
        if not got:
            raise RuntimeError(f"check_pending decided nothing with {n - decided} rows left")
        decided += got
    dt = time.perf_counter() - t0
    p.timer = None
    counts = p.checker.ledger.counts()
    if counts.get("outcome:accepted", 0) != n:
        hard = [(r.reason, r.detail, r.measurements) for r in p.checker.ledger.unreported_hard(1)]
        raise RuntimeError(f"honest submissions not all accepted: {counts}; rejected hard: {hard}")
    return dt, timer


def bench_model(name: str, chain: Chain, deployment: Path, run: Any, args: Any, dtype: str, tmp: Path,
                manifest: bytes) -> tuple[dict[str, Any], list[bytes]]:
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec
    from validator.service import Service

    spec = TinyModelSpec(seed=0, hidden_size=128) if name == "tiny" else SmolLM2Spec()
    name = f"{name}:{dtype}" if args.dtype == "both" else name
    cfg = validator_config(tmp / name / "service", deployment, chain.rpc_url, run, spec, dtype, args.threads)
    t0 = time.perf_counter()
    service = Service(cfg, chain.validator)  # loads the model (WeightStore) and reads the chain; no loops
    load_s = time.perf_counter() - t0
    loaded = service.weights.get(1)
    n_subs = args.tiny_submissions if name.startswith("tiny") else args.smollm2_submissions
    print(f"{name} ({dtype}): model loaded in {load_s:.1f} s; {n_subs} submissions of {run.tasks_per_batch}x"
          f"{run.samples_per_task} rollouts, up to {run.max_new_tokens} new tokens", flush=True)
    node = NodeSide(loaded, chain.nodes, n_subs, run, chain.deployment.chain_id, chain.deployment.pool, manifest)
    from models.scoring import Scorer

    Scorer.of(loaded)  # the validator's fused weights, built once per weights version (as the node's Engine is)
    datas, first_gen_s, node_s = node.build(service.domain, manifest)
    tokens = node.tokens
    k = 0

    def state() -> Path:
        nonlocal k
        k += 1
        return tmp / name / f"p{k}"

    _, (_, close), _ = time_intake(service, datas, state())  # warm-up: first-use caches of the intake path
    close()
    # Generation and check passes alternate, so a change in the machine's load hits both alike.
    gen_runs, check_runs, intake_runs, best = [first_gen_s], [], [], None
    for r in range(args.repeats):
        if r:
            gen_runs.append(node.generate_pass())
        intake_s, (p, close), _ = time_intake(service, datas, state())
        intake_runs.append(len(datas) / intake_s)
        check_s, stages = time_checks(p, len(datas))
        close()
        check_runs.append(check_s)
        if best is None or check_s <= min(check_runs):
            best = stages
        print(f"  pass {r + 1}: generation {tokens / gen_runs[-1]:.1f} tok/s ({gen_runs[-1]:.1f} s), full checks "
              f"{tokens / check_s:.1f} tok/s ({check_s:.1f} s), load {os.getloadavg()[0]:.1f}", flush=True)
    while len(intake_runs) * len(datas) < args.intakes and len(intake_runs) < 50:
        intake_s, (_, close), _ = time_intake(service, datas, state())
        close()
        intake_runs.append(len(datas) / intake_s)
    profiled_s, (_, close), intake_stages = time_intake(service, datas, state(), profile=True)
    close()
    assert best is not None
    check_s, gen_s = min(check_runs), min(gen_runs)
    flops = model_flops(loaded, node.prompt_tokens, tokens, node.sequences, node.distinct_prompt_tokens)
    check_times, intake_times = labelled(best, CHECK_STAGES), labelled(intake_stages, INTAKE_STAGES)
    model_s = max(1e-9, check_times[CHECK_STAGES["measure.prefill"]] + check_times[CHECK_STAGES["measure.lm_head"]])
    total = sum(check_times.values())
    breakdown = {k: v for k, v in sorted(check_times.items(), key=lambda kv: -kv[1])}
    breakdown["other"] = max(0.0, check_s - total)
    itotal = sum(intake_times.values())
    intake_breakdown = {k: v / len(datas) * 1e3 for k, v in sorted(intake_times.items(), key=lambda kv: -kv[1])}
    row = {
        "model": name, "dtype": dtype, "spec": spec.model_dump(mode="json"), "submissions": len(datas),
        "rollouts": node.sequences, "rollout_tokens": tokens, "prompt_tokens": node.prompt_tokens,
        "submission_bytes_mean": sum(map(len, datas)) / len(datas),
        "generation_s": gen_s, "generation_runs_s": gen_runs, "generation_tok_s": tokens / gen_s,
        "node_grade_prove_seal_s": node_s,
        "check_s": check_s, "check_runs_s": check_runs, "check_tok_s": tokens / check_s,
        "validation_over_generation": check_s / gen_s,
        "validation_over_generation_per_pass": [c / g for c, g in zip(check_runs, gen_runs, strict=True)],
        "flops": flops, "generation_gflops": flops["generation"] / gen_s / 1e9,
        "check_model_gflops": flops["check"] / model_s / 1e9,
        "check_model_share_of_peak": flops["check"] / model_s / 1e9 / args.peak[dtype]["gflops"],
        "check_floor_at_peak": check_floor(flops, args.peak[dtype]["gflops"], gen_s),
        "distinct_prompt_tokens": node.distinct_prompt_tokens,
        "prompt_share_of_check_prefill": node.distinct_prompt_tokens / (node.distinct_prompt_tokens + tokens
                                                                         - node.sequences),
        "check_breakdown_s": breakdown,
        "check_breakdown_share": {k: v / check_s for k, v in breakdown.items()},
        # median of the rounds: a round of a few submissions is short, so its best is an outlier
        "intake_runs_per_s": intake_runs, "intake_per_s": sorted(intake_runs)[len(intake_runs) // 2],
        "intake_per_s_best": max(intake_runs),
        "intake_breakdown_ms_per_submission": intake_breakdown,
        "intake_unaccounted_ms_per_submission": max(0.0, profiled_s - itotal) / len(datas) * 1e3,
        "model_load_s": load_s,
    }
    service.ledger.close()
    service.replay.close()
    service.nonces.close()
    return row, datas


# -- main ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = harness.parser(__doc__, smoke="every stage once on the smallest inputs (seconds): tiny, 2 submissions of 8 "
                        "tokens, 1 HTTP round, 40 junk; checks the bench, measures nothing",
                        quick="tiny only, fewer rollouts, 2,000 junk (~2 minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of node and validator (default 1)")
    ap.add_argument("--models", default=None, help="comma list of: tiny, smollm2 (default both; quick: tiny)")
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "both"],
                    help="dtype of node and validator: both (each model in fp32, then bf16; the default) or one; "
                    "auto = the faster dense matmul on this machine (the smoke's default)")
    ap.add_argument("--max-new", type=int, default=None, help="max new tokens per rollout (default 128, quick 32)")
    ap.add_argument("--tiny-submissions", type=int, default=None, help="tiny submissions (default 48, quick 24)")
    ap.add_argument("--smollm2-submissions", type=int, default=None, help="SmolLM2 submissions (default 4, quick 2)")
    ap.add_argument("--intakes", type=int, default=None, help="in-process intakes per model, at most 50 rounds (default 1000, quick 200)")
    ap.add_argument("--junk", type=int, default=None, help="junk requests in the flood (default 10000, quick 2000)")
    ap.add_argument("--connections", type=int, default=4, help="concurrent HTTP connections of the clients")
    ap.add_argument("--repeats", type=int, default=None, help="generation/check passes, best kept (default 2, quick 1)")
    ap.add_argument("--skip-http", action="store_true", help="no HTTP intake run and no junk flood")
    ap.add_argument("--skip-flood", action="store_true", help="no junk flood")
    ap.add_argument("--http-rounds", type=int, default=None,
                    help="HTTP intake rounds, each on a fresh validator process (default 3, quick 2)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    q, smoke = args.quick or args.smoke, args.smoke
    args.dtype = args.dtype or ("auto" if smoke else "both")
    args.models = args.models or ("tiny" if q else "tiny,smollm2")
    args.max_new = args.max_new or (8 if smoke else 32 if q else 128)
    args.tiny_submissions = args.tiny_submissions or (2 if smoke else 24 if q else 48)
    args.smollm2_submissions = args.smollm2_submissions or (2 if q else 4)
    args.intakes = args.intakes or (2 if smoke else 200 if q else 1000)
    args.junk = args.junk or (40 if smoke else 2000 if q else 10_000)
    args.repeats = args.repeats or (1 if q else 2)
    args.http_rounds = args.http_rounds or (1 if smoke else 2 if q else 3)

    import torch

    torch.set_num_threads(args.threads)
    from protocol.rollout import RunSpec

    flops = {d: matmul_gflops(d, 0.05 if smoke else 0.5 if q else 1.5, 128 if smoke else 512)
             for d in ("float32", "bfloat16")}
    dtype = max(flops, key=lambda d: flops[d]) if args.dtype in ("auto", "both") else args.dtype
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [dtype]
    args.peak = {d: matmul_peak(d, 0.05 if smoke else 0.5) for d in dtypes}
    run = RunSpec(run_id="bench", tasks_per_batch=4, samples_per_task=4, max_new_tokens=args.max_new)
    manifest = hashlib.sha256(b"bench manifest v1").digest()
    machine = harness.machine(args.threads)
    info = {
        "machine": machine, "matmul_gflops_512": flops, "matmul_peak": args.peak, "dtype": dtype, "dtypes": dtypes,
        "dtype_choice": {"auto": "auto: the faster dense matmul here", "both": "both; HTTP and flood: the faster"}.get(
            args.dtype, "given"),
        "run": run.model_dump(mode="json"), "repeats": args.repeats, "smoke": smoke, "load_average_start": os.getloadavg(),
        "batch_submissions": 8, "batch_tokens": 8192, "generation_batch": "one submission per generate call "
        f"({run.tasks_per_batch * run.samples_per_task} sequences)",
    }
    print(f"{harness.describe(machine)}  dense 512 matmul: "
          f"fp32 {flops['float32']:.1f} GFLOP/s, bf16 {flops['bfloat16']:.2f} GFLOP/s -> {dtype}", flush=True)
    results: dict[str, Any] = {"info": info, "models": {}}
    chain = Chain(4, manifest)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-validator-") as tmpdir:
            tmp = Path(tmpdir)
            dep = chain.deployment.save(tmp / "deployment.json")
            tiny_datas: list[bytes] = []
            for name in args.models.split(","):
                for d in dtypes:
                    row, datas = bench_model(name, chain, dep, run, args, d, tmp, manifest)
                    results["models"][row["model"]] = row
                    if name == "tiny" and d == dtype:
                        tiny_datas = datas
            if not args.skip_http and tiny_datas:
                from protocol.model_spec import TinyModelSpec

                cfg = validator_config(tmp / "http" / "state", dep, chain.rpc_url, run,
                                       TinyModelSpec(seed=0, hidden_size=128), dtype, args.threads)
                rounds = []
                for r in range(args.http_rounds):
                    rounds.append(vhttp.http_intake(cfg.model_copy(update={"state_dir": tmp / f"http{r}" / "state"}),
                                              tiny_datas, args.threads, args.connections, tmp / f"http{r}"))
                    print(f"cheap checks over HTTP, round {r + 1}: {rounds[-1]['per_s']:.1f}/s", flush=True)
                results["http_intake"] = {**max(rounds, key=lambda x: x["per_s"]), "rounds_per_s": [
                    x["per_s"] for x in rounds]}
                if not args.skip_flood:
                    cfg = cfg.model_copy(update={"state_dir": tmp / "flood" / "state"})
                    print(f"junk flood: {args.junk} requests ...", flush=True)
                    results["junk_flood"] = vhttp.junk_flood(cfg, tiny_datas, args.junk, args.threads, args.connections,
                                                       tmp / "flood")
    finally:
        chain.stop()
    info["load_average_end"] = os.getloadavg()
    for d in dtypes:  # measured again at the end: on a shared box the start may have had no quiet moment
        again = matmul_peak(d, 0.05 if smoke else 0.5)
        if again["gflops"] > args.peak[d]["gflops"]:
            args.peak[d] = again
            for r in results["models"].values():
                if r["dtype"] == d:
                    r["check_model_share_of_peak"] = r["check_model_gflops"] / again["gflops"]
                    r["check_floor_at_peak"] = check_floor(r["flops"], again["gflops"], r["generation_s"])
    results["validation_over_generation"] = {m: r["validation_over_generation"] for m, r in results["models"].items()}
    results["cheap_checks_per_s"] = {m: r["intake_per_s"] for m, r in results["models"].items()}
    report(results)
    harness.write_json(args.json, results)
    return 0


def report(res: dict[str, Any]) -> None:
    info = res["info"]
    print(f"\n{info['machine']['cpu']} x{info['machine']['cores']}, {info['machine']['threads']} thread(s), {'/'.join(info['dtypes'])}, "
          f"{info['run']['tasks_per_batch']}x{info['run']['samples_per_task']} rollouts per submission, "
          f"max {info['run']['max_new_tokens']} new tokens, load {info['load_average_start'][0]:.1f} -> "
          f"{info['load_average_end'][0]:.1f}")
    print(f"{'model':16} {'subs':>5} {'tokens':>7} {'gen tok/s':>10} {'check tok/s':>12} {'check/gen':>10} "
          f"{'cheap/s':>8} {'bytes/sub':>10} {'gen GFLOP/s':>12} {'prefill GFLOP/s':>16} {'of peak':>8} "
          f"{'floor':>7}")
    for m, r in res["models"].items():
        print(f"{m:16} {r['submissions']:>5} {r['rollout_tokens']:>7} {r['generation_tok_s']:>10.1f} "
              f"{r['check_tok_s']:>12.1f} {r['validation_over_generation']:>9.3f}x {r['intake_per_s']:>8.1f} "
              f"{r['submission_bytes_mean']:>10.0f} {r['generation_gflops']:>12.1f} {r['check_model_gflops']:>16.1f} "
              f"{r['check_model_share_of_peak']:>8.0%} {r['check_floor_at_peak']:>6.3f}x")
    peaks = ", ".join(f"{d} {p['gflops']:.1f} ({p['path']})" for d, p in info["matmul_peak"].items())
    print(f"(matmul peak, the better of the start and the end, GFLOP/s: {peaks}; prefill GFLOP/s = the check's matmul FLOPs / time in the "
          "body and the lm head; floor = check/gen with the check's matmuls at that peak and nothing else costing "
          "anything: no validator code goes below it on this machine)")
    for m, r in res["models"].items():
        print(f"\n{m}: full-check time by stage ({r['check_s']:.2f} s)")
        for k, v in r["check_breakdown_s"].items():
            print(f"  {k:<40} {v:8.3f} s {v / r['check_s']:6.1%}")
        print(f"{m}: intake ms per submission by stage")
        for k, v in r["intake_breakdown_ms_per_submission"].items():
            print(f"  {k:<40} {v:8.3f} ms")
    if "http_intake" in res:
        h = res["http_intake"]
        print(f"\ncheap checks over HTTP: {h['per_s']:.1f} submissions/s ({h['submissions']} tiny submissions, "
              f"{h['connections']} connections)")
    if "junk_flood" in res:
        f = res["junk_flood"]
        print(f"junk flood: {f['requests']} requests at {f['per_s']:.0f}/s; validator RSS {f['rss_before_mib']:.1f} "
              f"-> {f['rss_after_mib']:.1f} MiB (peak {f['rss_peak_sampled_mib']:.1f}, +{f['peak_over_before_mib']:.1f}"
              f"); flat: {f['flat']}; ledger {f['ledger_bytes_before']} -> {f['ledger_bytes_after']} bytes, "
              f"{f['ledger_refusal_rows']} refusal rows, {f['ledger_submission_rows']} submission rows")
        for kind, st in f["statuses"].items():
            print(f"  {kind:<18} {st}")


if __name__ == "__main__":
    sys.exit(main())
