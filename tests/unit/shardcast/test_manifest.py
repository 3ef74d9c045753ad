"""Manifest signing, replay guards, parsing of hostile input, and publishing into a store."""

from __future__ import annotations

import json
import random
from pathlib import Path

import blake3
import pytest

from protocol.errors import OversizeError, RelayError, ReplayError, SignatureError
from protocol.identity import Identity
from shardcast.errors import ManifestError, ManifestSignatureError, PublishError, StaleManifestError
from shardcast.manifest import Manifest, ShardEntry, SignedManifest, now_ms, sign_manifest, valid_file_name
from shardcast.publisher import build_version, publish_blocking


def _manifest(run_id: str = "run-a", version: int = 3) -> Manifest:
    data = b"x" * 100
    return Manifest(
        run_id=run_id, version=version, created_at_ms=now_ms(), shard_size=64,
        files=({"path": "w.bin", "size": 100},),  # type: ignore[arg-type]
        shards=(
            ShardEntry(index=0, file=0, offset=0, size=64, hash=blake3.blake3(data[:64]).hexdigest()),
            ShardEntry(index=1, file=0, offset=64, size=36, hash=blake3.blake3(data[64:]).hexdigest()),
        ),
    )


def test_signed_manifest_round_trips_and_verifies() -> None:
    trainer = Identity.create()
    signed = sign_manifest(trainer, _manifest())
    parsed = SignedManifest.parse(signed.to_bytes())
    assert parsed == signed
    assert parsed.verify(trainer.address, run_id="run-a", version=3, min_version=3).version == 3


def test_canonical_encoding_is_sorted_and_compact() -> None:
    raw = _manifest().canonical_bytes()
    assert b" " not in raw and b"\n" not in raw
    decoded = json.loads(raw)
    assert list(decoded) == sorted(decoded)


def test_wrong_key_is_refused_with_typed_error() -> None:
    signed = sign_manifest(Identity.create(), _manifest())
    with pytest.raises(ManifestSignatureError) as info:
        signed.verify(Identity.create().address)
    assert isinstance(info.value, RelayError) and isinstance(info.value, SignatureError)


def test_tampered_manifest_fails_signature() -> None:
    trainer = Identity.create()
    signed = sign_manifest(trainer, _manifest())
    doc = json.loads(signed.to_bytes())
    doc["manifest"]["version"] = 4  # a relay bumps the version to pass an old checkpoint off as new
    with pytest.raises(ManifestSignatureError):
        SignedManifest.parse(json.dumps(doc).encode()).verify(trainer.address)


def test_replay_guards() -> None:
    trainer = Identity.create()
    signed = sign_manifest(trainer, _manifest(run_id="run-a", version=3))
    with pytest.raises(StaleManifestError) as info:
        signed.verify(trainer.address, run_id="run-b")
    assert isinstance(info.value, ReplayError)
    with pytest.raises(StaleManifestError):
        signed.verify(trainer.address, version=4)
    with pytest.raises(StaleManifestError):
        signed.verify(trainer.address, min_version=4)


@pytest.mark.parametrize("payload", [
    b"", b"not json", b"[]", b'{"manifest": {}, "signer": "0x0", "signature": "0x"}',
    b'{"manifest": 1, "signer": 2, "signature": 3, "extra": 4}', b"\xff\xfe" * 10,
])
def test_malformed_manifest_bytes_raise_manifest_error(payload: bytes) -> None:
    with pytest.raises(ManifestError):
        SignedManifest.parse(payload)


def test_oversized_manifest_is_refused_before_parsing() -> None:
    with pytest.raises(ManifestError) as info:
        SignedManifest.parse(b" " * 2000, max_bytes=1000)
    assert isinstance(info.value, OversizeError)


@pytest.mark.parametrize("name", [
    "../etc/passwd", "/etc/passwd", "a/../../b", "..", ".", ".partial/1/x", "a//b", "a\\b", "a/./b", "con\x00", "",
    "manifests/../../x", "a b",
])
def test_unsafe_file_names_are_rejected(name: str) -> None:
    assert not valid_file_name(name)
    doc = json.loads(sign_manifest(Identity.create(), _manifest()).to_bytes())
    doc["manifest"]["files"][0]["path"] = name
    with pytest.raises(ManifestError):
        SignedManifest.parse(json.dumps(doc).encode())


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer/vocab.json", "a-b_c.1", "x/y/z.bin"])
def test_safe_names_pass(name: str) -> None:
    assert valid_file_name(name)


@pytest.mark.parametrize("mutate", [
    lambda d: d["shards"][1].update(offset=60),       # gap/overlap
    lambda d: d["shards"][1].update(index=5),          # wrong index
    lambda d: d["shards"][1].update(file=3),           # missing file
    lambda d: d["files"][0].update(size=101),          # file not covered
    lambda d: d["shards"][0].update(hash="ab" * 31),   # short hash
    lambda d: d.update(hash_alg="md5"),                # unknown hash
    lambda d: d.update(format="shardcast/2"),          # unknown format version
    lambda d: d.update(run_id="../x"),                 # bad run id
])
def test_inconsistent_shard_tables_are_rejected(mutate: object) -> None:
    doc = json.loads(sign_manifest(Identity.create(), _manifest()).to_bytes())
    mutate(doc["manifest"])  # type: ignore[operator]
    with pytest.raises(ManifestError):
        SignedManifest.parse(json.dumps(doc).encode())


def test_build_version_shards_hashes_and_signs(tmp_path: Path) -> None:
    trainer = Identity.create()
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    blobs = {"a.bin": random.Random(1).randbytes(1000), "sub/b.bin": b"hello", "empty.txt": b""}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    versions = tmp_path / "store" / "versions"
    versions.mkdir(parents=True)
    signed = build_version(src, versions, identity=trainer, run_id="run-a", version=7, shard_size=300)
    m = signed.verify(trainer.address, version=7)
    assert [f.path for f in m.files] == ["a.bin", "empty.txt", "sub/b.bin"]
    assert [s.size for s in m.shards] == [300, 300, 300, 100, 5]
    for shard in m.shards:
        data = (versions / "7" / "shards" / str(shard.index)).read_bytes()
        assert blake3.blake3(data).hexdigest() == shard.hash
        assert data == blobs[m.files[shard.file].path][shard.offset: shard.offset + shard.size]
    assert not any(p.name.startswith(".tmp-") for p in versions.iterdir())


def test_publish_blocking_orders_versions_and_refuses_old(tmp_path: Path) -> None:
    trainer = Identity.create()
    (tmp_path / "w.bin").write_bytes(b"abc")
    store = tmp_path / "store"
    assert publish_blocking(tmp_path / "w.bin", store, identity=trainer, run_id="r").manifest.version == 1
    assert publish_blocking(tmp_path / "w.bin", store, identity=trainer, run_id="r", version=5).manifest.version == 5
    with pytest.raises(PublishError):
        publish_blocking(tmp_path / "w.bin", store, identity=trainer, run_id="r", version=4)
    with pytest.raises(PublishError):
        publish_blocking(tmp_path / "missing", store, identity=trainer, run_id="r")


def test_publish_refuses_unsafe_names_and_symlinks(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / ".hidden").write_bytes(b"x")
    with pytest.raises(PublishError):
        publish_blocking(src, tmp_path / "store", identity=Identity.create(), run_id="r")
    (src / ".hidden").unlink()
    (src / "link").symlink_to("/etc/hostname")
    with pytest.raises(PublishError):
        publish_blocking(src, tmp_path / "store", identity=Identity.create(), run_id="r")
