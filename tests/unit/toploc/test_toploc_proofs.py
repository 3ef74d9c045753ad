"""Proof math against independent slow oracles, and every malformed-input path."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

import toploc
from protocol.errors import ProofError
from toploc.field import PRIME, evaluate, injective_modulus, interpolate

P = PRIME


def newton_coefficients(x: list[int], y: list[int]) -> list[int]:
    """The reference's O(n^2) Newton interpolation + expansion, transcribed to Python (oracle)."""
    n = len(x)
    dd = [v % P for v in y]
    for k in range(1, n):
        for i in range(n - 1, k - 1, -1):
            dd[i] = (dd[i] - dd[i - 1]) * pow((x[i] - x[i - k]) % P, P - 2, P) % P
    coeffs, factor = [0] * n, [0] * n
    factor[0] = 1
    for i in range(n):
        for j in range(i + 1):
            coeffs[j] = (coeffs[j] + dd[i] * factor[j]) % P
        if i + 1 < n:
            minus, prev = (-x[i]) % P, factor[0]
            factor[0] = prev * minus % P
            for k in range(1, i + 2):
                old = factor[k]
                factor[k] = (prev + old * minus) % P
                prev = old
    return coeffs


def slow_verify(acts: torch.Tensor, proof: bytes, topk: int) -> tuple[int, float, float]:
    """The reference C++ verifier for one chunk, element by element (oracle)."""
    flat = acts.reshape(-1)
    idx = flat.abs().topk(topk).indices.tolist()
    bits = [int(b) & 0xFFFF for b in flat[idx].view(torch.int16).tolist()]
    modulus = int.from_bytes(proof[:2], "big")
    coeffs = [int.from_bytes(proof[i : i + 2], "big") for i in range(2, len(proof), 2)]
    errs, mism = [], 0
    for i, b in zip(idx, bits, strict=True):
        xv, acc = i % modulus, 0
        for c in reversed(coeffs):
            acc = (acc * xv + c) % P
        if (acc >> 7) & 0xFF != (b >> 7) & 0xFF:
            mism += 1
        else:
            errs.append(abs((acc & 0x7F) - (b & 0x7F)))
    if not errs:
        return mism, float(2**64), float(2**64)
    return mism, sum(errs) / len(errs), float(sorted(errs)[len(errs) // 2])


@pytest.mark.parametrize("k", [1, 2, 3, 7, 64, 128])
def test_interpolation_matches_newton_oracle_and_round_trips(k: int) -> None:
    rng = np.random.default_rng(k)
    x = np.stack([rng.choice(P, size=k, replace=False) for _ in range(3)]).astype(np.int64)
    y = rng.integers(0, 65536, size=(3, k)).astype(np.int64)
    c = interpolate(x, y)
    for r in range(3):
        assert c[r].tolist() == newton_coefficients(x[r].tolist(), y[r].tolist())
    assert (evaluate(c, x) == y % P).all()


def test_injective_modulus_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    x = np.stack([rng.choice(1 << 20, size=128, replace=False) for _ in range(8)]).astype(np.int64)
    x[0, :2] = [7, 7 + 65497]  # forces the search below 65497
    got = injective_modulus(x)
    for r in range(8):
        m = 65497
        while len({int(v) % m for v in x[r]}) < 128:
            m -= 1
        assert got[r] == m
    assert got[0] < 65497


def _acts(seed: int, rows: int = 64, hidden: int = 576) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).bfloat16()


def test_honest_round_trip_tensor_list_and_base64_forms() -> None:
    a = _acts(0, rows=70)
    for skip in (True, False):
        proofs = toploc.build_proofs_bytes(a, 32, 128, skip_prefill=skip)
        assert len(proofs) == (3 if skip else 4) and all(len(p) == 258 for p in proofs)
        res = toploc.verify_proofs_bytes(a, proofs, 32, 128, skip_prefill=skip)
        assert all(r == toploc.VerificationResult(0, 0.0, 0.0) for r in res)
        rows = list(a)  # list of 1-D rows: same chunks
        assert toploc.build_proofs_bytes(rows, 32, 128, skip_prefill=skip) == proofs
        b64 = toploc.build_proofs_base64(a, 32, 128, skip_prefill=skip)
        assert [base64.b64decode(s) for s in b64] == proofs
        assert toploc.verify_proofs_base64(a, b64, 32, 128, skip_prefill=skip) == res
        polys = toploc.build_proofs(a, 32, 128, skip_prefill=skip)
        assert [p.to_bytes() for p in polys] == proofs
        assert toploc.verify_proofs(a, polys, 32, 128, skip_prefill=skip) == res


def test_verify_matches_slow_oracle_on_perturbed_and_foreign_activations() -> None:
    a = _acts(1, rows=32, hidden=4096)  # 131072 values per chunk: indices above the modulus
    proof = toploc.build_proofs_bytes(a, 32, 128, skip_prefill=True)
    noisy = (a.float() + 0.02 * torch.randn(a.shape, generator=torch.Generator().manual_seed(2))).bfloat16()
    for acts in (a, noisy, _acts(3, rows=32, hidden=4096)):
        got = toploc.verify_proofs_bytes(acts, proof, 32, 128, skip_prefill=True)[0]
        assert (got.exp_mismatches, got.mant_err_mean, got.mant_err_median) == slow_verify(acts, proof[0], 128)
    foreign = toploc.verify_proofs_bytes(_acts(3, rows=32, hidden=4096), proof, 32, 128, skip_prefill=True)[0]
    assert foreign.exp_mismatches > 100  # another tensor's top-k: nearly every exponent differs


def test_proof_poly_call_reduces_by_the_modulus() -> None:
    a = _acts(4, rows=32, hidden=4096)
    poly = toploc.build_proofs(a, 32, 128, skip_prefill=True)[0]
    flat = a.reshape(-1)
    i = int(flat.abs().topk(128).indices[0])
    assert poly(i) == int(flat[i].view(torch.int16)) & 0xFFFF


# --- malformed input: every path raises ProofError, never crashes or returns a "null proof" ---

def _good() -> tuple[torch.Tensor, list[bytes]]:
    a = _acts(5, rows=64)
    return a, toploc.build_proofs_bytes(a, 32, 128, skip_prefill=True)


def _with_modulus(p: bytes, m: int) -> bytes:
    return m.to_bytes(2, "big") + p[2:]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p[:-1],  # too short (the reference drops the odd byte silently)
        lambda p: p + b"\x00",  # odd length
        lambda p: p + b"\x00\x00",  # one coefficient too many
        lambda p: b"",
        lambda p: _with_modulus(p, 0),  # the reference's C++ verifier dies of SIGFPE on this
        lambda p: _with_modulus(p, 65498),
        lambda p: _with_modulus(p, 65535),
        lambda p: _with_modulus(p, 127),  # fewer residues than points: no modulus search yields it
        lambda p: p[:2] + b"\xff\xff" + p[4:],  # coefficient outside the field
    ],
)
def test_malformed_proof_bytes_raise(mutate: object) -> None:
    a, proofs = _good()
    bad = [proofs[0], mutate(proofs[1])]  # type: ignore[operator]
    with pytest.raises(ProofError):
        toploc.verify_proofs_bytes(a, bad, 32, 128, skip_prefill=True)


def test_wrong_chunk_count_and_types_raise() -> None:
    a, proofs = _good()
    for bad in (proofs[:1], proofs + proofs[:1], [], [b"x"] * 1_000_000):
        with pytest.raises(ProofError, match="proofs for"):
            toploc.verify_proofs_bytes(a, bad, 32, 128, skip_prefill=True)
    for bad_list in ([proofs[0].hex(), proofs[1].hex()], [1, 2], proofs[0], "abc", None):
        with pytest.raises(ProofError):
            toploc.verify_proofs_bytes(a, bad_list, 32, 128, skip_prefill=True)  # type: ignore[arg-type]
    with pytest.raises(ProofError):
        toploc.verify_proofs_base64(a, ["not base64!", "AAAA"], 32, 128, skip_prefill=True)
    with pytest.raises(ProofError):
        toploc.verify_proofs_base64(a, [proofs[0], proofs[1]], 32, 128, skip_prefill=True)  # type: ignore[list-item]
    with pytest.raises(ProofError):
        toploc.verify_proofs(a, list(proofs), 32, 128, skip_prefill=True)  # type: ignore[arg-type]
    with pytest.raises(ProofError):
        toploc.verify_proofs(a, [toploc.ProofPoly((1, 2), 65497)] * 2, 32, 128, skip_prefill=True)


def test_bad_activations_and_arguments_raise() -> None:
    a, proofs = _good()
    for acts in (a.float(), a.half(), [], torch.zeros(0, 576, dtype=torch.bfloat16), "x", [a[0], "y"]):
        with pytest.raises(ProofError):
            toploc.build_proofs_bytes(acts, 32, 128, skip_prefill=True)  # type: ignore[arg-type]
        with pytest.raises(ProofError):
            toploc.verify_proofs_bytes(acts, proofs, 32, 128, skip_prefill=True)  # type: ignore[arg-type]
    with pytest.raises(ProofError, match="fewer than topk"):
        toploc.build_proofs_bytes(a[:, :2], 32, 128, skip_prefill=False)  # first chunk: 2 values
    for dbs, k in ((0, 128), (32, 0), (-1, 128)):
        with pytest.raises(ProofError):
            toploc.build_proofs_bytes(a, dbs, k, skip_prefill=True)


