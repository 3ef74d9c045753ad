"""The inference engine interface (`node.engines` builds the engines; each one lives beside it).

Its own module so that an engine module (`node.vllm_engine`) and the factory that imports it lazily
(`node.engines.build_engine`) both depend on the interface without importing each other.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

from protocol.errors import ModelError
from protocol.rollout import Precision
from protocol.run import RunSpec


@dataclass(frozen=True)
class Request:
    """One completion to generate: the prompt and the seed the protocol derived for it."""

    prompt: list[int]
    seed: int
    step_offset: int = 0
    """The sampler step of the first generated token (a multi-turn episode's later turn continues at the count of
    the episode's model tokens so far; `protocol.episodes`)."""


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: Literal["eos", "length"]
    proofs: list[bytes]


class InferenceEngine(abc.ABC):
    """Generate with the protocol's seeded sampler and prove what was generated."""

    step_offsets: bool = False
    """Whether the engine honours `Request.step_offset` (multi-turn episodes need it; one that does not is
    refused for them rather than sampling every turn from step 0)."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer (prompts are rendered and completions decoded with it)."""

    @property
    @abc.abstractmethod
    def precision(self) -> Precision:
        """The dtype this engine actually generates in, as the submission declares it (`precision_of`): the
        validator judges the replay with that precision's tolerances, so it must be what ran, never a choice."""

    @abc.abstractmethod
    def generate(self, requests: list[Request], run: RunSpec) -> list[Completion]:
        """One completion per request, sampled with `run`'s sampler settings and each request's seed."""

    @property
    def context_limit(self) -> int | None:
        """The longest sequence (prompt + completion) this engine can run, or None where it has no limit of its
        own: a completion cut short by the context would end in `length` before `max_new_tokens`, which the
        validator rejects as malformed (a hard verdict), so prompts that do not fit are refused first."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most engines hold nothing outside this process
        """Release what the engine holds outside Python objects (vLLM's engine process)."""


def check_context(requests: list[Request], run: RunSpec, limit: int | None) -> None:
    """Refuse (`ModelError`, nothing generated) a batch with a prompt whose completion of `run.max_new_tokens`
    would not fit in `limit` tokens: the engine would stop it early, and an early `length` is a hard verdict."""
    if limit is None or not requests:
        return
    longest = max(len(r.prompt) for r in requests)
    if longest + run.max_new_tokens > limit:
        raise ModelError(f"a prompt of {longest} tokens + max_new_tokens {run.max_new_tokens} = "
                         f"{longest + run.max_new_tokens} exceeds the engine's context of {limit} tokens: nothing "
                         f"generated (a completion cut short would be rejected); raise `engine.max_model_len` "
                         f"(vLLM) or use a model with a longer context")
