"""Runs *inside* the reference venv (bench/.venvs/toploc-ref): only torch, numpy and toploc 0.1.6.

    python toploc_reference_worker.py COMMAND.json RESULT.json

COMMAND.json: {"op": "vectors" | "bench", "npz": path, ...}. Activations travel as bf16 bit
patterns (uint16) in the npz; see `bench.toploc_reference_vectors` and `bench.toploc`.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

import toploc
from toploc.poly import c_verify_proofs_bytes


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def _acts(npz, case: dict):
    if case["kind"] == "tensor":
        return _bf16(npz[case["name"] + "__0"])
    return [_bf16(npz[f"{case['name']}__{i}"]) for i in range(case["parts"])]


def _stats(results) -> list[list[float]]:
    return [[int(r.exp_mismatches), float(r.mant_err_mean), float(r.mant_err_median)] for r in results]


def _verify_all(acts, proofs: list[bytes], case: dict) -> dict:
    args = (case["decode_batching_size"], case["topk"])
    out = {}
    # The reference's public entry point (C++ path for a 2-D tensor with skip_prefill, else Python).
    out["api"] = _stats(toploc.verify_proofs_bytes(acts, proofs, *args, skip_prefill=case["skip_prefill"]))
    # Its Python path explicitly (a list input forces it): no modulus reduction, averaged median.
    as_list = list(acts) if isinstance(acts, torch.Tensor) else acts
    if not case["skip_prefill"] or isinstance(acts, torch.Tensor):
        out["python"] = _stats(toploc.verify_proofs_bytes(as_list, proofs, *args, skip_prefill=case["skip_prefill"]))
    # Its C++ path explicitly (2-D tensor, chunks of rows; only meaningful with skip_prefill).
    if isinstance(acts, torch.Tensor) and case["skip_prefill"]:
        out["cpp"] = _stats(c_verify_proofs_bytes(acts, proofs, *args))
    return out


def op_vectors(cmd: dict) -> dict:
    npz = np.load(cmd["npz"])
    result = {}
    for case in cmd["cases"]:
        acts = _acts(npz, case)
        args = (case["decode_batching_size"], case["topk"])
        ref = toploc.build_proofs_bytes(acts, *args, skip_prefill=case["skip_prefill"])
        entry = {"ref_proofs": [p.hex() for p in ref], "ref_verify_ref": _verify_all(acts, ref, case)}
        perturbed = _acts(npz, {**case, "name": case["name"] + "_perturbed"})
        entry["ref_verify_ref_perturbed"] = _verify_all(perturbed, ref, case)
        ours = [bytes.fromhex(h) for h in cmd.get("ours", {}).get(case["name"], [])]
        if ours:
            entry["ref_verify_ours"] = _verify_all(acts, ours, case)
            entry["ref_verify_ours_perturbed"] = _verify_all(perturbed, ours, case)
        result[case["name"]] = entry
    return {"toploc_version": toploc.__version__, "torch_version": torch.__version__, "cases": result}


def op_bench(cmd: dict) -> dict:
    torch.set_num_threads(cmd["threads"])
    npz = np.load(cmd["npz"])
    out = {}
    for key in cmd["keys"]:
        acts = _bf16(npz[key])
        dbs, k, reps = cmd["decode_batching_size"], cmd["topk"], cmd["repeats"]
        chunks = (acts.shape[0] + dbs - 1) // dbs
        proofs = toploc.build_proofs_bytes(acts, dbs, k, skip_prefill=True)  # warm-up
        best_build = best_verify = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            proofs = toploc.build_proofs_bytes(acts, dbs, k, skip_prefill=True)
            best_build = min(best_build, time.perf_counter() - t)
            t = time.perf_counter()
            toploc.verify_proofs_bytes(acts, proofs, dbs, k, skip_prefill=True)
            best_verify = min(best_verify, time.perf_counter() - t)
        out[key] = {"build_s_per_chunk": best_build / chunks, "verify_s_per_chunk": best_verify / chunks,
                    "proofs": [p.hex() for p in proofs]}
    return out


def main() -> None:
    cmd = json.load(open(sys.argv[1]))
    result = {"vectors": op_vectors, "bench": op_bench}[cmd["op"]](cmd)
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
