"""Rollout samples and their on-disk form: one Parquet file holds many samples, one per row.

Schema version 1 (documented in trainer/README.md). Validators write these files (accepted work) and
trainers read them, so the format lives in `protocol`, beside the wire messages:

| column | type | meaning |
|---|---|---|
| tokens | list<int32> | prompt followed by completion token ids |
| loss_mask | list<bool> | True on tokens the policy generated (completion), False on the prompt |
| sampling_logprobs | list<float32> | log-prob of each token under the behaviour policy (0 on the prompt) |
| reward | float64 | the environment's reward for the completion (length penalties included) |
| group_id | string | samples sharing it answer the same prompt (GRPO group) |
| policy_version | int64 | the policy (trainer step) that generated the sample |
| task_id | string | the environment task the prompt came from |
| env_name | string | environment name |
| env_version | string | environment version |

The file carries `prime.rollout.schema=1` in its Parquet key-value metadata.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from protocol.episodes import EpisodeFeedItem, EpisodeFeedSample
from protocol.errors import ProtocolError, UnknownVersionError
from protocol.rollout import FeedItem

SCHEMA_VERSION = "1"
SCHEMA_KEY = b"prime.rollout.schema"

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("sampling_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("env_name", pa.string(), nullable=False),
        pa.field("env_version", pa.string(), nullable=False),
    ],
    metadata={SCHEMA_KEY: SCHEMA_VERSION.encode()},
)


class RolloutError(ProtocolError):
    """A rollout file or sample is malformed (bad schema, inconsistent lengths, non-finite values)."""

    code = "bad_rollout"


@dataclass(frozen=True)
class Sample:
    """One completion with everything the trainer needs from it."""

    tokens: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    sampling_logprobs: tuple[float, ...]
    reward: float
    group_id: str
    policy_version: int
    task_id: str
    env_name: str
    env_version: str

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `RolloutError` unless the sample is internally consistent."""
        n = len(self.tokens)
        if n < 2:
            raise RolloutError("sample has fewer than 2 tokens")
        if len(self.loss_mask) != n or len(self.sampling_logprobs) != n:
            raise RolloutError("tokens, loss_mask and sampling_logprobs differ in length")
        if self.loss_mask[0]:
            raise RolloutError("the first token cannot be a loss token (nothing predicts it)")
        if not any(self.loss_mask):
            raise RolloutError("sample has no loss tokens")
        if self.reward != self.reward or abs(self.reward) == float("inf"):
            raise RolloutError("reward is not finite")
        if any(not (lp <= 0.0) for lp, m in zip(self.sampling_logprobs, self.loss_mask, strict=True) if m):
            raise RolloutError("sampling logprob is positive or NaN")
        if self.policy_version < 0:
            raise RolloutError("negative policy version")
        if vocab_size is not None and any(t < 0 or t >= vocab_size for t in self.tokens):
            raise RolloutError("token id outside the vocabulary")

    @property
    def n_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def write_rollouts(path: str | Path, samples: Sequence[Sample]) -> Path:
    """Write samples to `path` atomically (temporary name, fsync, rename): readers never see half a file."""
    path = Path(path)
    cols = {name: [getattr(s, name) for s in samples] for name in ROLLOUT_SCHEMA.names}
    cols["tokens"] = [list(s.tokens) for s in samples]
    cols["loss_mask"] = [list(s.loss_mask) for s in samples]
    cols["sampling_logprobs"] = [list(s.sampling_logprobs) for s in samples]
    table = pa.table(cols, schema=ROLLOUT_SCHEMA)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_rollouts(path: str | Path, vocab_size: int | None = None) -> list[Sample]:
    """Read and validate one rollout file; any defect raises `RolloutError` (or `UnknownVersionError`)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise RolloutError(f"{path}: unreadable Parquet: {exc}") from exc
    meta = table.schema.metadata or {}
    version = meta.get(SCHEMA_KEY)
    if version is None:
        raise RolloutError(f"{path}: missing {SCHEMA_KEY.decode()} metadata")
    if version.decode() != SCHEMA_VERSION:
        raise UnknownVersionError(f"{path}: rollout schema {version.decode()!r} is not {SCHEMA_VERSION!r}")
    try:
        table = table.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA)
    except (KeyError, pa.ArrowException) as exc:
        raise RolloutError(f"{path}: columns do not match schema {SCHEMA_VERSION}: {exc}") from exc
    rows = table.to_pylist()
    out: list[Sample] = []
    for i, r in enumerate(rows):
        if any(v is None for v in r.values()):
            raise RolloutError(f"{path}: row {i} has nulls")
        s = Sample(
            tokens=tuple(r["tokens"]),
            loss_mask=tuple(r["loss_mask"]),
            sampling_logprobs=tuple(r["sampling_logprobs"]),
            reward=float(r["reward"]),
            group_id=r["group_id"],
            policy_version=int(r["policy_version"]),
            task_id=r["task_id"],
            env_name=r["env_name"],
            env_version=r["env_version"],
        )
        try:
            s.validate(vocab_size)
        except RolloutError as exc:
            raise RolloutError(f"{path}: row {i}: {exc}") from exc
        out.append(s)
    return out


def episode_sample(prompt: Sequence[int], fed: EpisodeFeedSample, **fields: Any) -> Sample:
    """One accepted multi-turn episode as a trainer sample: prompt, then the rebuilt interleaved sequence; the
    loss mask true exactly on the model spans (holes at environment spans), the validator's replayed logprobs
    there and 0 elsewhere. `RolloutError` unless every loss position holds the feed's model token, in order."""
    p = len(prompt)
    mask = [False] * p + list(fed.loss_mask())
    logprobs = [0.0] * (p + len(fed.tokens))
    model_tokens: list[int] = []
    it = iter(fed.logprobs)
    for offset, length in fed.spans:
        model_tokens += fed.tokens[offset:offset + length]
        for k in range(p + offset, p + offset + length):
            logprobs[k] = next(it)
    tokens = tuple(prompt) + tuple(fed.tokens)
    if [t for t, m in zip(tokens, mask, strict=True) if m] != model_tokens:
        raise RolloutError("an episode's loss positions do not hold its model tokens (span offsets are off)")
    return Sample(tokens=tokens, loss_mask=tuple(mask), sampling_logprobs=tuple(logprobs), reward=float(fed.reward),
                  **fields)


