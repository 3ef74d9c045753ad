"""The node's whole loop against bare engine generation: what proofs, grading, signing and submitting cost.

Anchor (same run, same model, threads, dtype, and the same assignments: the same node key, version and
counters, so the same prompts, seeds and tokens): the engine's bare generation, one call per assignment, as the
node makes them. For the `models/` engine that is `models.engine.Engine.generate` alone (its proofs are timed
apart); for vLLM (`--engines vllm`, run from .venv-vllm after `make setup-vllm`) it is `VllmEngine.generate`,
which builds the TOPLOC proofs inside vLLM's worker (they cannot be timed apart: `proofs` is null). Measured:
`node.worker.Worker.run_loop` for the same assignments: generation, TOPLOC proofs, rewards, the slashing-protection
record, the signed envelope and the POST to a real validator (a subprocess on 127.0.0.1 doing its intake: every
cheap check and the ledger row; its checker is off, since on a 2-core box its prefills would take the node's core
and a real validator runs elsewhere), on a real anvil pool. The bare generation runs before and after the loop
(the mean is the anchor), so drift in machine load shows as the spread between the two. `overhead` = 1 - loop
tokens/s / bare tokens/s (the fraction of throughput the loop costs; the goal is at most 0.10). The breakdown
times each added step on the same work. With both engines, `ratio_vllm_vs_models` is vLLM's tokens/s over the
`models/` engine's per model (bare and loop), measured one after the other in the same run.

    python -m bench.node --json out.json     # tiny and SmolLM2 (~5 minutes)
    python -m bench.node --quick             # tiny only (~1 minute)
    python -m bench.node --smoke --json out.json   # tiny, 1 batch of 2x2 rollouts of 8 tokens (seconds)
    .venv-vllm/bin/python -m bench.node --engines models,vllm --json out.json   # both engines
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness

_MANIFEST = hashlib.sha256(b"bench manifest v1").digest()
"""The manifest hash the timed assignments are drawn at (tasks mix it in; any published one times the same)."""


def requests_of(engine: Any, run: Any, node: str, counter: int, chain_id: int, pool: str,
                manifest_hash: bytes) -> list[Any]:
    """The requests `node.rollouts.build_submission` makes for assignment (node, v1, counter) in `pool`."""
    from environments import get as get_environment
    from node.engines import Request
    from node.rollouts import prompt_ids
    from protocol.seeds import sampling_seed, task_seed

    env = get_environment(run.env, run.env_version)
    out = []
    where = {"run_id": run.run_id, "chain_id": chain_id, "pool": pool}
    for task in env.sample(task_seed(node, 1, counter, manifest_hash=manifest_hash, **where), run.tasks_per_batch):
        ids = prompt_ids(engine.tokenizer, task)
        out += [Request(ids, sampling_seed(node, 1, task.task_id, i, counter=counter,
                                           manifest_hash=manifest_hash, **where))
                for i in range(run.samples_per_task)]
    return out


def bench_model(name: str, model: Any, run: Any, batches: int, threads: int, dtype: str, tmp: Path,
                engine_type: str = "cpu") -> dict[str, Any]:
    import httpx
    import torch

    from bench import validator as vbench
    from bench import validator_http as vhttp
    from contracts.policy import PolicyHistory
    from models.sampling import SamplingParams
    from node.commands import validator_role
    from node.config import NodeConfig
    from node.engines import build_engine
    from node.protection import SlashingProtection
    from node.rollouts import build_submission
    from node.weights import PolicyWeights
    from node.worker import ValidatorDirectory, Worker
    from protocol.config import StaticWeights
    from protocol.envelope import seal
    from protocol.nonce import random_nonce
    from protocol.rollout import submission_domain
    from toploc.validation import prove
    torch.set_num_threads(threads)
    chain = vbench.Chain(1, hashlib.sha256(b"bench policy v1").digest())
    served = engine = None
    try:
        deployment = chain.deployment.save(tmp / "deployment.json")
        vcfg = vbench.validator_config(tmp / "validator", deployment, chain.rpc_url, run, model, "float32", 1)
        served = vhttp.Served(vcfg, 1, False, tmp / "served")
        node = chain.nodes[0]
        cfg = NodeConfig.model_validate({
            "state_dir": tmp / "node", "validators": [served.url], "run": run, "model": model,
            "engine": {"type": engine_type, "dtype": dtype, "threads": threads}, "max_batches": batches,
            "monitor": {"port": None}, "chain": {"deployment": deployment, "rpc_url": chain.rpc_url},
            "submit": {"max_pending": 10**6, "decide_timeout_s": 0.01}})
        from node.commands import open_chain

        c = open_chain(cfg)
        started = time.perf_counter()
        engine = build_engine(cfg.engine, model)
        start_s = time.perf_counter() - started
        all_requests = [requests_of(engine, run, node.address, k, c.chain_id, c.pool, _MANIFEST)
                        for k in range(batches)]
        if engine_type == "cpu":
            from models.engine import Engine

            bare = Engine(engine.loaded)  # type: ignore[attr-defined]
            params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)

            def generate(reqs: list[Any]) -> list[Any]:
                return bare.generate([r.prompt for r in reqs], params, [r.seed for r in reqs], run.max_new_tokens)
        else:  # vLLM builds the proofs in its worker, inside the engine's generate

            def generate(reqs: list[Any]) -> list[Any]:
                return engine.generate(reqs, run)

        generate(all_requests[0])  # warm-up

        def generate_all() -> tuple[float, list[Any]]:
            started = time.perf_counter()
            out = [generate(reqs) for reqs in all_requests]
            return time.perf_counter() - started, out

        bare_before, gens = generate_all()
        bare_tokens = sum(len(g.tokens) for batch in gens for g in batch)

        prove_s: float | None = None
        if engine_type == "cpu":
            started = time.perf_counter()
            for batch in gens:
                for g in batch:
                    prove(g.hidden_states)
            prove_s = time.perf_counter() - started

        weights = PolicyWeights(StaticWeights(), model, run, PolicyHistory(c.client(node), c.start_block),
                                lambda spec: engine, cfg.state_dir / "weights")
        domain = submission_domain(c.chain_id, c.pool, run.run_id)
        with httpx.Client(timeout=60) as http, SlashingProtection(cfg.state_dir / "protection.sqlite") as db:
            worker = Worker(cfg, node, run, domain, weights, db, ValidatorDirectory([served.url], http,
                                                                               validator_role(c.client(node))))
            worker.validators.refresh()
            started = time.perf_counter()
            tally = worker.run_loop()
            loop_s = time.perf_counter() - started
            # the added steps alone, on the same assignments (the record and POST are in the loop above); the
            # submissions are built by the engine (generation again), only sealing them is timed
            subs = [build_submission(engine, run, node.address, 1, k, b"\x00" * 31 + b"\x01", chain_id=c.chain_id,
                                     pool=c.pool) for k in range(batches)]
            started = time.perf_counter()
            for sub in subs:
                seal(node, sub, domain=domain, nonce=random_nonce())
            seal_s = time.perf_counter() - started
        bare_after, _ = generate_all()
        bare_s = (bare_before + bare_after) / 2
        loop_tokens = tally.tokens
        bare_tps, loop_tps = bare_tokens / bare_s, loop_tokens / loop_s
        return {
            "model": name, "engine": "models" if engine_type == "cpu" else "vllm",
            "anchor": "models.engine.Engine.generate (proofs apart)" if engine_type == "cpu"
            else "VllmEngine.generate (proofs built in vLLM's worker)",
            "batches": batches, "samples_per_batch": run.tasks_per_batch * run.samples_per_task,
            "max_new_tokens": run.max_new_tokens, "dtype": dtype, "threads": threads,
            "engine_start_seconds": round(start_s, 2),
            "bare_tokens": bare_tokens, "bare_seconds": round(bare_s, 4),
            "bare_seconds_before_after": [round(bare_before, 4), round(bare_after, 4)], "bare_tok_s": round(bare_tps, 2),
            "loop_tokens": loop_tokens, "loop_seconds": round(loop_s, 4), "loop_tok_s": round(loop_tps, 2),
            "overhead": round(1.0 - loop_tps / bare_tps, 4), "same_tokens": loop_tokens == bare_tokens,
            "breakdown_s": {"generate": round(bare_s, 4), "proofs": None if prove_s is None else round(prove_s, 4),
                            "seal": round(seal_s, 4),
                            "rest_of_loop": round(max(0.0, loop_s - bare_s - (prove_s or 0.0) - seal_s), 4)},
        }
    finally:
        if engine is not None:
            engine.close()
        if served is not None:
            served.stop()
        chain.stop()


def main() -> int:
    ap = harness.parser(__doc__, smoke="tiny model, 1 batch of 2 tasks x 2 samples x 8 tokens (seconds; checks the "
                        "bench, measures nothing)", quick="tiny model only, fewer batches")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--engines", default="models", help="comma list of: models (the models/ engine), vllm (needs "
                    "vLLM: run from .venv-vllm after `make setup-vllm`)")
    args = ap.parse_args()
    engines = args.engines.split(",")
    for e in engines:
        if e not in ("models", "vllm"):
            ap.error(f"unknown engine {e!r}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec
    from protocol.run import RunSpec

    tiny_run = RunSpec(run_id="bench-node", tasks_per_batch=4, samples_per_task=4, max_new_tokens=64)
    if args.smoke:
        tiny_run = RunSpec(run_id="bench-node", tasks_per_batch=2, samples_per_task=2, max_new_tokens=8)
    smol_run = RunSpec(run_id="bench-node", env="reverse-text", tasks_per_batch=2, samples_per_task=4,
                       max_new_tokens=48)
    # hidden 128: vLLM's CPU attention needs a head dim of at least 32 (the default tiny model's is 16)
    cases: list[tuple[str, Any, Any, int]] = [("tiny", TinyModelSpec(hidden_size=128), tiny_run,
              args.batches or (1 if args.smoke else 6 if args.quick else 20))]
    if not (args.quick or args.smoke):
        cases.append(("smollm2", SmolLM2Spec(), smol_run, args.batches or 3))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        for name, model, run, batches in cases:
            for e in engines:
                results.append(bench_model(name, model, run, batches, args.threads, args.dtype,
                                           Path(tmp) / f"{name}-{e}", "cpu" if e == "models" else "vllm"))
    out: dict[str, Any] = {
        "info": {"machine": harness.machine(args.threads), "engines": engines}, "smoke": args.smoke, "results": results}
    by = {(r["model"], r["engine"]): r for r in results}
    ratios = {name: {"bare": round(by[name, "vllm"]["bare_tok_s"] / by[name, "models"]["bare_tok_s"], 3),
                     "loop": round(by[name, "vllm"]["loop_tok_s"] / by[name, "models"]["loop_tok_s"], 3)}
              for name, *_ in cases if (name, "vllm") in by and (name, "models") in by}
    if ratios:
        out["ratio_vllm_vs_models"] = ratios
    print(f"{'model':<8} {'engine':<7} {'batches':>7} {'bare tok/s':>11} {'loop tok/s':>11} {'overhead':>9}  "
          f"breakdown (s)")
    for r in results:
        print(f"{r['model']:<8} {r['engine']:<7} {r['batches']:>7} {r['bare_tok_s']:>11.1f} {r['loop_tok_s']:>11.1f} "
              f"{r['overhead']:>9.3f}  {r['breakdown_s']}")
    for name, ratio in ratios.items():
        print(f"{name}: vLLM / models/ tokens/s: bare {ratio['bare']:.2f}x, through the loop {ratio['loop']:.2f}x")
    harness.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
