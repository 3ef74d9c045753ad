"""The trainer's configuration tree. Imports no torch, so `prime-trainer --help` answers at once.

Sources, later wins: field defaults < TOML file (`--config`) < environment (`PRIME_TRAINER__<section>__<field>`,
e.g. `PRIME_TRAINER__LOSS__EPSILON_HIGH=0.3`) < command-line flags (`--loss.epsilon-high 0.3`).
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import ConfigError
from protocol.model_spec import ModelSpec, TinyModelSpec

ENV_PREFIX = "PRIME_TRAINER__"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LossSettings(Section):
    epsilon_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio is clipped at 1 - epsilon_low for negative advantages."""
    epsilon_high: float = Field(0.28, ge=0.0)
    """Upper clip: the ratio is clipped at 1 + epsilon_high for positive advantages."""
    delta: float = Field(4.0, gt=1.0)
    """Cap on the importance ratio for negative advantages (INTELLECT-2 two-sided clipping)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference (initial) policy; 0 turns the reference model off."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""
    normalization: Literal["token", "sequence"] = "token"
    """token: mean over all loss tokens of the step; sequence: mean over samples of each sample's token mean."""
    std_normalize: bool = False
    """Divide group-centred advantages by the group's standard deviation."""
    filter_zero_advantage: bool = True
    """Drop groups whose samples all have zero advantage (no learning signal)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature the rollouts were generated with (logits are divided by it)."""


class OptimSettings(Section):
    lr: float = Field(1e-5, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient-norm clipping threshold."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up length in steps."""


class BatchSettings(Section):
    groups_per_step: int = Field(8, ge=1)
    """GRPO groups (prompts) per optimizer step."""
    seq_len: int = Field(512, ge=8)
    """Packed row length in tokens; a sample longer than this is dropped and counted."""
    micro_batch_rows: int = Field(1, ge=1)
    """Packed rows per forward/backward pass (gradient accumulation covers the rest)."""
    async_level: int = Field(1, ge=0)
    """Step n trains only on samples from policy versions >= n - async_level."""


class DirectoryData(Section):
    type: Literal["directory"] = "directory"
    path: Path = Path("rollouts")
    """Directory the trainer reads rollout Parquet files from (name order; `*.tmp` ignored)."""
    poll_interval_s: float = Field(0.5, gt=0.0)
    """How often to look for new files while a step waits for samples."""
    wait_timeout_s: float = Field(600.0, gt=0.0)
    """Give up (error) when a step has waited this long without enough fresh samples."""


class LocalData(Section):
    type: Literal["local"] = "local"
    env: str = "reverse-text"
    """Environment name (from `environments/`)."""
    env_version: str | None = None
    """Environment version; None = newest."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt."""
    max_new_tokens: int = Field(32, ge=1)
    """Generation length limit."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature."""
    task_seed: int = 0
    """Seed of the task stream (step n uses tasks derived from task_seed and n)."""


class NoPublish(Section):
    type: Literal["none"] = "none"


class LocalPublish(Section):
    type: Literal["local"] = "local"
    path: Path = Path("published")
    """Directory each finished checkpoint is copied into (`step-<n>/`), off the training thread."""


class CheckpointSettings(Section):
    dir: Path = Path("checkpoints")
    """Where checkpoints go (`step-<n>/`, HF safetensors + optimizer + trainer state)."""
    interval: int = Field(1, ge=1)
    """Save every this many steps (and at the end)."""
    keep: int = Field(2, ge=1)
    """Keep this many newest checkpoints."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir` if there is one."""


class TrainerConfig(Section):
    model: ModelSpec = TinyModelSpec()
    """The policy model: type = "tiny" (seed, sizes), "smollm2", or "hf" (name_or_path, revision)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto = float32 on CPU, bfloat16 autocast on GPU (parameters stay float32)."""
    loss: LossSettings = LossSettings()
    """The GRPO objective."""
    optim: OptimSettings = OptimSettings()
    """The optimizer."""
    batch: BatchSettings = BatchSettings()
    """Batching, packing and the async window."""
    data: Annotated[Union[DirectoryData, LocalData], Field(discriminator="type")] = DirectoryData()  # noqa: UP007
    """Where rollouts come from: a directory of rollout files or local generation."""
    publish: Annotated[Union[NoPublish, LocalPublish], Field(discriminator="type")] = NoPublish()  # noqa: UP007
    """Where finished checkpoints are handed for broadcast."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    """Checkpointing and resume."""
    max_steps: int = Field(100, ge=0)
    """Number of optimizer steps to run (total, counting resumed ones)."""
    seed: int = 0
    """Seed of the trainer's RNG (dropout, etc.)."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 = torch's default."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device."""
    metrics_file: Path | None = None
    """Append one JSON line of metrics per step here."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on 127.0.0.1:<port>."""
    progress: bool = True
    """Print a one-line progress display per step to stderr."""


def _deep_set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{'.'.join(path)}: parent is not a table")
    tree[path[-1]] = value


def _parse_scalar(text: str) -> Any:
    """Flag and env values: JSON when it parses (numbers, booleans, lists), else the raw string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Dotted flag name -> help text, for every scalar field (members of unions included)."""
    out: dict[str, str] = {}
    for name, f in model.model_fields.items():
        ann = f.annotation
        subs: list[type[BaseModel]] = []
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            subs = [ann]
        elif get_origin(ann) in (Union, types.UnionType, Annotated):
            for a in get_args(ann):
                for b in get_args(a) or (a,):
                    if isinstance(b, type) and issubclass(b, BaseModel):
                        subs.append(b)
        if subs:
            for sub in subs:
                for k, v in _leaf_fields(sub, f"{prefix}{name}.").items():
                    out.setdefault(k, v)
        else:
            out[f"{prefix}{name}"] = (f.description or "").replace("%", "%%")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prime-trainer",
        description="Asynchronous GRPO trainer (two-sided clipping, packing, exact resume, non-blocking publish).",
    )
    p.add_argument("--config", type=Path, help="TOML config file (defaults < TOML < PRIME_TRAINER__* env < flags)")
    for dotted, help_text in _leaf_fields(TrainerConfig).items():
        flag = "--" + dotted.replace("_", "-")
        p.add_argument(flag, dest=f"set:{dotted}", metavar="V", help=help_text)
    return p


def load_config(argv: list[str] | None = None, environ: typing.Mapping[str, str] | None = None) -> TrainerConfig:
    """Merge the sources and validate; any problem raises `ConfigError` naming the offending key."""
    args = build_parser().parse_args(argv)
    return resolve_config(args, environ)


def resolve_config(args: argparse.Namespace, environ: typing.Mapping[str, str] | None = None) -> TrainerConfig:
    tree: dict[str, Any] = {}
    if args.config is not None:
        try:
            tree = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{args.config}: {exc}") from exc
    env = os.environ if environ is None else environ
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            _deep_set(tree, [k.lower() for k in key[len(ENV_PREFIX) :].split("__")], _parse_scalar(value))
    for dest, value in vars(args).items():
        if dest.startswith("set:") and value is not None:
            _deep_set(tree, dest[4:].split("."), _parse_scalar(value))
    # A union section given without its `type` keeps the default member's type.
    for section in ("model", "data", "publish"):
        if isinstance(tree.get(section), dict) and "type" not in tree[section]:
            tree[section]["type"] = TrainerConfig.model_fields[section].default.type
    try:
        return TrainerConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc
