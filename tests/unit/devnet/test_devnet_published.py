"""`prime-devnet status` shows bytes per published version and the delta/full split, read from the origin's store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from devnet.published import published_lines, published_versions
from protocol.identity import Identity
from shardcast.publisher import DeltaBase, publish_blocking


def _ckpt(directory: Path, weights: np.ndarray) -> Path:
    directory.mkdir()
    save_file({"w": weights}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({}))
    return directory


def test_status_lists_anchors_and_deltas_with_their_bytes(tmp_path: Path) -> None:
    trainer = Identity.create()
    store = tmp_path / "origin"
    assert published_lines(published_versions(store)) == ["published: no version in the origin's store yet"]
    w = np.arange(65536, dtype=np.float32)
    v0 = _ckpt(tmp_path / "v0", w)
    w1 = w.copy()
    w1[::100] += 1  # 1% of the weights move
    v1 = _ckpt(tmp_path / "v1", w1)
    first = publish_blocking(v0, store, identity=trainer, run_id="r", version=0, shard_size=1 << 16, dtype="float32")
    second = publish_blocking(v1, store, identity=trainer, run_id="r", version=1, shard_size=1 << 16, dtype="float32",
                              base=DeltaBase(v0, first.manifest))
    rows = published_versions(store)
    assert [(r["version"], r["kind"], r["base"]) for r in rows] == [(0, "anchor", None), (1, "delta", 0)]
    assert rows[1]["bytes"] == second.manifest.total_bytes < rows[1]["full_bytes"] // 10
    lines = published_lines(rows)
    assert lines[-1].startswith("published: 1 of 2 versions as deltas")
