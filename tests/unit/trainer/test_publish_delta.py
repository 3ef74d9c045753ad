"""The trainer publishes in the dtype nodes serve and sends versions after an anchor as sparse deltas, while
its own checkpoints keep the fp32 master weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.identity import Identity
from shardcast.delta import apply_delta
from shardcast.manifest import Manifest, SignedManifest
from trainer.config import ShardcastPublish
from trainer.publish import ShardcastPublisher


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    from models.loading import load
    from protocol.model_spec import TinyModelSpec

    return {k: v.detach().float().contiguous() for k, v in load(TinyModelSpec()).model.state_dict().items()}


def _checkpoint(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (directory / "optimizer.pt").write_bytes(b"private")
    return directory


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.where(torch.rand(v.shape, generator=gen) < 0.02, v * 1.5 + 0.01, v).contiguous()
            for k, v in state.items()}


def _manifest(store: Path, version: int) -> SignedManifest:
    return SignedManifest.parse((store / "versions" / str(version) / "manifest.json").read_bytes())


def test_versions_go_out_in_bf16_as_deltas_between_anchors(tmp_path: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    store = tmp_path / "origin"
    publisher = ShardcastPublisher(ShardcastPublish(store=store, key_env="UNUSED", dtype="bfloat16", anchor_every=2,
                                                    retention=5), identity=Identity.create())
    states = [tiny_state]
    for _ in range(3):
        states.append(_step(states[-1], seed=len(states)))
    ckpts = [_checkpoint(tmp_path / f"step-{i}", s) for i, s in enumerate(states)]
    for step, ckpt in enumerate(ckpts):
        publisher.publish(step, ckpt)
    manifests = [_manifest(store, v).manifest for v in range(4)]
    assert [m.dtype for m in manifests] == ["bfloat16"] * 4
    # v0 anchor, v1 delta, v2 anchor (anchor_every = 2), v3 delta
    assert [m.delta is not None for m in manifests] == [False, True, False, True]
    assert manifests[1].total_bytes < 0.1 * manifests[1].full_bytes
    assert publisher.sent_bytes[1] == (manifests[1].total_bytes, manifests[1].full_bytes)
    # the published weights are bf16; the checkpoint keeps fp32
    published = load_file(str(publisher.base_dir / "model.safetensors"))
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert {t.dtype for t in load_file(str(ckpts[3] / "model.safetensors")).values()} == {torch.float32}
    assert not (publisher.base_dir / "optimizer.pt").exists()
    # the v3 delta rebuilds exactly the bf16 weights of step 3 from v2's
    delta_dir = _files_of(store / "versions" / "3", manifests[3], tmp_path / "delta3")
    v2_files = _files_of(store / "versions" / "2", manifests[2], tmp_path / "v2-files")
    apply_delta(v2_files, manifests[2], delta_dir, manifests[3], tmp_path / "rebuilt")
    rebuilt = load_file(str(tmp_path / "rebuilt" / "model.safetensors"))
    assert all(torch.equal(rebuilt[k], states[3][k].to(torch.bfloat16)) for k in rebuilt)


def _files_of(version_dir: Path, manifest: Manifest, out: Path) -> Path:
    """The files a stored version's shards make up, joined in order into `out`."""
    out.mkdir()
    for f_index, entry in enumerate(manifest.files):
        with open(out / entry.path, "wb") as fh:
            for shard in manifest.shards:
                if shard.file == f_index:
                    fh.write((version_dir / "shards" / str(shard.index)).read_bytes())
    return out
