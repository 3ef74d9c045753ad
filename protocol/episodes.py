"""The multi-turn wire format: a node's episodes (submission version 2) and a validator's feed (version 3).

In a multi-turn episode the model speaks in turns and a deterministic environment answers between them
(a tool's output, a scripted user). The node sends only what the model produced, per turn: its token ids,
their sampling logprobs, how the turn ended and the TOPLOC proofs of the turn's rows. The environment's
tokens never travel: the validator rebuilds them by replaying the environment on the decoded turns, as it
rebuilds the prompt (docs/protocol/wire-format.md, "Multi-turn episodes"). The node commits to what it saw
with `env_digest` (`environment_digest` of the spans it appended) and says how the episode ended; a faked
tool output or an injected hint then shows up as a digest the replay does not reproduce (`env_mismatch`).

Sampling across turns: every model token of an episode is drawn with the sample's one `sampling_seed` and a
Gumbel step equal to its index among the episode's model tokens (turn 1 takes steps 0..n1-1, turn 2
continues at n1, ...), so no turn can be re-drawn on its own. The environment plays from `env_seed`
(`protocol.seeds.env_seed`, one per task).

Single-turn environments keep `Submission` version 1 and `FeedItem` version 2 (`protocol.rollout`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.canonical import HexBytes
from protocol.envelope import Body
from protocol.errors import ProtocolError
from protocol.rollout import TOKEN_ID, Submission, SubmissionHeader
from protocol.run import MAX_SAMPLES, MAX_TASKS, MAX_TOKENS

MAX_TURNS = 64
"""Most model turns one episode may carry on the wire (an environment's own `max_turns` is lower)."""

Ending = Literal["done", "max_turns", "max_tokens"]
"""How an episode ended: the environment said done; it took the environment's `max_turns` turns; the
run's token budget for the episode ran out first. The validator's replay must agree."""


def episode_ending(done: bool, turns: int, max_turns: int) -> Ending:
    """How an episode of `turns` model turns ended, given whether the environment is done and its `max_turns`
    (node and validator call this one rule: an environment that says done on its last allowed turn ended
    by `max_turns`)."""
    if turns >= max_turns:
        return "max_turns"
    return "done" if done else "max_tokens"


def environment_digest(spans: Sequence[Sequence[int]]) -> bytes:
    """SHA-256 over the environment spans an episode appended, in order: for each span a uint32 big-endian
    count, then each id as uint32 big-endian. An episode with no environment span (one turn) digests `b""`."""
    out = bytearray()
    for span in spans:
        out += len(span).to_bytes(4, "big")
        for t in span:
            if not 0 <= int(t) < 2**32:
                raise ProtocolError(f"token id {t} is not a uint32")
            out += int(t).to_bytes(4, "big")
    return hashlib.sha256(bytes(out)).digest()


class TurnRollout(BaseModel):
    """One model turn: the ids the model sampled, how the turn ended and its proofs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """Generated ids of this turn (the EOS included when `finish_reason` is `eos`)."""
    logprobs: tuple[float, ...] = Field(max_length=MAX_TOKENS)
    """Sampling log-probability of each of them under the behaviour policy."""
    finish_reason: Literal["eos", "length"]
    """`eos`: the turn ends with an EOS token; `length`: the per-turn limit was reached."""
    proofs: tuple[HexBytes, ...] = Field(max_length=MAX_TOKENS)
    """TOPLOC proofs of this turn's rows (258 bytes each), one per 32 of its tokens; chunks restart per turn."""

    @model_validator(mode="after")
    def _lengths(self) -> TurnRollout:
        if len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.tokens)} tokens")
        return self


class EpisodeRollout(BaseModel):
    """One sample of a multi-turn task: the model's turns, a commitment to the environment's side, the end."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: tuple[TurnRollout, ...] = Field(min_length=1, max_length=MAX_TURNS)
    """The model's turns, in order."""
    env_digest: HexBytes = Field(min_length=32, max_length=32)
    """`environment_digest` of the environment spans the node appended after its turns."""
    ended: Ending
    """How the episode ended (`Ending`), as the node's environment said."""
    reward: float
    """The environment's reward for the episode, as the node computed it."""

    @model_validator(mode="after")
    def _size(self) -> EpisodeRollout:
        if self.n_tokens() > MAX_TOKENS:
            raise ValueError(f"{self.n_tokens()} model tokens in one episode (at most {MAX_TOKENS})")
        return self

    def n_tokens(self) -> int:
        """Model tokens of the episode (environment tokens are not work)."""
        return sum(len(t.tokens) for t in self.turns)