def test_random_bytes_of_the_right_length_give_measurements_or_proof_error() -> None:
    a, _ = _good()
    rng = np.random.default_rng(7)
    outcomes = {"error": 0, "measured": 0}
    for _ in range(40):
        raw = [rng.bytes(258), rng.bytes(258)]
        if rng.random() < 0.5:  # make the modulus valid so the evaluation path runs
            raw = [_with_modulus(bytes(np.minimum(np.frombuffer(r, ">u2"), P - 1).astype(">u2").tobytes()),
                                 int(rng.integers(128, P + 1))) for r in raw]
        try:
            res = toploc.verify_proofs_bytes(a, raw, 32, 128, skip_prefill=True)
        except ProofError:
            outcomes["error"] += 1
        else:
            outcomes["measured"] += 1
            assert all(r.exp_mismatches > 38 for r in res)  # noise never passes the default threshold
    assert outcomes["error"] > 0 and outcomes["measured"] > 0


def test_thresholds_flag_chunks_over_the_defaults() -> None:
    t = toploc.ToplocThresholds()
    assert (t.max_exp_mismatches, t.max_mant_err_mean, t.max_mant_err_median, t.topk) == (38, 10.0, 8.0, 128)
    res = [
        toploc.VerificationResult(38, 10.0, 8.0),
        toploc.VerificationResult(39, 0.0, 0.0),
        toploc.VerificationResult(0, 10.5, 0.0),
        toploc.VerificationResult(0, 0.0, 9.0),
    ]
    assert t.failing_chunks(res) == [1, 2, 3]
    with pytest.raises(ValueError):
        toploc.ToplocThresholds(unknown=1)  # type: ignore[call-arg]


# --- hand-built ProofPoly values: validated on construction, comparable and hashable ---

@pytest.mark.parametrize(
    ("coeffs", "modulus"),
    [
        ([1, 2, 3], 0),  # evaluating it divided by zero
        ([1, 2, 3], 2),  # fewer residues than coefficients
        ([1, 2, 3], P + 1),
        ([1, 2, 3], -5),
        ([1, 2, P], P),  # not a field element
        ([1, -1, 3], P),
        ([2**70, 1, 1], P),  # overflowed int64 when verified
        ([], P),
        ([1.5, 2, 3], P),
        ("abc", P),
        ([1, 2, 3], 7.0),
        ([1, 2, 3], None),
    ],
)
def test_proof_poly_refuses_out_of_range_values(coeffs: object, modulus: object) -> None:
    with pytest.raises(ProofError):
        toploc.ProofPoly(coeffs, modulus)  # type: ignore[arg-type]


def test_hand_built_proofs_verify_or_raise_proof_error() -> None:
    a, proofs = _good()
    parsed = [toploc.ProofPoly.from_bytes(p) for p in proofs]
    # A list-built copy is the same proof: it verifies like the parsed one.
    by_hand = [toploc.ProofPoly(list(p.coeffs), p.modulus) for p in parsed]
    assert toploc.verify_proofs(a, by_hand, 32, 128, skip_prefill=True) == toploc.verify_proofs_bytes(
        a, proofs, 32, 128, skip_prefill=True)
    with pytest.raises(ProofError, match="null"):
        toploc.verify_proofs(a, [toploc.ProofPoly.null(128)] * 2, 32, 128, skip_prefill=True)
    with pytest.raises(ProofError, match="null"):
        toploc.ProofPoly.null(4)(3)
    with pytest.raises(ProofError):  # the null proof's bytes are not a proof either
        toploc.ProofPoly.from_bytes(toploc.ProofPoly.null(128).to_bytes())
    with pytest.raises(AttributeError):
        parsed[0].modulus = 0  # type: ignore[misc]


def test_proof_poly_equality_and_hash_do_not_depend_on_how_it_was_made() -> None:
    import pickle

    listed = toploc.ProofPoly([1, 2, 3, 4], P)
    parsed = toploc.ProofPoly.from_bytes(listed.to_bytes())
    from_b64 = toploc.ProofPoly.from_base64(listed.to_base64())
    tupled = toploc.ProofPoly((1, 2, 3, 4), P)
    numpy_ints = toploc.ProofPoly(np.array([1, 2, 3, 4], dtype=np.int64), np.int64(P))
    assert listed == parsed == from_b64 == tupled == numpy_ints
    assert len({listed, parsed, from_b64, tupled, numpy_ints}) == 1
    assert pickle.loads(pickle.dumps(listed)) == listed
    assert listed != toploc.ProofPoly([1, 2, 3, 5], P) and listed != toploc.ProofPoly([1, 2, 3, 4], P - 1)
    assert listed.coeffs == [1, 2, 3, 4] and type(listed.modulus) is int
    listed.coeffs.append(9)  # a copy, as in the reference: the proof does not change
    assert len(listed) == 4
