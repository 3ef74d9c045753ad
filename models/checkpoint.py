"""Checkpoints as safetensors in Hugging Face layout, written atomically and checked before loading.

A checkpoint directory holds ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``generation_config.json`` and the tokenizer files: exactly
what ``from_pretrained`` reads, so any Hugging Face tool can open it. ``verify_checkpoint``
(``models.safetensors_files``, re-exported here) parses every safetensors header and checks the file
is as long as the header says: a truncated or corrupt file raises ``ModelError`` instead of surfacing
later as a half-loaded model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from models.loading import LoadedModel, load
from models.safetensors_files import verify_checkpoint, verify_safetensors_file
from protocol.model_spec import HFModelSpec

__all__ = ["load_checkpoint", "save_checkpoint", "verify_checkpoint", "verify_safetensors_file"]

logger = logging.getLogger(__name__)


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
    return load(HFModelSpec(name_or_path=str(Path(path).resolve())), dtype=dtype, device=device)


def main(argv: list[str] | None = None) -> int:
    """`python -m models.checkpoint OUT --model JSON`: write a model spec's weights as a checkpoint directory
    (a policy version to publish through SHARDCAST, e.g. the tiny model a devnet runs)."""
    import argparse
    import sys

    from pydantic import TypeAdapter

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
