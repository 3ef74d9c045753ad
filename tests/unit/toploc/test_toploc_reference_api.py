"""The reference toploc 0.1.6's public API, checked against the expectations of its own test suite.

Written from reading the reference's tests/ (test_poly.py, test_utils.py): the same inputs and
the same assertions, restated here, plus the two deliberate differences (errors raise
`ProofError` rather than returning null proofs; empty activations raise). The whole reference
suite runs against this package with `python -m bench.toploc_reference_suite`.
"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import pytest
import torch

import toploc
import toploc.poly
from protocol.errors import ProofError
from toploc.poly import ProofPoly, VerificationResult

P = toploc.PRIME


def test_find_injective_modulus() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randint(0, 4_000_000_000, (100,), generator=gen).tolist()
        m = toploc.poly.find_injective_modulus(x)
        assert isinstance(m, int) and m <= P
        assert len({v % m for v in x}) == len(x)
        assert all(len({v % bigger for v in x}) < len(x) for bigger in range(m + 1, P + 1))
    for bad in ([], [3, 3], [-1, 2]):
        with pytest.raises(ProofError):
            toploc.poly.find_injective_modulus(bad)


def test_proof_poly_basics() -> None:
    poly = ProofPoly([1, 2, 3, 4], 65497)
    assert poly.coeffs == [1, 2, 3, 4] and poly.modulus == 65497 and len(poly) == 4
    x = 42
    assert poly(x) == (1 + 2 * x + 3 * x**2 + 4 * x**3) % 65497
    assert repr(poly) == "ProofPoly[65497]([1, 2, 3, 4])"
    encoded = poly.to_base64()
    assert isinstance(encoded, str) and base64.b64decode(encoded) == poly.to_bytes()
    for back in (ProofPoly.from_bytes(poly.to_bytes()), ProofPoly.from_base64(encoded)):
        assert back.coeffs == poly.coeffs and back.modulus == poly.modulus and back == poly


def test_null_proof() -> None:
    null = ProofPoly.null(5)
    assert len(null) == 5 and null.modulus == 0 and null.coeffs == [0] * 5 and null.is_null
    assert null.to_bytes() == bytes(12)


def test_from_points() -> None:
    poly = ProofPoly.from_points([1, 2, 3], [4, 5, 6])
    assert isinstance(poly, ProofPoly) and len(poly.coeffs) == 3
    assert [poly(1), poly(2), poly(3)] == [4, 5, 6]
    tensor_poly = ProofPoly.from_points_tensor(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))
    assert tensor_poly == poly and [tensor_poly(i) for i in (1, 2, 3)] == [4, 5, 6]
    values = torch.tensor([4, 5, 6], dtype=torch.bfloat16)
    bf16 = ProofPoly.from_points_tensor(torch.tensor([1, 2, 3], dtype=torch.int32), values)
    assert [bf16(i) for i in (1, 2, 3)] == (values.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    # Large indices: reduced by the modulus found, evaluated after the same reduction.
    xs = [7, 7 + P, 123_456_789]
    big = ProofPoly.from_points(xs, [10, 20, 30])
    assert big.modulus < P and [big(v) for v in xs] == [10, 20, 30]


@pytest.mark.parametrize(
    ("x", "y"),
    [
        ([1, 1], [2, 3]),  # duplicate x
        ([1, 2], [3]),
        ([], []),
        ([1, -2], [3, 4]),
        ([1, 2], [3, 1 << 16]),
    ],
)
def test_from_points_refuses_bad_points(x: list[int], y: list[int]) -> None:
    with pytest.raises(ProofError):
        ProofPoly.from_points(x, y)


def test_from_points_tensor_refuses_bad_tensors() -> None:
    x = torch.tensor([1, 2, 3])
    for bad_x, bad_y in [
        (x.float(), torch.tensor([4, 5, 6])),
        (x, torch.tensor([4.0, 5.0, 6.0], dtype=torch.float16)),  # fp16 proofs cannot be verified
        (x, torch.tensor([4.0, 5.0, 6.0])),
        (x.reshape(3, 1), torch.tensor([[4], [5], [6]])),
    ]:
        with pytest.raises(ProofError):
            ProofPoly.from_points_tensor(bad_x, bad_y)


def _sample_activations() -> list[torch.Tensor]:
    """The reference fixture's shapes: a (3, 16) prefill, then seven 16-wide decode rows."""
    gen = torch.Generator().manual_seed(42)
    acts = [torch.randn(3, 16, generator=gen).bfloat16()]
    acts += [torch.randn(16, generator=gen).bfloat16() for _ in range(7)]
    return acts


