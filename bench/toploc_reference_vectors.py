"""Generate the TOPLOC compatibility vectors (tests/data/toploc/) with the reference toploc 0.1.6.

    python -m bench.toploc_reference_vectors [--out tests/data/toploc]

1. Makes a few activation sets (bf16, seeded, stored as uint16 bit patterns in vectors.npz):
   decode rows at hidden 576, a prefill-plus-decode list, small k, and a 2048-wide chunk with
   planted spikes whose flat indices collide modulo 65497, 65496 and 65495 (so the injective
   modulus drops below 65497: the case the reference's Python verifier gets wrong).
2. In the reference's own venv (`bench.toploc_reference`) builds proofs and verifies them through
   its public API, its Python path and its C++ path, on the activations and on a deterministic
   perturbation of them; it also verifies *our* proofs (this direction can only be produced here).
3. Writes vectors.json: case specs, reference proofs (hex), every reference statistic.

The tests (tests/unit/toploc/test_toploc_compat.py) then check, without the reference installed: our
proofs are byte-identical to the reference's; ours verifying the reference's proofs gives the
reference's C++-path statistics; the reference verifying ours gave the same statistics as ours.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from bench.harness import ROOT
from bench.toploc_reference import run_worker

CASES = [
    {"name": "rows576", "kind": "tensor", "shape": [96, 576], "decode_batching_size": 32, "topk": 128,
     "skip_prefill": True},
    {"name": "list576", "kind": "list", "prefill_rows": 7, "decode_rows": 40, "hidden": 576,
     "decode_batching_size": 32, "topk": 128, "skip_prefill": False},
    {"name": "small", "kind": "tensor", "shape": [10, 64], "decode_batching_size": 4, "topk": 16,
     "skip_prefill": False},
    {"name": "spikes2048", "kind": "tensor", "shape": [32, 2048], "decode_batching_size": 32, "topk": 128,
     "skip_prefill": True},
]

# Flat index pairs that collide modulo 65497, 65496, 65495: the injective modulus becomes 65494.
SPIKES = [(5, 5 + 65497), (12, 12 + 65496), (30, 30 + 65495)]


def perturb(bits: np.ndarray) -> np.ndarray:
    """Deterministic perturbation (mirrored in the tests): flip the two low mantissa bits by a
    hashed pattern, and the exponent's low bit on every 97th value."""
    j = np.arange(bits.size, dtype=np.int64).reshape(bits.shape)
    return (bits.astype(np.int64) ^ (((j * 2654435761) >> 7) & 3) ^ ((j % 97 == 0) << 7)).astype(np.uint16)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    import torch

    t = torch.from_numpy(values.astype(np.float32)).bfloat16()
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def make_activations(seed: int = 2024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for case in CASES:
        name = case["name"]
        if case["kind"] == "tensor":
            rows, hidden = case["shape"]
            vals = rng.standard_normal((rows, hidden)) * np.exp(rng.standard_normal((rows, hidden)) * 0.7)
            if name == "spikes2048":
                flat = vals.reshape(-1)
                for n, (a, b) in enumerate(SPIKES):
                    flat[a] = 200.0 + n
                    flat[b] = -(210.0 + n)
            parts = [_bf16_bits(vals)]
        else:
            hidden = case["hidden"]
            parts = [_bf16_bits(rng.standard_normal((case["prefill_rows"], hidden)) * 2)]
            parts += [_bf16_bits(rng.standard_normal((1, hidden)) * 2) for _ in range(case["decode_rows"])]
        case["parts"] = len(parts)
        for i, p in enumerate(parts):
            arrays[f"{name}__{i}"] = p
            arrays[f"{name}_perturbed__{i}"] = perturb(p)
    return arrays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "toploc")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    import toploc

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    arrays = make_activations()
    npz_path = args.out / "vectors.npz"
    # Only the unperturbed activations are committed; the tests recompute the perturbation.
    np.savez_compressed(npz_path, **{k: v for k, v in arrays.items() if "_perturbed" not in k})
    full = args.out / "_all_tmp.npz"
    np.savez(full, **arrays)

    def acts(name: str, kind: str, parts: int):
        ts = [torch.from_numpy(arrays[f"{name}__{i}"].view(np.int16).copy()).view(torch.bfloat16)
              for i in range(parts)]
        return ts[0] if kind == "tensor" else ts

    ours = {}
    our_stats = {}
    for case in CASES:
        a = acts(case["name"], case["kind"], case["parts"])
        dbs, k, skip = case["decode_batching_size"], case["topk"], case["skip_prefill"]
        proofs = toploc.build_proofs_bytes(a, dbs, k, skip_prefill=skip)
        ours[case["name"]] = [p.hex() for p in proofs]
        pa = acts(case["name"] + "_perturbed", case["kind"], case["parts"])
        our_stats[case["name"]] = {
            "ours_verify_ours": [[r.exp_mismatches, r.mant_err_mean, r.mant_err_median]
                                 for r in toploc.verify_proofs_bytes(a, proofs, dbs, k, skip_prefill=skip)],
            "ours_verify_ours_perturbed": [[r.exp_mismatches, r.mant_err_mean, r.mant_err_median]
                                           for r in toploc.verify_proofs_bytes(pa, proofs, dbs, k, skip_prefill=skip)],
        }
    try:
        ref = run_worker({"op": "vectors", "npz": str(full), "cases": CASES, "ours": ours})
    finally:
        full.unlink()
    doc = {
        "about": "TOPLOC compatibility vectors; generated by bench/toploc_reference_vectors.py",
        "reference": {"toploc": ref["toploc_version"], "torch": ref["torch_version"]},
        "spikes": SPIKES,
        "cases": [],
    }
    for case in CASES:
        entry = {**case, **ref["cases"][case["name"]], **our_stats[case["name"]]}
        entry["ours_equal_ref_bytes"] = ours[case["name"]] == entry["ref_proofs"]
        doc["cases"].append(entry)
        logging.info("%s: byte-identical=%s, ref C++/API stats on ref proofs=%s", case["name"],
                     entry["ours_equal_ref_bytes"], entry["ref_verify_ref"]["api"])
    (args.out / "vectors.json").write_text(json.dumps(doc, indent=1) + "\n")
    logging.info("wrote %s and %s", npz_path, args.out / "vectors.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
