"""The inference engine interface (`node.engines` builds the engines; each one lives beside it).

Its own module so that an engine module (`node.vllm_engine`) and the factory that imports it lazily
(`node.engines.build_engine`) both depend on the interface without importing each other.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

from protocol.run import RunSpec


@dataclass(frozen=True)
class Request:
    """One completion to generate: the prompt and the seed the protocol derived for it."""

    prompt: list[int]
    seed: int


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: Literal["eos", "length"]
    proofs: list[bytes]


class InferenceEngine(abc.ABC):
    """Generate with the protocol's seeded sampler and prove what was generated."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer (prompts are rendered and completions decoded with it)."""

    @abc.abstractmethod
    def generate(self, requests: list[Request], run: RunSpec) -> list[Completion]:
        """One completion per request, sampled with `run`'s sampler settings and each request's seed."""

    def close(self) -> None:  # noqa: B027 - optional: most engines hold nothing outside this process
        """Release what the engine holds outside Python objects (vLLM's engine process)."""
