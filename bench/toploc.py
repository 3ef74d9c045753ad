"""TOPLOC benchmark: ours vs the reference toploc 0.1.6 on the same tensors, and validation cost on SmolLM2.

    python -m bench.toploc [--quick] [--json PATH] [--threads N] [--skip-model] [--skip-reference]
    python -m bench.toploc --smoke --json out.json   # 1 chunk, 1 repeat, the tiny model (seconds)

`--smoke` runs every part once on the smallest inputs (part 2 on the tiny random model instead of
SmolLM2) so a default-tier test keeps the bench from rotting; it runs the reference only if its venv
already exists (`python -m bench.toploc_reference` makes it) and says so when it skips it.

Part 1 (proof math): build and verify time per 32-token chunk (k=128) for hidden sizes 576, 2048 and
4096, ours and the reference (run in its own venv, bench/.venvs/toploc-ref, through a subprocess:
only the timed calls are compared, best of N repeats), with ratios ours/reference (< 1 = faster).
The reference's proofs for those tensors are compared byte for byte with ours.

Part 2 (SmolLM2-135M-Instruct, fp32, CPU): tokens per second of
  - validation: `toploc.validation.measure` = one batched prefill + proof verification + sampling
    replay + termination check,
  - a bare prefill of the same tokens in the same batches (`models.forward.prefill`),
  - generating them with the engine (`models.engine.Engine`) at batch 1 and at batch 16,
and the ratios between them. On this CPU both prefill and decode are compute-bound, so the
ratio to generation is reported rather than aimed at.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness, toploc_reference

HIDDEN_SIZES = (576, 2048, 4096)
DBS, TOPK = 32, 128


def _activations(hidden: int, chunks: int, seed: int) -> np.ndarray:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DBS * chunks, hidden, generator=g) * torch.exp(0.7 * torch.randn(DBS * chunks, hidden, generator=g))
    return x.bfloat16().view(torch.int16).numpy().view(np.uint16).copy()


def bench_math(chunks: int, repeats: int, threads: int, reference: bool) -> list[dict[str, Any]]:
    import torch

    import toploc

    torch.set_num_threads(threads)
    arrays = {f"h{h}": _activations(h, chunks, seed=h) for h in HIDDEN_SIZES}
    rows: list[dict[str, Any]] = []
    ours: dict[str, dict[str, Any]] = {}
    for key, bits in arrays.items():
        acts = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        proofs = toploc.build_proofs_bytes(acts, DBS, TOPK, skip_prefill=True)  # warm-up (inverse table etc.)
        toploc.verify_proofs_bytes(acts, proofs, DBS, TOPK, skip_prefill=True)
        best_b = best_v = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            proofs = toploc.build_proofs_bytes(acts, DBS, TOPK, skip_prefill=True)
            best_b = min(best_b, time.perf_counter() - t)
            t = time.perf_counter()
            res = toploc.verify_proofs_bytes(acts, proofs, DBS, TOPK, skip_prefill=True)
            best_v = min(best_v, time.perf_counter() - t)
        assert all(r.exp_mismatches == 0 for r in res)
        ours[key] = {"build": best_b / chunks, "verify": best_v / chunks, "proofs": [p.hex() for p in proofs]}
    ref: dict[str, Any] = {}
    if reference:
        run_worker = toploc_reference.run_worker

        with tempfile.TemporaryDirectory() as tmp:
            npz = Path(tmp) / "acts.npz"
            np.savez(npz, **arrays)
            ref = run_worker({"op": "bench", "npz": str(npz), "keys": list(arrays), "threads": threads,
                              "decode_batching_size": DBS, "topk": TOPK, "repeats": repeats})
    for h in HIDDEN_SIZES:
        key = f"h{h}"
        row: dict[str, Any] = {"hidden": h, "chunks": chunks,
                               "ours_build_ms": ours[key]["build"] * 1e3, "ours_verify_ms": ours[key]["verify"] * 1e3}
        if key in ref:
            r = ref[key]
            row.update({
                "ref_build_ms": r["build_s_per_chunk"] * 1e3, "ref_verify_ms": r["verify_s_per_chunk"] * 1e3,
                "build_ratio": ours[key]["build"] / r["build_s_per_chunk"],
                "verify_ratio": ours[key]["verify"] / r["verify_s_per_chunk"],
                "byte_identical": ours[key]["proofs"] == r["proofs"],
            })
        rows.append(row)
    return rows


def bench_model(n_seqs: int, new_tokens: int, batch1_seqs: int, threads: int, repeats: int,
                tiny: bool = False) -> dict[str, Any]:
    import torch

    from models import load
    from models.engine import Engine
    from models.forward import prefill
    from models.sampling import SamplingParams
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec
    from protocol.seeds import sampling_seed
    from toploc import ToplocThresholds
    from toploc.validation import Rollout, measure, prove

    torch.set_num_threads(threads)
    loaded = load(TinyModelSpec(seed=0, hidden_size=128) if tiny else SmolLM2Spec())
    engine = Engine(loaded)
    tok = loaded.tokenizer
    questions = [f"Write a short story about the number {i} and a {c}." for i, c in
                 zip(range(n_seqs), ["cat", "ship", "tree", "robot", "river", "star", "clock", "bird"] * 4, strict=False)]
    prompts = []
    for q in questions:
        enc = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(enc if isinstance(enc, list) else enc["input_ids"]))
    params = SamplingParams(temperature=1.0)
    seeds = [sampling_seed("0x70997970C51812dc3A010C7d01b50e0d17dc79C8", 0, i, 0, run_id="bench", chain_id=31337, pool="0x5FbDB2315678afecb367f032d93F642f64180aa3", counter=0, manifest_hash=bytes(32)) for i in range(n_seqs)]
    cfg = ToplocThresholds()

    t = time.perf_counter()
    gens = engine.generate(prompts, params, seeds, new_tokens)
    gen16_s = time.perf_counter() - t
    gen16_tokens = sum(len(g.tokens) for g in gens)
    t = time.perf_counter()
    gens1 = [engine.generate([p], params, [s], new_tokens)[0] for p, s in zip(prompts[:batch1_seqs], seeds, strict=False)]
    gen1_s = time.perf_counter() - t
    gen1_tokens = sum(len(g.tokens) for g in gens1)

    rollouts = [Rollout(g.prompt_tokens, g.tokens, prove(g.hidden_states, cfg), g.seed, new_tokens) for g in gens]

    # Bare prefill of exactly the same padded batches (sorted by length, same token budget as measure).
    seqs = sorted((g.prompt_tokens + g.tokens[:-1] for g in gens), key=len)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    group: list[list[int]] = []
    for s in [*seqs, None]:
        if s is not None and (not group or (len(group) + 1) * len(s) <= 8192):
            group.append(s)
            continue
        width = max(len(x) for x in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, x in enumerate(group):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        batches.append((ids, mask))
        group = [s] if s is not None else []

    def bare_prefill() -> None:
        for ids, mask in batches:
            prefill(loaded, ids, mask, logits_last_only=True)

    # Alternate the two and keep the best of each: this box is shared, so single runs are noisy.
    val_s = prefill_s = float("inf")
    reports = []
    for _ in range(repeats + 1):  # the first round warms both up
        t = time.perf_counter()
        reports = measure(loaded, rollouts, params, cfg)
        val_s = min(val_s, time.perf_counter() - t)
        t = time.perf_counter()
        bare_prefill()
        prefill_s = min(prefill_s, time.perf_counter() - t)
    assert all(r.error is None and not cfg.failing_chunks(r.proofs) for r in reports)

    verified = sum(len(g.tokens) for g in gens)
    out = {
        "model": "tiny" if tiny else "smollm2", "sequences": n_seqs, "new_tokens_max": new_tokens, "generated_tokens": verified,
        "prompt_tokens": sum(len(p) for p in prompts),
        "validation_tok_s": verified / val_s, "bare_prefill_tok_s": verified / prefill_s,
        "generate_b16_tok_s": gen16_tokens / gen16_s, "generate_b1_tok_s": gen1_tokens / gen1_s,
        "validation_over_prefill_time": val_s / prefill_s,
    }
    out["validation_vs_generate_b1"] = out["validation_tok_s"] / out["generate_b1_tok_s"]
    out["validation_vs_generate_b16"] = out["validation_tok_s"] / out["generate_b16_tok_s"]
    out["max_exp_mismatches_honest"] = max(c.exp_mismatches for r in reports for c in r.proofs)
    out["max_sampling_margin_honest"] = max(r.sampling.max_margin for r in reports if r.sampling)
    return out


def main() -> int:
    parser = harness.parser(__doc__, smoke="every part once on the smallest inputs, the tiny model (seconds; checks "
                            "the bench, measures nothing)", quick="short run (a minute or two)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both implementations)")
    parser.add_argument("--skip-model", action="store_true", help="skip the SmolLM2 part")
    parser.add_argument("--skip-reference", action="store_true", help="skip the reference venv")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    chunks, repeats = (1, 1) if args.smoke else (4, 3) if args.quick else (16, 5)
    reference = not args.skip_reference
    if reference and args.smoke and not toploc_reference.venv_exists():
        reference = False
        print("smoke: skipped the anchor (the reference toploc): its venv bench/.venvs/toploc-ref does not exist "
              "(`python -m bench.toploc_reference` makes it); ours runs alone", flush=True)
    result: dict[str, Any] = {
        "machine": harness.machine(args.threads),
        "settings": {"decode_batching_size": DBS, "topk": TOPK, "chunks": chunks, "repeats": repeats},
        "smoke": args.smoke, "reference_ran": reference,
    }
    rows = bench_math(chunks, repeats, args.threads, reference)
    result["proof_math"] = rows
    print(f"\nTOPLOC per 32-token chunk, k={TOPK}, {chunks} chunks per call, best of {repeats}, {args.threads} thread(s)")
    print(f"{'hidden':>7} {'build ms':>9} {'ref':>8} {'ratio':>6} {'verify ms':>10} {'ref':>8} {'ratio':>6}  bytes==ref")
    for r in rows:
        print(f"{r['hidden']:>7} {r['ours_build_ms']:>9.3f} {r.get('ref_build_ms', float('nan')):>8.3f} "
              f"{r.get('build_ratio', float('nan')):>6.2f} {r['ours_verify_ms']:>10.3f} "
              f"{r.get('ref_verify_ms', float('nan')):>8.3f} {r.get('verify_ratio', float('nan')):>6.2f}  "
              f"{r.get('byte_identical', '-')}")
    if not args.skip_model:
        n, new, b1 = (2, 8, 1) if args.smoke else (8, 32, 2) if args.quick else (16, 96, 4)
        m = bench_model(n, new, b1, args.threads, 1 if args.smoke else 2 if args.quick else 3, tiny=args.smoke)
        result["smollm2"] = m  # the key keeps its name in smoke runs (where `model` says "tiny")
        print(f"\n{'tiny random model' if args.smoke else 'SmolLM2-135M'} fp32, {m['sequences']} sequences, {m['generated_tokens']} generated tokens")
        for k in ("validation_tok_s", "bare_prefill_tok_s", "generate_b1_tok_s", "generate_b16_tok_s"):
            print(f"  {k:<28} {m[k]:10.1f}")
        print(f"  validation time / bare prefill time   {m['validation_over_prefill_time']:.3f}")
        print(f"  validation speed / generation b1      {m['validation_vs_generate_b1']:.2f}x")
        print(f"  validation speed / generation b16     {m['validation_vs_generate_b16']:.2f}x")
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