def test_batch_activations_and_build_counts() -> None:
    acts = _sample_activations()
    chunks = toploc.poly.batch_activations(acts, decode_batching_size=2)
    assert [c.numel() for c in chunks] == [48, 32, 32, 32, 16]
    assert torch.equal(chunks[1], torch.cat([acts[1], acts[2]]))
    assert [c.numel() for c in toploc.poly.batch_activations(acts[1:], 2, skip_prefill=True)] == [32, 32, 32, 16]
    assert len(toploc.poly.batch_activations([a.float() for a in acts], 2)) == 5  # any dtype
    assert len(toploc.build_proofs_bytes(acts, decode_batching_size=2, topk=5)) == 5
    b64 = toploc.build_proofs_base64(acts, decode_batching_size=2, topk=5)
    assert len(b64) == 5 and all(isinstance(p, str) for p in b64)
    assert len(toploc.build_proofs_bytes(acts[1:], decode_batching_size=2, topk=5, skip_prefill=True)) == 4
    rows = torch.randn(17, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert len(toploc.build_proofs_base64(rows, decode_batching_size=4, topk=5, skip_prefill=True)) == 5
    assert len(toploc.build_proofs_bytes(acts, decode_batching_size=2, topk=1)) == 5
    assert len(toploc.build_proofs_bytes(acts, decode_batching_size=10, topk=5)) == 2
    assert len(toploc.build_proofs_bytes(acts[:1], decode_batching_size=2, topk=5)) == 1


def test_errors_raise_instead_of_null_proofs() -> None:
    # The reference returns null proofs for these and [] for an empty list; we raise (README).
    with pytest.raises(ProofError):
        toploc.build_proofs_bytes([torch.randn(0, 16).bfloat16(), torch.randn(16).bfloat16()], 2, 5)
    with pytest.raises(ProofError):
        toploc.build_proofs_bytes(_sample_activations()[1:1], 2, 5, skip_prefill=True)


@pytest.mark.parametrize(
    ("scale", "dbs", "topk", "check"),
    [
        (1.0, 2, 5, lambda r: r.exp_mismatches == 0 and r.mant_err_mean == 0 and r.mant_err_median == 0),
        (1.01, 3, 4, lambda r: r.exp_mismatches == 0 and 0 < r.mant_err_mean <= 2 and 0 < r.mant_err_median <= 2),
        (1.10, 3, 4, lambda r: r.exp_mismatches <= 2 and r.mant_err_mean > 10 and r.mant_err_median > 10),
        (4.0, 2, 5, lambda r: r.exp_mismatches == 5 and r.mant_err_mean > 2**32 and r.mant_err_median > 2**32),
    ],
    ids=["same", "x1.01", "x1.10", "x4"],
)
def test_verify_scaled_activations(scale: float, dbs: int, topk: int, check: object) -> None:
    acts = _sample_activations()
    proofs = toploc.build_proofs_base64(acts, decode_batching_size=dbs, topk=topk)
    results = toploc.verify_proofs_base64([a * scale for a in acts], proofs, dbs, topk)
    assert len(results) == len(proofs)
    assert all(isinstance(r, VerificationResult) and check(r) for r in results)  # type: ignore[operator]


def test_verify_skip_prefill_rows() -> None:
    acts = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    proofs = toploc.build_proofs_bytes(acts, decode_batching_size=3, topk=4, skip_prefill=True)
    assert len(proofs) == 6
    assert toploc.verify_proofs_bytes(acts, proofs, 3, 4, skip_prefill=True) == [VerificationResult(0, 0.0, 0.0)] * 6


def test_pickling() -> None:
    result = VerificationResult(1, 2, 3)
    assert pickle.loads(pickle.dumps(result)) == result != VerificationResult(2, 2, 3)
    poly = ProofPoly([1, 2, 3], 4)
    back = pickle.loads(pickle.dumps(poly))
    assert back == poly and back != ProofPoly([1, 2, 3], 5) and back != ProofPoly([1, 2, 4], 4)


def test_sha256sum(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"Hello, world!" * 1000)
    expected = "a8f764e70df94be2c911fb51b3d0c56c03882078dbdb215de8b7bd0374b0fb10"
    assert toploc.sha256sum(str(path)) == expected
    assert toploc.sha256sum(path, chunk_size=7) == expected
