"""Statistics of honest and cheating rollouts against the default TOPLOC thresholds (the margins).

    python -m bench.toploc_margins [--quick] [--json PATH] [--model tiny|smollm2|both]
    python -m bench.toploc_margins --smoke --json out.json   # the tiny model, 2 sequences each (seconds)

For each case prints the worst chunk (max exp_mismatches / mant_err_mean / mant_err_median over all
chunks of all sequences), the number of sampling mismatches, the largest sampling margin and the
termination violations, next to the defaults in `toploc.ToplocThresholds`. Not a test: a record of
how far each case sits from the lines, to tune thresholds from data.
"""

from __future__ import annotations

import sys
from typing import Any

from bench import harness


def run(model_name: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    import torch

    from models import load
    from models.engine import Engine
    from models.forward import prefill
    from models.sampling import SamplingParams
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec
    from protocol.seeds import sampling_seed
    from toploc import ToplocThresholds
    from toploc.validation import Rollout, measure, prove

    torch.set_num_threads(1)
    cfg, params = ToplocThresholds(), SamplingParams(temperature=1.0)
    if model_name == "tiny":
        spec: Any = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256, vocab_size=512)
        g = torch.Generator().manual_seed(0)
        prompts = [[1, 5, 6, 7] + torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(n)]
        alt_prompts = [[1, 9, 10, 11] + p[4:] for p in prompts]
        other: Any = TinyModelSpec(seed=1, hidden_size=128, intermediate_size=256, vocab_size=512)
    else:
        spec = SmolLM2Spec()
        other = None
    loaded = load(spec)
    if model_name != "tiny":
        tok = loaded.tokenizer

        def chat(q: str, system: str) -> list[int]:
            enc = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                          add_generation_prompt=True)
            return list(enc if isinstance(enc, list) else enc["input_ids"])

        qs = [f"Tell me one fact about the number {i}." for i in range(n)]
        prompts = [chat(q, "You are a helpful assistant.") for q in qs]
        alt_prompts = [chat(q, "You are a pirate. Answer in pirate speak.") for q in qs]
    seeds = [sampling_seed("0x70997970C51812dc3A010C7d01b50e0d17dc79C8", 1, i, 0, run_id="margins", chain_id=31337, pool="0x5FbDB2315678afecb367f032d93F642f64180aa3", counter=0, manifest_hash=bytes(32)) for i in range(n)]

    def perturbed(scale: float, seed: int) -> Any:
        m = load(spec)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.model.parameters():
                p.mul_(1 + scale * torch.randn(p.shape, generator=gen))
        return m

    def ro(g: Any, **kw: Any) -> Any:
        f = dict(prompt_tokens=g.prompt_tokens, tokens=g.tokens, proofs=prove(g.hidden_states, cfg), seed=g.seed,
                 max_tokens=max_tokens)
        f.update(kw)
        return Rollout(**f)

    engine = Engine(loaded)
    honest16 = engine.generate(prompts, params, seeds, max_tokens)
    cases: dict[str, list[Any]] = {}
    cases[f"honest batch {n}"] = [ro(g) for g in honest16]
    cases["honest batch 1"] = [ro(engine.generate([p], params, [s], max_tokens)[0]) for p, s in zip(prompts[:2], seeds, strict=False)]
    torch.set_num_threads(2)
    cases["honest 2 threads"] = [ro(g) for g in Engine(loaded).generate(prompts[:4], params, seeds[:4], max_tokens)]
    torch.set_num_threads(1)
    cases["honest HF decode path"] = [ro(g) for g in Engine(loaded, fast_path=False).generate(prompts[:2], params, seeds[:2], max_tokens)]
    if other is not None:
        cases["weights of another seed"] = [ro(g) for g in Engine(load(other)).generate(prompts, params, seeds, max_tokens)]
    cases["weights + 3% noise"] = [ro(g) for g in Engine(perturbed(0.03, 5)).generate(prompts, params, seeds, max_tokens)]
    cases["altered system prompt"] = [ro(g, prompt_tokens=p) for g, p in
                                      zip(engine.generate(alt_prompts, params, seeds, max_tokens), prompts, strict=True)]
    changed = []
    for g in honest16:
        t = list(g.tokens)
        j = len(t) // 2
        t[j] = (t[j] + 17) % loaded.vocab_size
        changed.append(ro(g, tokens=t))
    cases["one changed token"] = changed
    cases["proofs of another sequence"] = [ro(a, proofs=prove(b.hidden_states[: len(a.tokens)], cfg))
                                           for a, b in zip(honest16, honest16[1:] + honest16[:1], strict=True)
                                           if len(b.tokens) >= len(a.tokens)]
    cheap_gens = Engine(perturbed(0.1, 9) if other is None else load(TinyModelSpec(seed=7, hidden_size=128, intermediate_size=256, vocab_size=512))).generate(prompts, params, seeds, max_tokens)  # noqa: E501
    cheap = []
    for g in cheap_gens:
        p = len(g.prompt_tokens)
        hidden = prefill(loaded, torch.tensor([g.prompt_tokens + g.tokens[:-1]])).hidden[0, p - 1 :]
        cheap.append(ro(g, proofs=prove(hidden, cfg)))
    cases["other model's tokens + honest prefill"] = cheap
    cases["early stop"] = [ro(g, tokens=g.tokens[: len(g.tokens) // 2], proofs=prove(g.hidden_states[: len(g.tokens) // 2], cfg))
                           for g in honest16 if g.finish_reason == "length"]
    rows = []
    for name, rollouts in cases.items():
        reports = measure(loaded, rollouts, params, cfg)
        chunks = [c for r in reports for c in r.proofs]
        rows.append({
            "model": model_name, "case": name, "sequences": len(reports),
            "max_exp_mismatches": max((c.exp_mismatches for c in chunks), default=0),
            "max_mant_err_mean": max((c.mant_err_mean for c in chunks), default=0.0),
            "max_mant_err_median": max((c.mant_err_median for c in chunks), default=0.0),
            "min_exp_mismatches": min((c.exp_mismatches for c in chunks), default=0),
            "chunks_failing": sum(len(cfg.failing_chunks(r.proofs)) for r in reports),
            "chunks": len(chunks),
            "seqs_sampling_failed": sum(1 for r in reports if r.sampling and cfg.sampling_failed(r.sampling)),
            "max_sampling_margin": max((r.sampling.max_margin for r in reports if r.sampling), default=0.0),
            "seqs_termination_violations": sum(1 for r in reports if r.termination and r.termination.violations),
        })
    return rows


def main() -> int:
    parser = harness.parser(__doc__, smoke="every case once on 2 sequences of the tiny model (seconds; checks the "
                            "bench, measures nothing)", quick="fewer and shorter sequences")
    parser.add_argument("--model", choices=["tiny", "smollm2", "both"], default=None,
                        help="default both; smoke: tiny")
    args = parser.parse_args()
    args.model = args.model or ("tiny" if args.smoke else "both")
    from toploc import ToplocThresholds

    cfg = ToplocThresholds()
    rows: list[dict[str, Any]] = []
    if args.model in ("tiny", "both"):
        rows += run("tiny", 2 if args.smoke else 8 if args.quick else 16, 40 if args.smoke else 70)
    if args.model in ("smollm2", "both"):
        rows += run("smollm2", 4 if args.quick else 8, 40 if args.quick else 64)
    print(f"defaults: chunk fails if exp_mismatches > {cfg.max_exp_mismatches}, mean > {cfg.max_mant_err_mean}, "
          f"median > {cfg.max_mant_err_median}; sampling fails if > {cfg.max_sampling_mismatches} positions lose by "
          f"> {cfg.sampling_margin_tolerance}")
    print(f"{'model':<8} {'case':<38} {'seqs':>4} {'exp max':>7} {'mean max':>8} {'med max':>7} {'fail/chunks':>11} "
          f"{'samp fail':>9} {'max margin':>10} {'term':>4}")
    def num(v: float) -> str:
        return "no-match" if v >= 2**63 else f"{v:.2f}"

    for r in rows:
        print(f"{r['model']:<8} {r['case']:<38} {r['sequences']:>4} {r['max_exp_mismatches']:>7} "
              f"{num(r['max_mant_err_mean']):>8} {num(r['max_mant_err_median']):>7} "
              f"{r['chunks_failing']:>5}/{r['chunks']:<5} {r['seqs_sampling_failed']:>9} "
              f"{r['max_sampling_margin']:>10.3g} {r['seqs_termination_violations']:>4}")
    harness.write_json(args.json, {"thresholds": cfg.model_dump(), "smoke": args.smoke, "machine": harness.machine(),
                                   "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