class TaskEpisodes(BaseModel):
    """All episodes of one assigned task (one GRPO group)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The task's content digest (`environments.Task.task_id`)."""
    samples: tuple[EpisodeRollout, ...] = Field(min_length=1, max_length=MAX_SAMPLES)
    """Sample i was generated with `sampling_seed(..., task_id, i, counter=...)`; all play `env_seed(..., task_id)`."""


class EpisodeSubmission(SubmissionHeader):
    """A node's signed multi-turn work for one assignment (run, node, policy version, counter).

    The header means what it means in version 1 (`protocol.rollout.Submission`); every turn of every
    episode was generated by `policy_version`'s weights (no weight swap inside an episode)."""

    kind = "submission"
    version = 2

    tasks: tuple[TaskEpisodes, ...] = Field(min_length=1, max_length=MAX_TASKS)
    """One entry per assigned task, in assignment order."""

    def n_samples(self) -> int:
        return sum(len(t.samples) for t in self.tasks)

    def n_tokens(self) -> int:
        """Model tokens of every episode (what work is counted in)."""
        return sum(s.n_tokens() for t in self.tasks for s in t.samples)


AnySubmission = Submission | EpisodeSubmission
"""A submission of either version (single-turn v1, multi-turn v2), as a validator holds it."""


class EpisodeFeedSample(BaseModel):
    """One accepted episode as the trainer consumes it: the sequence the validator rebuilt after the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """Everything after the prompt: model and environment spans interleaved, as the validator rebuilt them."""
    spans: tuple[tuple[int, int], ...] = Field(min_length=1, max_length=MAX_TURNS)
    """(offset, length) in `tokens` of each model span: the only positions trained on."""
    logprobs: tuple[float, ...] = Field(max_length=MAX_TOKENS)
    """The validator's replayed sampling logprobs of the model tokens, span after span (never the node's)."""
    reward: float
    """The episode's reward as the validator recomputed it from the transcript."""

    @model_validator(mode="after")
    def _spans(self) -> EpisodeFeedSample:
        end = 0
        for offset, length in self.spans:
            if length < 1 or offset < end or offset + length > len(self.tokens):
                raise ValueError(f"model span ({offset}, {length}) is empty, overlaps or leaves the tokens")
            end = offset + length
        if self.spans[0][0] != 0:
            raise ValueError("the first model span starts the episode (offset 0)")
        n = sum(length for _, length in self.spans)
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} model tokens")
        return self

    def loss_mask(self) -> tuple[bool, ...]:
        """True exactly at model-span positions of `tokens`."""
        mask = [False] * len(self.tokens)
        for offset, length in self.spans:
            mask[offset:offset + length] = [True] * length
        return tuple(mask)


class EpisodeFeedGroup(BaseModel):
    """All accepted episodes of one task (a GRPO group)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    prompt_tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """The prompt the validator rebuilt from the task (never taken from the node)."""
    samples: tuple[EpisodeFeedSample, ...] = Field(min_length=1, max_length=MAX_SAMPLES)


class EpisodeFeedItem(Body):
    """One accepted multi-turn submission, signed by the validator that accepted it, for a trainer.

    Version 3: as version 2 (`protocol.rollout.FeedItem`), every number is the validator's; each sample is an
    interleaved sequence with its model spans, so the trainer's loss mask has holes at environment spans."""

    kind = "feed-item"
    version = 3

    run_id: str = Field(min_length=1, max_length=128)
    work_key: HexBytes
    node: str
    policy_version: int = Field(ge=0, lt=2**63)
    env: str
    env_version: str
    groups: tuple[EpisodeFeedGroup, ...] = Field(min_length=1, max_length=MAX_TASKS)
