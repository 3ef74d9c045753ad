"""Near-tie disagreements of honest nodes per compute precision, and what a steering node can choose.

    python -m bench.near_ties [--quick] [--json PATH] [--model tiny|smollm2|both]
    python -m bench.near_ties --smoke --json out.json   # the tiny model, 2 short sequences (seconds)

Honest part: the node's `models/` engine generates in fp32 and in bf16; the validator replays every sequence with
its own prefill (`toploc.validation.measure`, in fp32, the validator's default, and in the node's precision) and
the rows give, per (model, node dtype, validator dtype): the paid tokens, the positions where the node's token is
not the replay's winner (a disagreement) with their margins, how many of those are within the sampling tolerance
(near-ties: they pass), the honest near-tie rate per token, and the largest drift of a token's logprob between
the node and the replay (what a tolerance for that precision must cover).

Steering part: a node that, at every position, takes the token it prefers (here: the lowest id, EOS never)
among those within the tolerance of the seeded draw's winner (`bench.adversaries.steer_near_ties`), replayed by
the validator: tokens per sample it
chose and got accepted, at today's tolerance (0.5 for everyone) and at the tolerance measured for its declared
precision, and when `validator.near_tie_rule` would flag its account. Not a test: the record the per-precision
tolerances and honest rates in the validator's configuration come from.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench import harness

TOLERANCE_TODAY = 0.5
"""The sampling tolerance every node gets before per-precision tolerances (`checks.sampling_margin_tolerance`)."""
HEADROOM = 4.0
"""A precision's proposed tolerance is this many times the largest honest logprob drift measured for it."""


def _setup(model_name: str, n: int) -> tuple[Any, list[list[int]], list[int]]:
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec
    from protocol.seeds import sampling_seed

    if model_name == "tiny":
        import torch

        spec: Any = TinyModelSpec()
        g = torch.Generator().manual_seed(0)
        prompts = [[1] + torch.randint(3, spec.vocab_size, (15,), generator=g).tolist() for _ in range(n)]
    else:
        from models import load

        spec = SmolLM2Spec()
        tok: Any = load(spec).tokenizer

        def chat(q: str) -> list[int]:
            enc = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."},
                                           {"role": "user", "content": q}], add_generation_prompt=True)
            return list(enc if isinstance(enc, list) else enc["input_ids"])

        prompts = [chat(f"Tell me one fact about the number {i}.") for i in range(n)]
    seeds = [sampling_seed("0x70997970C51812dc3A010C7d01b50e0d17dc79C8", 1, i, 0, run_id="near-ties",
                           chain_id=31337, pool="0x5FbDB2315678afecb367f032d93F642f64180aa3", counter=0,
                           manifest_hash=bytes(32)) for i in range(n)]
    return spec, prompts, seeds


def _rollout(prompt: list[int], tokens: list[int], hidden: Any, seed: int, max_tokens: int) -> Any:
    from toploc.validation import Rollout, prove

    return Rollout(prompt_tokens=prompt, tokens=tokens, proofs=prove(hidden), seed=seed, max_tokens=max_tokens)


def _disagreements(report: Any, tokens: list[int]) -> list[float]:
    """Margins of the positions where the node's token is not the replay's winner."""
    s = report.sampling
    return [float(m) for i, (m, w) in enumerate(zip(s.margins, s.winners, strict=True)) if w != tokens[i]]


