"""Compatibility with the reference toploc 0.1.6, from vectors it generated (tests/data/toploc/).

Regenerate with `python -m bench.toploc_reference_vectors` (builds the reference in its own venv).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import toploc

DATA = Path(__file__).resolve().parents[2] / "data" / "toploc"


def perturb(bits: np.ndarray) -> np.ndarray:
    """Same deterministic perturbation as bench/toploc_reference_vectors.py (kept in sync by hand;
    the recorded statistics would not match otherwise)."""
    j = np.arange(bits.size, dtype=np.int64).reshape(bits.shape)
    return (bits.astype(np.int64) ^ (((j * 2654435761) >> 7) & 3) ^ ((j % 97 == 0) << 7)).astype(np.uint16)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


@pytest.fixture(scope="module")
def vectors() -> tuple[dict[str, Any], Any]:
    doc = json.loads((DATA / "vectors.json").read_text())
    return doc, np.load(DATA / "vectors.npz")


def _acts(npz: Any, case: dict[str, Any], perturbed: bool = False) -> Any:
    parts = [npz[f"{case['name']}__{i}"] for i in range(case["parts"])]
    if perturbed:
        parts = [perturb(p) for p in parts]
    ts = [_bf16(p) for p in parts]
    return ts[0] if case["kind"] == "tensor" else ts


def _stats(results: list[toploc.VerificationResult]) -> list[list[float]]:
    return [[r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in results]


def _args(case: dict[str, Any]) -> tuple[int, int]:
    return case["decode_batching_size"], case["topk"]


def _cases(vectors: tuple[dict[str, Any], Any]) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = vectors[0]["cases"]
    assert {c["name"] for c in cases} >= {"rows576", "list576", "small", "spikes2048"}
    return cases


def test_our_proofs_are_byte_identical_to_the_reference(vectors: tuple[dict[str, Any], Any]) -> None:
    _, npz = vectors
    for case in _cases(vectors):
        ours = toploc.build_proofs_bytes(_acts(npz, case), *_args(case), skip_prefill=case["skip_prefill"])
        assert [p.hex() for p in ours] == case["ref_proofs"], case["name"]
        b64 = toploc.build_proofs_base64(_acts(npz, case), *_args(case), skip_prefill=case["skip_prefill"])
        assert [toploc.ProofPoly.from_base64(s).to_bytes().hex() for s in b64] == case["ref_proofs"]


def test_reference_proofs_verify_in_ours_with_the_reference_statistics(vectors: tuple[dict[str, Any], Any]) -> None:
    _, npz = vectors
    for case in _cases(vectors):
        proofs = [bytes.fromhex(h) for h in case["ref_proofs"]]
        for perturbed, key in ((False, "ref_verify_ref"), (True, "ref_verify_ref_perturbed")):
            ours = toploc.verify_proofs_bytes(_acts(npz, case, perturbed), proofs, *_args(case),
                                              skip_prefill=case["skip_prefill"])
            recorded = case[key]
            # The reference's C++ path applies the modulus; compare with it where it ran, else its API.
            assert _stats(ours) == recorded.get("cpp", recorded["api"]), (case["name"], key)


def test_reference_verifying_our_proofs_gave_our_statistics(vectors: tuple[dict[str, Any], Any]) -> None:
    _, npz = vectors
    for case in _cases(vectors):
        ours = toploc.build_proofs_bytes(_acts(npz, case), *_args(case), skip_prefill=case["skip_prefill"])
        for perturbed, key in ((False, "ref_verify_ours"), (True, "ref_verify_ours_perturbed")):
            mine = toploc.verify_proofs_bytes(_acts(npz, case, perturbed), ours, *_args(case),
                                              skip_prefill=case["skip_prefill"])
            recorded = case[key]
            assert _stats(mine) == recorded.get("cpp", recorded["api"]), (case["name"], key)
            assert mine[0].exp_mismatches >= 0


def test_spiked_chunk_needs_a_smaller_modulus_and_only_the_reference_python_path_gets_it_wrong(
    vectors: tuple[dict[str, Any], Any],
) -> None:
    doc, npz = vectors
    case = next(c for c in doc["cases"] if c["name"] == "spikes2048")
    proof = toploc.ProofPoly.from_bytes(bytes.fromhex(case["ref_proofs"][0]))
    assert proof.modulus == 65497 - len(doc["spikes"])
    # The reference's Python path evaluates at unreduced indices: honest activations show mismatches.
    assert case["ref_verify_ref"]["python"][0][0] > 0
    ours = toploc.verify_proofs(_acts(npz, case), [proof], *_args(case), skip_prefill=True)
    assert ours[0] == toploc.VerificationResult(0, 0.0, 0.0)


def test_perturbed_activations_produce_nonzero_statistics(vectors: tuple[dict[str, Any], Any]) -> None:
    # Guards the comparisons above against vacuous all-zero statistics.
    for case in _cases(vectors):
        assert any(s[1] > 0 for s in case["ref_verify_ref_perturbed"]["api"]), case["name"]
