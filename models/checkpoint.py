"""Checkpoints as safetensors in Hugging Face layout, written atomically and checked before loading.

A checkpoint directory holds ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``generation_config.json`` and the tokenizer files: exactly
what ``from_pretrained`` reads, so any Hugging Face tool can open it. ``verify_checkpoint`` parses
every safetensors header and checks the file is as long as the header says: a truncated or
corrupt file raises ``ModelError`` instead of surfacing later as a half-loaded model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from protocol.errors import ModelError

if TYPE_CHECKING:
    from models.loading import LoadedModel

logger = logging.getLogger(__name__)

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


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | os.PathLike[str],
    *,
    max_shard_size: str = "2GB",
) -> Path:
    """Write model, tokenizer and generation config to ``path`` atomically (replacing it)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        verify_checkpoint(tmp)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved checkpoint to %s", dest)
    return dest


def load_checkpoint(
    path: str | os.PathLike[str], *, dtype: str = "float32", device: str = "cpu"
) -> LoadedModel:
    """Load a checkpoint written by ``save_checkpoint`` (or any local HF safetensors directory)."""
    from models.loading import load
    from protocol.model_spec import HFModelSpec

    return load(HFModelSpec(name_or_path=str(Path(path).resolve())), dtype=dtype, device=device)


def main(argv: list[str] | None = None) -> int:
    """`python -m models.checkpoint OUT --model JSON`: write a model spec's weights as a checkpoint directory
    (a policy version to publish through SHARDCAST, e.g. the tiny model a devnet runs)."""
    import argparse
    import sys

    from pydantic import TypeAdapter

    from models.loading import load
    from protocol.errors import PrimeError
    from protocol.model_spec import ModelSpec

    p = argparse.ArgumentParser(prog="python -m models.checkpoint", description=main.__doc__)
    p.add_argument("out", type=Path, help="checkpoint directory to write (replaced atomically)")
    p.add_argument("--model", required=True, help='a model spec as JSON, e.g. \'{"type": "tiny", "hidden_size": 128}\'')
    args = p.parse_args(argv)
    try:
        spec: ModelSpec = TypeAdapter(ModelSpec).validate_json(args.model)
        loaded = load(spec)
        save_checkpoint(loaded.model, loaded.tokenizer, args.out)
    except (PrimeError, ValueError) as exc:
        print(f"models.checkpoint: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {spec.type} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