def honest(model_name: str, n: int, max_tokens: int, dtypes: list[str]) -> list[dict[str, Any]]:
    from models import load
    from models.engine import Engine
    from models.sampling import SamplingParams
    from toploc import ToplocThresholds
    from toploc.validation import measure

    spec, prompts, seeds = _setup(model_name, n)
    params, cfg = SamplingParams(temperature=1.0), ToplocThresholds(sampling_margin_tolerance=TOLERANCE_TODAY)
    validators = {d: load(spec, dtype=d) for d in dtypes}
    rows = []
    for node_dtype in dtypes:
        started = time.perf_counter()
        gens = Engine(load(spec, dtype=node_dtype)).generate(prompts, params, seeds, max_tokens)
        gen_s = time.perf_counter() - started
        for val_dtype in sorted({"float32", node_dtype}):
            if val_dtype not in validators:
                continue
            reports = measure(validators[val_dtype], [_rollout(g.prompt_tokens, list(g.tokens), g.hidden_states,
                                                               g.seed, max_tokens) for g in gens], params, cfg)
            tokens = sum(len(g.tokens) for g in gens)
            margins = sorted(m for g, r in zip(gens, reports, strict=True) for m in _disagreements(r, list(g.tokens)))
            drift = max((abs(a - b) for g, r in zip(gens, reports, strict=True)
                         for a, b in zip(g.logprobs, r.logprobs, strict=True)), default=0.0)
            near = sum(1 for m in margins if m <= TOLERANCE_TODAY)
            rows.append({"model": model_name, "engine": "models", "node_dtype": node_dtype,
                         "validator_dtype": val_dtype, "sequences": len(gens), "tokens": tokens,
                         "disagreements": len(margins), "near_ties": near,
                         "mismatches": len(margins) - near, "near_tie_rate": near / tokens if tokens else 0.0,
                         "disagreement_margins": [round(m, 6) for m in margins],
                         "max_logprob_drift": drift, "generate_s": round(gen_s, 2)})
    return rows


def steering(model_name: str, n: int, max_tokens: int, tolerances: dict[str, float],
             honest_rate: float) -> dict[str, Any]:
    """A steering node against the validator at each tolerance (name -> tolerance): choices per sample, how many
    the replay accepts, and after how many of its tokens `validator.near_tie_rule` flags its account."""
    from bench.adversaries import prefill_hidden, steer_near_ties
    from models import load
    from models.sampling import SamplingParams
    from toploc import ToplocThresholds
    from toploc.validation import measure
    from validator.near_tie_rule import ALPHA, beyond_honest, most_honest

    spec, prompts, seeds = _setup(model_name, n)
    loaded, params = load(spec), SamplingParams(temperature=1.0)
    out: dict[str, Any] = {"model": model_name, "samples": n, "max_tokens": max_tokens, "rows": []}
    for name, tol in tolerances.items():
        gens = [steer_near_ties(loaded, p, params=params, seed=s, max_tokens=max_tokens, tolerance=tol)
                for p, s in zip(prompts, seeds, strict=True)]
        cfg = ToplocThresholds(sampling_margin_tolerance=tol)
        reports = measure(loaded, [_rollout(p, t, prefill_hidden(loaded, p, t), s, max_tokens)
                                   for p, s, (t, _) in zip(prompts, seeds, gens, strict=True)], params, cfg)
        accepted = [r.sampling is not None and not cfg.sampling_failed(r.sampling) for r in reports]
        tokens = [len(t) for t, _ in gens]
        near = [len(r.sampling.near_ties) if r.sampling else 0 for r in reports]
        paid, ties, flagged_at = 0, 0, None
        for i, ok in enumerate(accepted):
            if ok:
                paid, ties = paid + tokens[i], ties + near[i]
                if flagged_at is None and beyond_honest(paid, ties, honest_rate):
                    flagged_at = i + 1
        out["rows"].append({
            "tolerance_name": name, "tolerance": tol, "tokens_per_sample": sum(tokens) / n,
            "chosen_per_sample": sum(c for _, c in gens) / n,
            "accepted_samples": sum(accepted),
            "accepted_chosen_per_sample": sum(c for (_, c), ok in zip(gens, accepted, strict=True) if ok) / n,
            "near_ties_per_accepted_sample": ties / max(1, sum(accepted)),
            "rule_flags_after_samples": flagged_at})
    # what the rule leaves a node that steers only as far as it can without a verdict, per sample of the size
    # measured, over a day of such samples (the account is tested after each)
    per_sample = out["rows"][0]["tokens_per_sample"] if out["rows"] else 0.0
    day = int(per_sample * 10_000)
    out["rule"] = {"alpha": ALPHA, "honest_rate": honest_rate, "tokens_in_10k_samples": day,
                   "most_near_ties_unflagged": most_honest(day, honest_rate) if day else 0,
                   "steerable_per_sample_over_10k_samples":
                       (most_honest(day, honest_rate) - honest_rate * day) / 10_000 if day else 0.0}
    return out


