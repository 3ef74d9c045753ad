"""Delta versions on the tiny model's real weights: made smaller than the full weights, reconstructed bit for
bit, refused with typed errors against another base or when the result is not the signed weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.identity import Identity
from shardcast import delta
from shardcast.delta import INDEX_FILE, VALUES_FILE, apply_delta, decode_positions, encode_positions
from shardcast.errors import DeltaBaseError, DeltaError, DeltaMismatchError
from shardcast.manifest import Manifest, SignedManifest, table_hash
from shardcast.publisher import DeltaBase, build_version, weights_table

SHARD = 64 * 1024


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    from models.loading import load
    from protocol.model_spec import TinyModelSpec

    model = load(TinyModelSpec()).model
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def _version(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def _step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """An RL-like step: a small share of the weights moves (in bf16 most updates round to no change)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        mask = torch.rand(tensor.shape, generator=gen) < fraction
        out[name] = torch.where(mask, tensor * 1.5 + 0.01, tensor).contiguous()
    return out


def _publish(tmp: Path, source: Path, version: int, base: tuple[Path, Manifest] | None = None) -> SignedManifest:
    return build_version(source, tmp / "store" / "versions", identity=IDENTITY, run_id="r", version=version,
                         shard_size=SHARD, dtype="bfloat16",
                         base=None if base is None else DeltaBase(base[0], base[1]))


def _delta_files(tmp: Path, version: int) -> Path:
    """The delta's files as a client assembles them from the version's shards."""
    vdir = tmp / "store" / "versions" / str(version)
    manifest = SignedManifest.parse((vdir / "manifest.json").read_bytes()).manifest
    out = tmp / f"delta-{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for f_index, entry in enumerate(manifest.files):
        with open(out / entry.path, "wb") as fh:
            for shard in manifest.shards:
                if shard.file == f_index:
                    fh.write((vdir / "shards" / str(shard.index)).read_bytes())
    return out


IDENTITY = Identity.create()


def _one_step(tmp: Path, state: dict[str, torch.Tensor]) -> tuple[Path, Path, Manifest, Manifest, Path]:
    """v1 (an anchor) and v2 (one step later, a delta against it): both directories, both manifests, and the
    delta's files as a client assembles them."""
    v1 = _version(tmp / "v1", state)
    v2 = _version(tmp / "v2", _step(state, seed=1))
    m1 = _publish(tmp, v1, 1).manifest
    m2 = _publish(tmp, v2, 2, base=(v1, m1)).manifest
    return v1, v2, m1, m2, _delta_files(tmp, 2)


def test_a_small_step_travels_as_a_delta_that_rebuilds_the_full_weights_bit_for_bit(
        tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    v1 = _version(tmp_path / "v1", tiny_state)
    v2 = _version(tmp_path / "v2", _step(tiny_state, seed=1))
    anchor = _publish(tmp_path, v1, 1).manifest
    assert anchor.delta is None and anchor.dtype == "bfloat16"
    delta = _publish(tmp_path, v2, 2, base=(v1, anchor)).manifest
    assert delta.delta is not None and delta.delta.base_version == 1
    assert delta.delta.base_weights == anchor.weights_hash()
    # 2% of bf16 weights changed: a gap (1 B at a mean gap of 50, 8% of gaps take 2) + the value (2 B) against the
    # full 2 B per weight, plus the index: measured 3.6% (absolute 4-byte positions, shardcast-delta/1, cost 6 B
    # per changed weight, over 6%)
    assert delta.total_bytes < 0.045 * delta.full_bytes
    # the full-weight hash is what an anchor of the same weights would carry
    assert delta.weights_hash() == table_hash(*weights_table(v2, SHARD))
    out = tmp_path / "rebuilt"
    apply_delta(v1, anchor, _delta_files(tmp_path, 2), delta, out)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (v2 / name).read_bytes()
    rebuilt = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(rebuilt[k].view(torch.int16), _step(tiny_state, seed=1)[k].view(torch.int16))
               for k in rebuilt)
    assert (v1 / "model.safetensors").read_bytes() != (v2 / "model.safetensors").read_bytes()  # base untouched


