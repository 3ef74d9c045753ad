"""Turn a ``ModelSpec`` into a loaded causal LM and tokenizer.

Three sources: a Hugging Face id or local directory (the real path), the packaged SmolLM2 GGUF
(converted once to safetensors, see ``models.smollm2``), and a tiny random LLaMA-shaped model
built from a seed. The tiny model's weights come from the same integer hash as the sampler
(``models.sampling.uniforms``), so they are bit-identical on every machine and torch build.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from models.safetensors_files import verify_checkpoint
from models.sampling import uniforms
from models.tiny_tokenizer import build_tiny_tokenizer
from protocol.errors import ModelError
from protocol.model_spec import HFModelSpec, SmolLM2Spec, TinyModelSpec

logger = logging.getLogger(__name__)

ModelSpecType = HFModelSpec | SmolLM2Spec | TinyModelSpec

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TINY_INIT_STD = 0.02
_TINY_SALT = 0x7117_5EED  # keeps the weight stream apart from sampling noise with the same seed


@dataclass
class LoadedModel:
    """A causal LM ready to run, with what the engine and verifiers need to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpecType
    eos_token_ids: tuple[int, ...]
    max_context: int

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(output_head(self.model).weight.shape[0])


def output_head(model: PreTrainedModel) -> torch.nn.Linear:
    """The LM head (hidden -> vocabulary logits) of a causal LM."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    if not isinstance(head, torch.nn.Linear):
        raise ModelError(f"model {type(model).__name__} has no linear LM head")
    return head


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ModelError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")


def tiny_config(spec: TinyModelSpec) -> LlamaConfig:
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,  # transformers 4.x name; 5.x folds it into rope_parameters
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_tiny_model(spec: TinyModelSpec) -> LlamaForCausalLM:
    """The tiny model in fp32 on CPU: norms 1, every other weight uniform with std 0.02."""
    config = tiny_config(spec)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    half_width = TINY_INIT_STD * math.sqrt(3.0)  # uniform on [-a, a] has std a / sqrt(3)
    with torch.no_grad():
        for index, (name, param) in enumerate(sorted(model.named_parameters())):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            u = uniforms(torch.tensor([spec.seed ^ _TINY_SALT]), torch.tensor([index]), param.numel())
            param.copy_(((u[0] * 2.0 - 1.0) * half_width).view_as(param))
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    model.train(False)
    return model


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id]
    sources.append(tokenizer.eos_token_id)
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(i) for i in src)
    return tuple(sorted(ids))


def _looks_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or os.path.exists(name)


def _load_hf(
    name_or_path: str, revision: str | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if _looks_local(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise ModelError(f"model path {path} does not exist")
        verify_checkpoint(path)
        name_or_path = str(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, revision=revision, dtype=dtype, attn_implementation="sdpa"
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelError(f"cannot load model {name_or_path!r}: {exc}") from exc
    return model, tokenizer


def load(
    spec: ModelSpecType, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load the model a spec names, in ``dtype`` ("float32" or "bfloat16") on ``device``."""
    torch_dtype = resolve_dtype(dtype)
    if isinstance(spec, TinyModelSpec):
        model: PreTrainedModel = build_tiny_model(spec)
        tokenizer: PreTrainedTokenizerBase = build_tiny_tokenizer(spec.vocab_size)
    elif isinstance(spec, SmolLM2Spec):
        from models.smollm2 import smollm2_dir

        try:
            path = smollm2_dir()
        except ModelError:
            raise
        except Exception as exc:  # conversion needs gguf/accelerate/disk: name the cause once
            raise ModelError(f"cannot prepare SmolLM2 from the {spec.type} GGUF: {exc}") from exc
        model, tokenizer = _load_hf(str(path), None, torch_dtype)
    elif isinstance(spec, HFModelSpec):
        model, tokenizer = _load_hf(spec.name_or_path, spec.revision, torch_dtype)
    else:
        raise ModelError(f"unknown model spec {spec!r}")
    model = model.to(device=device, dtype=torch_dtype)  # type: ignore[call-arg]
    model.train(False)
    model.requires_grad_(False)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_context <= 0:
        raise ModelError(f"model {spec!r} declares no max_position_embeddings")
    loaded = LoadedModel(model, tokenizer, spec, _eos_ids(model, tokenizer), max_context)
    logger.info(
        "loaded %s: %.1fM params, %s on %s, max context %d, eos %s",
        spec.type,
        sum(p.numel() for p in model.parameters()) / 1e6,
        torch_dtype,
        device,
        max_context,
        loaded.eos_token_ids,
    )
    return loaded