def _proposed(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per node precision, against the validator's fp32 replay: the tolerance (HEADROOM x the largest logprob drift)
    and the honest near-tie rate at it (a floor of one per 100k tokens: an unseen event is not a zero rate)."""
    out: dict[str, dict[str, float]] = {}
    for node_dtype in sorted({r["node_dtype"] for r in rows}):
        mine = [r for r in rows if r["node_dtype"] == node_dtype and r["validator_dtype"] == "float32"]
        tokens = sum(r["tokens"] for r in mine)
        drift = max((r["max_logprob_drift"] for r in mine), default=0.0)
        tol = HEADROOM * drift
        near = sum(1 for r in mine for m in r["disagreement_margins"] if m <= tol)
        out[node_dtype] = {"tokens": tokens, "drift": drift, "tolerance": tol, "near_ties_at_tolerance": near,
                           "honest_rate": max(1e-5, near / tokens) if tokens else 1e-5}
    return out


def main() -> int:
    parser = harness.parser(__doc__, smoke="the tiny model in fp32 and bf16, 2 short sequences, the steering node "
                            "on one (seconds; checks the bench, measures nothing)", quick="fewer, shorter sequences")
    parser.add_argument("--model", choices=["tiny", "smollm2", "both"], default=None,
                        help="default both; smoke: tiny")
    args = parser.parse_args()
    args.model = args.model or ("tiny" if args.smoke else "both")
    import torch

    torch.set_num_threads(2)
    dtypes = ["float32", "bfloat16"]
    models = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    sizes = {"tiny": (2, 24) if args.smoke else (8, 64) if args.quick else (32, 128),
             "smollm2": (4, 32) if args.quick else (16, 64)}
    rows: list[dict[str, Any]] = []
    for m in models:
        rows += honest(m, *sizes[m], dtypes)
    proposed = _proposed(rows)
    steer: list[dict[str, Any]] = []
    for m in models:
        mine = _proposed([r for r in rows if r["model"] == m])
        tolerances = {"today (0.5)": TOLERANCE_TODAY, "declared fp32": mine["float32"]["tolerance"],
                      "declared bf16": mine["bfloat16"]["tolerance"]}
        n, length = (1, 24) if args.smoke else (4, 32) if m == "smollm2" or args.quick else (8, 64)
        steer.append(steering(m, n, length, tolerances, mine["bfloat16"]["honest_rate"]))
    print(f"{'model':<8} {'node':<9} {'replay':<9} {'seqs':>4} {'tokens':>6} {'disagree':>8} {'near-ties':>9} "
          f"{'rate':>8} {'max drift':>9}")
    for r in rows:
        print(f"{r['model']:<8} {r['node_dtype']:<9} {r['validator_dtype']:<9} {r['sequences']:>4} {r['tokens']:>6} "
              f"{r['disagreements']:>8} {r['near_ties']:>9} {r['near_tie_rate']:>8.4f} {r['max_logprob_drift']:>9.2e}")
    print("proposed per node precision (fp32 replay):",
          {k: {kk: float(f"{v:.3g}") for kk, v in d.items()} for k, d in proposed.items()})
    print(f"{'model':<8} {'tolerance':<15} {'tol':>8} {'tok/sample':>10} {'chosen':>7} {'accepted':>8} "
          f"{'acc chosen':>10} {'flagged after':>13}")
    for s in steer:
        for r in s["rows"]:
            print(f"{s['model']:<8} {r['tolerance_name']:<15} {r['tolerance']:>8.2e} {r['tokens_per_sample']:>10.1f} "
                  f"{r['chosen_per_sample']:>7.1f} {r['accepted_samples']:>4}/{s['samples']:<3} "
                  f"{r['accepted_chosen_per_sample']:>10.1f} {str(r['rule_flags_after_samples']):>13}")
        print(f"{s['model']:<8} the rule over 10k samples: {s['rule']}")
    harness.write_json(args.json, {"bench": "near_ties", "smoke": args.smoke, "machine": harness.machine(),
                                   "rows": rows, "proposed": proposed, "steering": steer})
    return 0


if __name__ == "__main__":
    sys.exit(main())