def feed_groups(item: FeedItem | EpisodeFeedItem) -> list[list[Sample]]:
    """A validator's accepted submission as trainer samples: one GRPO group per task (the advantage of a
    multi-turn episode is one per episode, over all its model tokens).

    Every number is the validator's: the prompt rebuilt from the task, the completion the node sampled
    (replayed exactly; for an episode, the environment spans rebuilt by the validator's replay), its sampling
    logprobs from the validator's replay and the recomputed reward.
    """
    if isinstance(item, EpisodeFeedItem):
        return [[episode_sample(g.prompt_tokens, s, group_id=f"{item.work_key.hex()[:24]}-{t}",
                                policy_version=item.policy_version, task_id=g.task_id, env_name=item.env,
                                env_version=item.env_version) for s in g.samples]
                for t, g in enumerate(item.groups)]
    groups = []
    for t, g in enumerate(item.groups):
        p = g.prompt_tokens
        groups.append([
            Sample(
                tokens=tuple(p) + tuple(s.tokens),
                loss_mask=(False,) * len(p) + (True,) * len(s.tokens),
                sampling_logprobs=(0.0,) * len(p) + tuple(s.logprobs),
                reward=float(s.reward),
                group_id=f"{item.work_key.hex()[:24]}-{t}",
                policy_version=item.policy_version,
                task_id=g.task_id,
                env_name=item.env,
                env_version=item.env_version,
            )
            for s in g.samples
        ])
    return groups
