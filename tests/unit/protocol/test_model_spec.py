"""Model spec: the discriminated union, field names others code against, validation."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import ProtocolError
from protocol.model_spec import (
    HFModelSpec,
    ModelSpec,
    SmolLM2Spec,
    TinyModelSpec,
    model_spec_digest,
    parse_model_spec,
)


def test_tiny_defaults() -> None:
    spec = TinyModelSpec()
    assert spec.model_dump() == {
        "type": "tiny",
        "seed": 0,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "max_position_embeddings": 512,
    }


def test_union_picks_by_type() -> None:
    assert isinstance(parse_model_spec({"type": "smollm2"}), SmolLM2Spec)
    hf = parse_model_spec({"type": "hf", "name_or_path": "org/model", "revision": "abc"})
    assert isinstance(hf, HFModelSpec) and hf.revision == "abc"
    tiny = parse_model_spec({"type": "tiny", "seed": 3})
    assert isinstance(tiny, TinyModelSpec) and tiny.seed == 3


@pytest.mark.parametrize(
    "data",
    [
        {"type": "gpt5"},
        {},
        {"type": "hf"},
        {"type": "hf", "name_or_path": ""},
        {"type": "smollm2", "name_or_path": "x"},
        {"type": "tiny", "num_heads": 3},
        {"type": "tiny", "num_kv_heads": 3},
        {"type": "tiny", "seed": -1},
    ],
)
def test_invalid_specs(data: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        parse_model_spec(data)


def test_nested_in_a_model_and_frozen() -> None:
    class Holder(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: ModelSpec = TinyModelSpec()

    h = Holder.model_validate({"model": {"type": "hf", "name_or_path": "/models/x"}})
    assert isinstance(h.model, HFModelSpec)
    assert Holder().model == TinyModelSpec()
    with pytest.raises(ValidationError):
        h.model.name_or_path = "other"  # type: ignore[misc]


def test_digest_stable_and_distinct() -> None:
    assert model_spec_digest(TinyModelSpec()) == model_spec_digest(TinyModelSpec(seed=0))
    assert model_spec_digest(TinyModelSpec()) != model_spec_digest(TinyModelSpec(seed=1))
    assert model_spec_digest(TinyModelSpec()) == (
        "6f620432e7a7d07d415402c2bbf75f2e3e2faa99d025a85bf4dee80f3a6469a7"
    )
