"""The rules of one training run that node and validator must agree on (schema only, light to import:
a role's config imports it before anything heavy, so `--help` stays fast)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_TASKS = 256
MAX_SAMPLES = 256
MAX_TOKENS = 1 << 16


class RunSpec(BaseModel):
    """The rules of one training run that node and validator must agree on byte for byte."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run_id: str = Field(default="devnet", min_length=1, max_length=128)
    """Name of the training run; part of every seed, work key and envelope domain."""
    env: str = Field(default="reverse-text", min_length=1, max_length=128)
    """Environment name (`environments.get`), including any `+length-...` wrapper."""
    env_version: str = Field(default="1", min_length=1, max_length=64)
    """Environment version: node and validator grade with exactly this code."""
    tasks_per_batch: int = Field(default=2, ge=1, le=MAX_TASKS)
    """Tasks in one assignment (one submission)."""
    samples_per_task: int = Field(default=4, ge=1, le=MAX_SAMPLES)
    """Completions per task (the GRPO group size)."""
    max_new_tokens: int = Field(default=32, ge=1, le=MAX_TOKENS)
    """Generation limit per completion; a completion this long must finish with `length`."""
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    """Sampling temperature of the protocol's seeded Gumbel-max sampler (greedy is not allowed:
    every sample of a group would be identical)."""
    top_k: int = Field(default=0, ge=0)
    """Top-k cut of the sampler; 0 disables it (hard cuts are fragile under bf16 drift)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Top-p cut of the sampler; 1 disables it."""
    max_batches_per_version: int = Field(default=1_000_000, ge=1)
    """Assignment counters run from 0 to this minus one at each policy version."""
    async_level: int = Field(default=2, ge=0, le=1000)
    """Work generated with a policy more than this many versions behind the newest is stale."""
    checks_hash: str | None = Field(default=None, pattern=r"^0x[0-9a-f]{64}$")
    """The hash of the validators' verdict thresholds (`CheckSettings.digest()` of `prime-validator`), pinned:
    a validator whose `checks.*` hash otherwise refuses to start, so every verdict of the run and every appeal
    against one is judged with the same thresholds. None: not pinned (each validator's own)."""
