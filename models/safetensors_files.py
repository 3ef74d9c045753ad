"""Integrity of a Hugging Face safetensors checkpoint directory, checked before anything loads it.

``verify_checkpoint`` parses every safetensors header and checks each file is as long as its header
says: a truncated or corrupt file raises ``ModelError`` instead of surfacing later as a half-loaded
model. Both the writer (``models.checkpoint``) and the loader (``models.loading``) call it, so it sits
below both of them.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from protocol.errors import ModelError

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header


def verify_safetensors_file(path: Path) -> int:
    """Check one safetensors file's header and length; returns the number of tensors."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelError(f"{path}: safetensors header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelError(f"{path}: corrupt safetensors header (not an object)")
    end = 0
    count = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{path}: tensor {name!r} has no valid data_offsets") from exc
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise ModelError(f"{path}: tensor {name!r} has bad data_offsets {info['data_offsets']}")
        end = max(end, stop)
        count += 1
    if 8 + n + end != size:
        raise ModelError(f"{path}: truncated or padded: header says {8 + n + end} bytes, file has {size}")
    return count


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise ``ModelError`` unless ``path`` is a complete Hugging Face safetensors checkpoint."""
    root = Path(path)
    if not root.is_dir():
        raise ModelError(f"checkpoint {root} is not a directory")
    if not (root / "config.json").is_file():
        raise ModelError(f"checkpoint {root} has no config.json")
    try:
        json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"checkpoint {root}: unreadable config.json: {exc}") from exc
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"checkpoint {root}: corrupt shard index: {exc}") from exc
        for shard in shards:
            if not (root / shard).is_file():
                raise ModelError(f"checkpoint {root}: missing shard {shard}")
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"checkpoint {root} has no safetensors weights")
    for shard in shards:
        verify_safetensors_file(root / shard)