def test_a_delta_against_another_base_is_refused(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    v1 = _version(tmp_path / "v1", tiny_state)
    v2 = _version(tmp_path / "v2", _step(tiny_state, seed=1))
    v3 = _version(tmp_path / "v3", _step(_step(tiny_state, seed=1), seed=2))
    m1 = _publish(tmp_path, v1, 1).manifest
    m2 = _publish(tmp_path, v2, 2, base=(v1, m1)).manifest
    m3 = _publish(tmp_path, v3, 3, base=(v2, m2)).manifest
    with pytest.raises(DeltaBaseError):  # v3 is made against v2, and v1 is offered
        apply_delta(v1, m1, _delta_files(tmp_path, 3), m3, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a base that claims to be v2 but holds other weights (its manifest is v1's, relabelled) is refused as well
    forged = m1.model_copy(update={"version": 2})
    with pytest.raises(DeltaBaseError):
        apply_delta(v1, forged, _delta_files(tmp_path, 3), m3, tmp_path / "out")


def test_a_result_that_is_not_the_signed_weights_is_refused(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    v1, v2, m1, m2, files = _one_step(tmp_path, tiny_state)
    values = bytearray((files / VALUES_FILE).read_bytes())
    values[-1] ^= 0x01  # one bit of one new value
    (files / VALUES_FILE).write_bytes(bytes(values))
    with pytest.raises(DeltaMismatchError):
        apply_delta(v1, m1, files, m2, tmp_path / "out")
    # so is a base file damaged on disk under a manifest that still names the right weights
    files = _delta_files(tmp_path, 2)
    damaged = tmp_path / "v1-damaged"
    shutil.copytree(v1, damaged)
    raw = bytearray((damaged / "model.safetensors").read_bytes())
    raw[-2] ^= 0x40
    (damaged / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(DeltaMismatchError):
        apply_delta(damaged, m1, files, m2, tmp_path / "out2")


@pytest.mark.parametrize("change", ["op", "size", "positions", "past_values", "files", "gap_bytes", "gap_count"])
def test_a_malformed_delta_index_is_a_typed_error(tmp_path: Path, tiny_state: dict[str, torch.Tensor], change: str) -> None:
    v1, v2, m1, m2, files = _one_step(tmp_path, tiny_state)
    index = json.loads((files / INDEX_FILE).read_text())
    patch = next(e for e in index["files"] if e["op"] == "patch")
    region = patch["regions"][0]
    if change == "op":
        patch["op"] = "exec"
    elif change == "size":
        patch["size"] += 1
    elif change == "positions":
        region["stop"] = region["start"] + region["width"]  # positions now point past the region
    elif change == "past_values":
        region["at"] = (files / VALUES_FILE).stat().st_size
    elif change == "gap_bytes":
        region["pos_bytes"] -= 1  # the last gap is cut short
    elif change == "gap_count":
        region["count"] += 1  # one more gap than the bytes hold
    else:
        index["files"].reverse()
    (files / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DeltaError):
        apply_delta(v1, m1, files, m2, tmp_path / "out")


def test_positions_round_trip_as_gaps_and_hostile_gap_bytes_are_typed_errors() -> None:
    rng = np.random.default_rng(0)
    for positions in (np.zeros(0, np.int64), np.array([0]), np.array([5, 6, 7]), np.array([0, 127, 128, 16511]),
                      np.unique(rng.integers(0, 1 << 40, 500)), np.sort(rng.choice(100_000, 3_000, replace=False))):
        coded = encode_positions(positions)
        assert np.array_equal(decode_positions(coded, len(positions)), positions)
    assert len(encode_positions(np.array([0, 127, 128, 16511]))) == 1 + 1 + 1 + 2  # gaps 0, 127, 1, 16383
    for coded, count in ((b"\x80", 1), (b"\x01\x01", 1), (b"\x01", 2), (b"\x01\x00", 2),  # cut, extra, short, 0 gap
                         (b"\xff" * 9 + b"\x01", 1),  # a gap over 63 bits
                         (b"\xff" * 8 + b"\x7f" + b"\xff" * 8 + b"\x7f", 2)):  # a sum that wraps past 2**64
        with pytest.raises(DeltaError):
            decode_positions(coded, count)


def test_blocks_change_nothing_in_the_format(tmp_path: Path, tiny_state: dict[str, torch.Tensor],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors are compared and positions coded and decoded `BLOCK` at a time; the delta's bytes are the same
    whatever the block, and a delta made with one block size applies with another, bit for bit."""
    v1, v2, m1, m2, files = _one_step(tmp_path, tiny_state)
    whole = (files / INDEX_FILE).read_bytes(), (files / VALUES_FILE).read_bytes()
    for block in (7, 64):
        monkeypatch.setattr(delta, "BLOCK", block)
        out = tmp_path / f"made-{block}"
        delta.make_delta(v1, v2, out, [f.path for f in m2.weight_files])
        assert ((out / INDEX_FILE).read_bytes(), (out / VALUES_FILE).read_bytes()) == whole
        apply_delta(v1, m1, files, m2, tmp_path / f"out-{block}")
        assert (tmp_path / f"out-{block}" / "model.safetensors").read_bytes() == \
            (v2 / "model.safetensors").read_bytes()
    rng = np.random.default_rng(1)
    positions = np.sort(rng.choice(5_000, 700, replace=False))
    coded = encode_positions(positions)
    monkeypatch.setattr(delta, "BLOCK", 5)
    assert encode_positions(positions) == coded
    assert np.array_equal(decode_positions(coded, len(positions)), positions)
    # hostile bytes refused at a block boundary too: a zero gap as the first of the second block, a wrap
    for bad, count in ((encode_positions(np.arange(5)) + b"\x00", 6),
                       (b"\x01" * 5 + b"\xff" * 8 + b"\x7f" + b"\xff" * 8 + b"\x7f", 7)):
        with pytest.raises(DeltaError):
            decode_positions(bad, count)


def test_coding_positions_takes_memory_per_block_not_per_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 62 GB version changes ~1e9 elements: coding them all at once took ~48 bytes each (8 arrays of 8 bytes per
    position or gap byte). Per block, the work is bounded and the coded bytes (~1.2 a position here) dominate."""
    import tracemalloc

    monkeypatch.setattr(delta, "BLOCK", 1 << 14)
    rng = np.random.default_rng(2)
    positions = np.cumsum(rng.integers(1, 200, 1_000_000))  # gaps of one or two bytes, as a bf16 step's
    tracemalloc.start()
    try:
        coded = encode_positions(positions)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(coded) + 64 * delta.BLOCK * 8, (peak, len(coded))  # at once: ~48 MB here
    tracemalloc.start()
    try:
        for _ in delta.iter_positions(coded, len(positions)):
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * delta.BLOCK * 8, peak


def test_a_delta_in_the_first_format_still_applies(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    """`shardcast-delta/1` (absolute 4-byte positions), rewritten from a /2 delta, rebuilds the same weights."""
    v1, v2, m1, m2, files = _one_step(tmp_path, tiny_state)
    index = json.loads((files / INDEX_FILE).read_text())
    values = (files / VALUES_FILE).read_bytes()
    old = bytearray()
    for entry in index["files"]:
        if entry["op"] == "whole":
            entry["at"], old = len(old), old + values[entry["at"]:entry["at"] + entry["size"]]
        for region in entry.get("regions", []):
            at, count, pos_bytes = region["at"], region["count"], region.pop("pos_bytes")
            positions = decode_positions(values[at:at + pos_bytes], count)
            region.update(at=len(old), pos_width=4)
            old += positions.astype("<u4").tobytes() + values[at + pos_bytes:at + pos_bytes + count * region["width"]]
    index["format"] = "shardcast-delta/1"
    (files / INDEX_FILE).write_text(json.dumps(index))
    (files / VALUES_FILE).write_bytes(bytes(old))
    apply_delta(v1, m1, files, m2, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (v2 / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def tiny_fp32() -> dict[str, torch.Tensor]:
    from models.loading import load
    from protocol.model_spec import TinyModelSpec

    return {k: v.detach().float().contiguous() for k, v in load(TinyModelSpec()).model.state_dict().items()}


def _adam_like(state: dict[str, torch.Tensor], seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """Every element moves a little, relative to its size (an fp32 Adam step: nothing rounds to no change)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (v * (1 + scale * torch.randn(v.shape, generator=gen))).contiguous() for k, v in state.items()}


def _fp32_step(tmp: Path, state: dict[str, torch.Tensor]) -> tuple[Path, Path, Manifest, Manifest, Path]:
    v1, v2 = _version(tmp / "v1", state), _version(tmp / "v2", _adam_like(state, seed=1))
    kw: dict[str, object] = {"identity": IDENTITY, "run_id": "r", "shard_size": SHARD, "dtype": "float32"}
    m1 = build_version(v1, tmp / "store" / "versions", version=1, **kw).manifest  # type: ignore[arg-type]
    m2 = build_version(v2, tmp / "store" / "versions", version=2, base=DeltaBase(v1, m1),
                       **kw).manifest  # type: ignore[arg-type]
    return v1, v2, m1, m2, _delta_files(tmp, 2)


def test_an_fp32_step_that_moves_every_weight_travels_as_xor_planes(tmp_path: Path,
                                                                   tiny_fp32: dict[str, torch.Tensor]) -> None:
    """Sparse positions and values would cost more than the full weights when every element changes; the XOR
    planes do not: sign, exponent and high mantissa bits of a small update are zeros, which deflate."""
    v1, v2, m1, m2, files = _fp32_step(tmp_path, tiny_fp32)
    assert m2.delta is not None and m2.dtype == "float32"
    index = json.loads((files / INDEX_FILE).read_text())
    assert index["format"] == "shardcast-delta/3"
    regions = [r for e in index["files"] for r in e.get("regions", [])]
    assert regions and all(r["coding"] == "xor" for r in regions)
    changed = sum(r["count"] for r in regions) / sum((r["stop"] - r["start"]) // 4 for r in regions)
    assert changed > 0.99  # nearly every element moved: positions and values would be 125 %+ of the full bytes
    assert m2.total_bytes < 0.8 * m2.full_bytes, (m2.total_bytes, m2.full_bytes)
    out = tmp_path / "rebuilt"
    apply_delta(v1, m1, files, m2, out)
    assert (out / "model.safetensors").read_bytes() == (v2 / "model.safetensors").read_bytes()


def test_xor_planes_are_independent_of_the_block_and_mixed_with_sparse_regions(
        tmp_path: Path, tiny_fp32: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    state = dict(tiny_fp32)
    moved = _adam_like(state, seed=3)
    names = sorted(state)
    new = {k: (moved[k] if i % 2 else state[k].clone()) for i, k in enumerate(names)}  # half the tensors unchanged
    first = names[0]
    new[first] = state[first].clone()
    new[first].view(-1)[:3] += 1.0  # and one with 3 changed elements: sparse
    v1, v2 = _version(tmp_path / "v1", state), _version(tmp_path / "v2", new)
    made = tmp_path / "made"
    delta.make_delta(v1, v2, made, ["model.safetensors", "config.json"])
    regions = json.loads((made / INDEX_FILE).read_text())["files"][0]["regions"]
    assert {r.get("coding", "sparse") for r in regions} == {"sparse", "xor"}
    monkeypatch.setattr(delta, "BLOCK", 7)
    again = tmp_path / "again"
    delta.make_delta(v1, v2, again, ["model.safetensors", "config.json"])
    for f in (INDEX_FILE, VALUES_FILE):
        assert (again / f).read_bytes() == (made / f).read_bytes()


@pytest.mark.parametrize("change", ["truncated", "trailing", "garbage", "bomb", "count", "coding", "plane"])
def test_hostile_xor_planes_are_typed_errors(tmp_path: Path, tiny_fp32: dict[str, torch.Tensor],
                                             change: str) -> None:
    import zlib

    v1, v2, m1, m2, files = _fp32_step(tmp_path, tiny_fp32)
    index = json.loads((files / INDEX_FILE).read_text())
    values = bytearray((files / VALUES_FILE).read_bytes())
    regions = [r for e in index["files"] for r in e.get("regions", [])]
    region = max(regions, key=lambda r: r["stop"] - r["start"])
    at, size = region["at"], region["xor_bytes"]
    if change == "truncated":
        region["xor_bytes"] -= 7  # the stream's end (and its checksum) cut off
    elif change == "trailing":
        values[at + size:at + size] = b"\x00" * 5  # bytes after the stream, inside the region's length
        region["xor_bytes"] += 5
        for r in regions:
            r["at"] += 5 if r["at"] > at else 0
    elif change == "garbage":
        values[at + size // 2] ^= 0xFF
    elif change == "bomb":  # a stream of zeros ten times the region's bytes: refused where it passes the region
        bomb = zlib.compress(b"\x00" * 10 * (region["stop"] - region["start"]))
        values[at:at + size] = bomb
        for r in regions:
            r["at"] += len(bomb) - size if r["at"] > at else 0
        region["xor_bytes"] = len(bomb)
    elif change == "count":
        region["count"] -= 1
    elif change == "coding":
        region["coding"] = "rot13"
    else:
        region["plane"] = 0
    (files / INDEX_FILE).write_text(json.dumps(index))
    (files / VALUES_FILE).write_bytes(bytes(values))
    with pytest.raises(DeltaError) as raised:
        apply_delta(v1, m1, files, m2, tmp_path / "out")
    if change != "garbage":  # garbage may inflate (its checksum fails at the end) or not: both are refused
        assert not isinstance(raised.value, DeltaMismatchError), raised.value


def test_a_delta_that_would_not_be_smaller_goes_out_as_an_anchor(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    v1 = _version(tmp_path / "v1", tiny_state)
    gen = torch.Generator().manual_seed(1)  # every weight's bits replaced by noise: neither positions nor XOR planes
    v2 = _version(tmp_path / "v2", {k: torch.randint(-2**15, 2**15, v.shape, generator=gen, dtype=torch.int16)
                                    .view(v.dtype) for k, v in tiny_state.items()})  # (even normal noise deflates)
    m1 = _publish(tmp_path, v1, 1).manifest
    m2 = _publish(tmp_path, v2, 2, base=(v1, m1)).manifest
    assert m2.delta is None and m2.total_bytes == m2.full_bytes
    assert not list((tmp_path / "store" / "versions").glob(".delta-*"))  # the scratch delta is gone


def test_manifests_without_dtype_or_delta_sign_as_before(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    v1 = _version(tmp_path / "v1", tiny_state)
    signed = build_version(v1, tmp_path / "store" / "versions", identity=IDENTITY, run_id="r", version=1,
                           shard_size=SHARD)
    raw = json.loads(signed.manifest.canonical_bytes())
    assert "dtype" not in raw and "delta" not in raw  # the bytes a manifest made before the fields was signed over
    assert SignedManifest.parse(signed.to_bytes()).verify(IDENTITY.address).version == 1
