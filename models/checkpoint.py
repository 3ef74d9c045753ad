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

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from models.loading import LoadedModel, ModelSpecType, load, tiny_config
from models.safetensors_files import verify_checkpoint, verify_safetensors_file
from models.tiny_tokenizer import build_tiny_tokenizer
from protocol.errors import ModelError
from protocol.model_spec import HFModelSpec, SmolLM2Spec, TinyModelSpec

__all__ = ["check_compatible", "load_checkpoint", "save_checkpoint", "verify_checkpoint", "verify_safetensors_file"]

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


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
"""Config fields an initial checkpoint must share with the run's base model: the shapes every role builds."""


def _base_parts(spec: ModelSpecType) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The base model's config and tokenizer, without building its weights (tiny) or loading them (others)."""
    if isinstance(spec, TinyModelSpec):
        return tiny_config(spec), build_tiny_tokenizer(spec.vocab_size)
    if isinstance(spec, SmolLM2Spec):
        from models.smollm2 import smollm2_dir

        name, revision = str(smollm2_dir()), None
    else:
        name, revision = spec.name_or_path, spec.revision
    try:
        return (AutoConfig.from_pretrained(name, revision=revision),
                AutoTokenizer.from_pretrained(name, revision=revision))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the base model {name!r}: {exc}") from exc


def check_compatible(path: str | os.PathLike[str], spec: ModelSpecType) -> None:
    """Raise ``ModelError`` unless ``path`` is a complete checkpoint with the architecture (`ARCHITECTURE_KEYS`)
    and the tokenizer vocabulary of the base model ``spec``: a run may start from it, every role keeping ``spec``
    for its shapes and tokenizer (``prime-devnet up --init``). Reads configs, headers and tokenizers only."""
    root = Path(path)
    if not root.exists():
        raise ModelError(f"checkpoint {root} does not exist")
    verify_checkpoint(root)  # a directory with a config and complete safetensors files
    base_config, base_tokenizer = _base_parts(spec)
    try:
        config = AutoConfig.from_pretrained(root)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"checkpoint {root}: unreadable config.json: {exc}") from exc
    differ = [f"{k} {getattr(config, k, None)!r} (the base model's: {getattr(base_config, k, None)!r})"
              for k in ARCHITECTURE_KEYS if getattr(config, k, None) != getattr(base_config, k, None)]
    if differ:
        raise ModelError(f"checkpoint {root} is not the {spec.type} model's architecture: {'; '.join(differ)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"checkpoint {root} has no usable tokenizer: {exc}") from exc
    ours, theirs = tokenizer.get_vocab(), base_tokenizer.get_vocab()
    if ours != theirs:
        changed = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ModelError(f"checkpoint {root}: its tokenizer's vocabulary ({len(ours)} tokens) is not the {spec.type} "
                         f"model's ({len(theirs)} tokens); first differences {changed}")


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
