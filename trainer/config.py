"""The trainer's configuration tree. Imports no torch, so `prime-trainer --help` answers at once.

Built on `protocol.config.PrimeConfig`. Sources, later wins: field defaults < TOML file (`--config`) <
environment (`PRIME_<SECTION>__<FIELD>`, e.g. `PRIME_LOSS__EPSILON_HIGH=0.3`) < command-line flags
(`--loss.epsilon-high 0.3`). Union sections (`model`, `data`, `publish`) need their `type` key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from discovery.config import DiscoveryConfig
from protocol.canonical import HexAddress
from protocol.config import PrimeConfig, parse_config
from protocol.config import build_parser as _build_parser
from protocol.model_spec import ModelSpec, TinyModelSpec


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
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after the warm-up: constant, or decayed (linear or cosine) to lr * min_lr_ratio at max_steps."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where a decaying schedule ends, as a fraction of lr."""


class BatchSettings(Section):
    groups_per_step: int = Field(8, ge=1)
    """GRPO groups (prompts) per optimizer step."""
    seq_len: int = Field(512, ge=8)
    """Packed row length in tokens; a sample longer than this is dropped and counted."""
    micro_batch_rows: int = Field(1, ge=1)
    """Packed rows per forward/backward pass (gradient accumulation covers the rest)."""
    async_level: int = Field(1, ge=0)
    """Step n trains only on samples from policy versions >= n - async_level."""
    fill_timeout_s: float | None = Field(None, gt=0.0)
    """A step that has waited this long for its groups trains on the fresh ones it has, if they are at least
    `min_groups_per_step` (a dead or departed node's share is then missing, not waited for). None: wait for
    all `groups_per_step` (up to the data source's `wait_timeout_s`)."""
    min_groups_per_step: int | None = Field(None, ge=1)
    """Fewest groups a step trains on after `fill_timeout_s`; None: `groups_per_step` (no short steps)."""


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


class FeedChain(Section):
    """Where the trainer reads which work the chain shows accepted, and by which validator."""

    deployment: Path
    """deployment.json written by `prime-chain`: the pool's address, chain id and the block its events start at."""
    rpc_url: str = "http://127.0.0.1:8545"
    """JSON-RPC URL of the chain (read only: the feed never sends a transaction)."""


class ValidatorsData(Section):
    """Accepted work pulled from validators' signed feeds (`GET /v1/feed`); see trainer/validator_feed.py."""

    type: Literal["validators"] = "validators"
    urls: list[str] = Field(min_length=1)
    """Base URLs of the validators to pull from (`http://host:port`); each serves `/v1/feed`."""
    addresses: list[HexAddress] = []
    """The validator address expected to sign each url's feed, in the order of `urls` (one per url).
    Give this or `accepted`."""
    accepted: list[HexAddress] = []
    """Alternatively: validator addresses whose signed feed items are accepted from any of the urls."""
    domain: str | None = None
    """Envelope domain of the run (`prime/<chain_id>/<pool>/<run_id>`); or give chain_id, pool and run_id."""
    chain_id: int | None = Field(None, ge=0)
    """Chain id of the run's network (with `pool` and `run_id`, instead of `domain`)."""
    pool: HexAddress | None = None
    """Address of the run's pool contract (with `chain_id` and `run_id`)."""
    run_id: str | None = Field(None, min_length=1, max_length=128)
    """The training run (with `chain_id` and `pool`); feed items of another run are refused."""
    poll_interval_s: float = Field(1.0, gt=0.0)
    """How long to wait between polls while a step waits for groups and no validator had new items."""
    wait_timeout_s: float = Field(600.0, gt=0.0)
    """Give up (error) when a step has waited this long without enough fresh groups."""
    request_timeout_s: float = Field(10.0, gt=0.0)
    """Limit on one feed request, connect to last byte (a validator that is slower counts as unavailable)."""
    page_items: int = Field(64, ge=1, le=1024)
    """Items asked for per request (`limit`); halved for a validator whose page was too large."""
    max_response_bytes: int = Field(64 << 20, ge=1024)
    """Bytes read from one feed response at most; a larger one is refused unparsed."""
    max_item_bytes: int = Field(16 << 20, ge=1024)
    """Size limit of one signed feed item (envelope bytes)."""
    max_item_age_s: float = Field(30 * 86400.0, gt=0.0)
    """Oldest feed item (by its signature time) accepted. Large on purpose: a restarted trainer reads
    hours-old items; the async window, not this, decides what is too old to train on."""
    chain: FeedChain | None = None
    """Train only on work the chain shows recorded by the validator that signed the feed item and not invalidated
    (an item not recorded yet waits for it). Unset: a validator's signature alone is trusted (logged at start)."""

    @model_validator(mode="after")
    def _consistent(self) -> ValidatorsData:
        import re

        for url in self.urls:
            if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", url):
                raise ValueError(f"urls: {url!r} is not an http(s) base URL")
        if len({u.rstrip("/") for u in self.urls}) != len(self.urls):
            raise ValueError("urls: a validator is listed twice")
        if bool(self.addresses) == bool(self.accepted):
            raise ValueError("give exactly one of `addresses` (one per url) or `accepted` (any url)")
        if self.addresses and len(self.addresses) != len(self.urls):
            raise ValueError(f"addresses: {len(self.addresses)} given for {len(self.urls)} urls")
        parts = (self.chain_id, self.pool, self.run_id)
        if self.domain is None and None in parts:
            raise ValueError("give `domain`, or all of `chain_id`, `pool` and `run_id`")
        if self.domain is not None and any(p is not None for p in parts[:2]):
            raise ValueError("give `domain` or `chain_id`/`pool`, not both")
        return self

    def envelope_domain(self) -> str:
        """The domain feed items must be signed for (imports `protocol.rollout`, so not at parse time)."""
        if self.domain is not None:
            return self.domain
        from protocol.rollout import submission_domain

        assert self.chain_id is not None and self.pool is not None and self.run_id is not None
        return submission_domain(self.chain_id, self.pool, self.run_id)


class NoPublish(Section):
    type: Literal["none"] = "none"


class LocalPublish(Section):
    type: Literal["local"] = "local"
    path: Path = Path("published")
    """Directory each finished checkpoint is copied into (`step-<n>/`), off the training thread."""


class PublishChain(Section):
    deployment: Path
    """deployment.json written by `prime-chain` (pool address, chain id)."""
    rpc_url: str = "http://127.0.0.1:8545"
    """JSON-RPC URL of the chain."""


class ShardcastPublish(Section):
    type: Literal["shardcast"] = "shardcast"
    store: Path = Path("origin")
    """Store of a SHARDCAST origin (`prime-relay origin --store DIR` serves it to the relays); each
    checkpoint's weights and config become version <step>, signed by the trainer's key."""
    run_id: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Run id written into every manifest; relays and nodes accept only this run's manifests."""
    keystore: Path | None = None
    """The trainer's encrypted keystore (`prime-keys new`); password from $PRIME_KEYSTORE_PASSWORD or
    `password_file`."""
    password_file: Path | None = None
    """A file holding the keystore password (first line)."""
    key_env: str | None = None
    """Dev chains only: read a raw private key from this environment variable instead of a keystore."""
    shard_mib: int = Field(32, ge=1, le=1024)
    """Shard size in MiB."""
    retention: int = Field(3, ge=1)
    """Versions the store keeps (older ones are removed after each publish; the bases a kept delta needs,
    down to its anchor, stay too)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the weights are published in: the one nodes serve (`bfloat16` for real models; `float32`
    for the tiny model and CPU tests). The trainer's own checkpoints keep the fp32 master weights."""
    anchor_every: int = Field(8, ge=1)
    """A full version (an anchor) at least every this many versions; those between go out as sparse deltas
    against the version before, unless a delta would not be smaller (then an anchor). 1: every version full."""
    initial: bool = False
    """When the run starts fresh (no checkpoint to resume), publish the starting weights as version 0 before
    the first step: nodes and validators work on no version before one is on chain."""
    chain: PublishChain | None = None
    """Record each version on chain (`publishPolicy(step, manifest hash)`, by the same key, which must hold
    TRAINER_ROLE): the chain is what nodes and validators believe. Unset: the store only."""
    announce_urls: list[str] = []
    """Origin/relay URLs named in the policy announcement (discovery)."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    """libp2p discovery (off unless enabled or bootstrapped): announce each version recorded on chain."""


class CheckpointSettings(Section):
    dir: Path = Path("checkpoints")
    """Where checkpoints go (`step-<n>/`, HF safetensors + optimizer + trainer state)."""
    interval: int = Field(1, ge=1)
    """Save every this many steps (and at the end)."""
    keep: int = Field(2, ge=1)
    """Keep this many newest checkpoints."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir` if there is one."""


class WandbSettings(Section):
    """Weights & Biases (the optional `wandb` extra: `pip install -e '.[wandb]'`); on when `project` is set."""

    project: str | None = None
    """W&B project; None (the default) leaves W&B off and `wandb` unimported."""
    entity: str | None = None
    """Team or user the run belongs to; None = the API key's default entity."""
    name: str | None = None
    """Display name of the run; None = W&B's generated name."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,128}$")
    """Run id; give one to continue the same W&B run after a restart (the run is resumed if it exists)."""
    group: str | None = None
    """Group runs together (e.g. an SFT run and the RL run started from it)."""
    tags: list[str] = []
    """Tags of the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online: stream to the server; offline: write the run under `dir` only (no network; `wandb sync` it
    later); disabled: log nothing. None = W&B's default (`WANDB_MODE` if set, else online)."""
    dir: Path | None = None
    """Directory W&B writes its run files into (`<dir>/wandb/`); None = the working directory."""


class EvalSettings(Section):
    """Held-out evaluation during training (trainer/evaluate.py, the same as `prime-trainer eval`)."""

    every: int = Field(0, ge=0)
    """Evaluate every this many steps and after the last step; 0 (the default) = never."""
    env: str | None = None
    """Environment to evaluate on; None = the training environment (`data.env`)."""
    env_version: str | None = None
    """Environment version; None = newest (or `data.env_version` when `env` is None)."""
    seed_start: int = Field(1_000_000, ge=0)
    """First task seed of the held-out range (task seed s is `env.sample(s, 1)[0]`); keep it disjoint from
    the training seeds (SFT environment data is checked)."""
    num_tasks: int = Field(64, ge=1)
    """Tasks scored: seeds seed_start .. seed_start + num_tasks - 1."""
    samples_per_task: int = Field(1, ge=1)
    """Completions per task and temperature."""
    temperatures: list[float] = Field([0.0], min_length=1)
    """One evaluation per temperature: 0 = greedy (keys `eval/greedy/...`), t > 0 = seeded sampling
    (keys `eval/t<t>/...`, e.g. `eval/t1/pass_rate`)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation length limit; None = `data.max_new_tokens` in local mode, else 64."""
    pass_threshold: float = Field(1.0, ge=0.0, le=1.0)
    """A completion passes when its reward is at least this."""
    batch_size: int = Field(32, ge=1)
    """Completions generated together."""
    seed: int = 0
    """Seed of the sampling noise (temperature > 0)."""

    @model_validator(mode="after")
    def _temperatures(self) -> EvalSettings:
        if any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures: each must be >= 0 (0 = greedy)")
        if len({eval_label(t) for t in self.temperatures}) != len(self.temperatures):
            raise ValueError("temperatures: a temperature is listed twice")
        return self


def _base_env(name: str) -> str:
    """The environment a wrapped name draws its tasks from (`reverse-text+length-max` -> `reverse-text`)."""
    return name.split("+", 1)[0]


def eval_label(temperature: float) -> str:
    """The key segment of one evaluation temperature: `greedy` for 0, else `t<t>` (`t1`, `t0.7`)."""
    return "greedy" if temperature == 0 else f"t{temperature:g}"


class TrainLoopConfig(PrimeConfig):
    """What every training run has, GRPO (`TrainerConfig`) or SFT (`SFTConfig`): the model, the optimizer,
    checkpoints, publishing, the device and the metrics (the settings of `trainer.loop.TrainLoop`)."""

    model: ModelSpec = TinyModelSpec()
    """The model to train: type = "tiny" (seed, sizes), "smollm2", or "hf" (name_or_path, revision)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto = float32 on CPU, bfloat16 autocast on GPU (parameters stay float32)."""
    optim: OptimSettings = OptimSettings()
    """The optimizer and learning-rate schedule."""
    publish: Annotated[Union[NoPublish, LocalPublish, ShardcastPublish], Field(discriminator="type")] = NoPublish()  # noqa: UP007, E501
    """Where finished checkpoints are handed for broadcast: none, a local directory, or a SHARDCAST origin store."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    """Checkpointing and resume (GRPO and SFT checkpoints share one layout)."""
    max_steps: int = Field(100, ge=0)
    """Number of optimizer steps to run (total, counting resumed ones; in SFT, epochs follow from the data size)."""
    seed: int = 0
    """Seed of the trainer's RNG (dropout; in SFT also the order of the examples)."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 = torch's default."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device."""
    metrics_file: Path | None = None
    """Append one JSON line of metrics per step here."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on <metrics_host>:<port>."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics server binds to (loopback by default; the host's own address to be scraped from
    elsewhere)."""
    progress: bool = True
    """Print one progress line per step to stderr (reward, samples, staleness, throughput, step time, eval)."""
    tensorboard_dir: Path | None = None
    """Also write every per-step scalar as TensorBoard event files here (`tensorboard --logdir DIR`); None = off."""
    wandb: WandbSettings = WandbSettings()
    """Weights & Biases logging (off unless `wandb.project` is set)."""
    eval: EvalSettings = EvalSettings()
    """Held-out evaluation on a schedule during training (off unless `eval.every` > 0)."""


class TrainerConfig(TrainLoopConfig):
    """`prime-trainer`: asynchronous GRPO on rollouts from a directory, local generation or validators' feeds."""

    loss: LossSettings = LossSettings()
    """The GRPO objective."""
    batch: BatchSettings = BatchSettings()
    """Batching, packing and the async window."""
    data: Annotated[Union[DirectoryData, LocalData, ValidatorsData], Field(discriminator="type")] = DirectoryData()  # noqa: UP007, E501
    """Where rollouts come from: a directory of rollout files, local generation, or validators' feeds."""
    work_ledger: Path | None = None
    """Append one JSON line per step with the work keys it trained or dropped (validators' feeds), the feed
    cursors and the keys still queued: what an audit reconciles with the validators' ledgers."""

    @model_validator(mode="after")
    def _eval_env(self) -> TrainerConfig:
        if self.eval.every and self.eval.env is None and not isinstance(self.data, LocalData):
            raise ValueError(f"eval.env: name the environment to evaluate on (data.type {self.data.type!r} "
                             "has no env to default to)")
        return self


def build_parser() -> object:
    """The argparse-backed CLI source (kept for callers that want the help text)."""
    return _build_parser(TrainerConfig, prog="prime-trainer")


def load_config(argv: list[str] | None = None, toml_path: str | Path | None = None) -> TrainerConfig:
    """Merge defaults < TOML < `PRIME_*` environment < flags and validate; problems raise `ConfigError`."""
    return parse_config(TrainerConfig, [] if argv is None else argv, toml_path=toml_path, prog="prime-trainer")


# ------------------------------------------------------------------------------------------- SFT
class SFTBatchSettings(Section):
    examples_per_step: int = Field(16, ge=1)
    """(prompt, completion) examples per optimizer step."""
    seq_len: int = Field(512, ge=8)
    """Packed row length in tokens; an example longer than this is left out of the data set (logged)."""
    micro_batch_rows: int = Field(1, ge=1)
    """Packed rows per forward/backward pass (gradient accumulation covers the rest)."""


class FileSFTData(Section):
    """Examples from a JSONL or Parquet file: one conversation per line/row, either `messages`
    (a list of {role, content}; the last message, the assistant's, is the completion) or `prompt` +
    `completion` (each a string or a list of messages)."""

    type: Literal["file"] = "file"
    path: Path
    """The JSONL (`.jsonl`, `.json`) or Parquet (`.parquet`) file."""
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """File format; auto = by the file name's suffix."""
    shuffle: bool = True
    """Visit the examples in a fresh seeded order every epoch (else in file order)."""


class EnvironmentSFTData(Section):
    """Examples from an environment that can state its reference answer (reverse-text, arithmetic): task
    seed s is `env.sample(s, 1)[0]`, its completion `env.reference_completion(task)`; a multi-turn environment
    (calc-arith, alphabet-sort, wordle) gives its reference episode, trained on the model's turns only."""

    type: Literal["environment"] = "environment"
    env: str = "reverse-text"
    """Environment name (from `environments/`)."""
    env_version: str | None = None
    """Environment version; None = newest."""
    seed_start: int = Field(0, ge=0)
    """First task seed; keep the range disjoint from evaluation seeds."""
    num_examples: int = Field(1024, ge=1)
    """Task seeds seed_start .. seed_start + num_examples - 1 make the data set."""
    shuffle: bool = True
    """Visit the examples in a fresh seeded order every epoch (else in seed order)."""


class SFTConfig(TrainLoopConfig):
    """`prime-trainer sft`: supervised fine-tuning on (prompt, completion) pairs, loss on completion tokens."""

    optim: OptimSettings = OptimSettings(lr=5e-5)
    """The optimizer and learning-rate schedule (SFT's default learning rate is 5e-5)."""
    batch: SFTBatchSettings = SFTBatchSettings()
    """Examples per step, packing and micro-batching."""
    data: Annotated[Union[FileSFTData, EnvironmentSFTData], Field(discriminator="type")]  # noqa: UP007
    """Where examples come from: a JSONL/Parquet file, or an environment's tasks with their reference answers."""
    output_dir: Path | None = None
    """At the end, the final weights and tokenizer also go here (a plain Hugging Face model directory, replaced
    atomically): what an RL run names as `model.name_or_path`."""

    @model_validator(mode="after")
    def _eval_seeds(self) -> SFTConfig:
        ev, d = self.eval, self.data
        if not ev.every:
            return self
        if ev.env is None and not isinstance(d, EnvironmentSFTData):
            raise ValueError("eval.env: name the environment to evaluate on (file data has no env to default to)")
        if isinstance(d, EnvironmentSFTData) and (ev.env is None or _base_env(ev.env) == _base_env(d.env)):
            lo, hi = max(d.seed_start, ev.seed_start), min(d.seed_start + d.num_examples, ev.seed_start + ev.num_tasks)
            if lo < hi:
                raise ValueError(f"eval.seed_start: held-out seeds [{ev.seed_start}, {ev.seed_start + ev.num_tasks}) "
                                 f"overlap the training seeds [{d.seed_start}, {d.seed_start + d.num_examples})")
        return self


def load_sft_config(argv: list[str] | None = None, toml_path: str | Path | None = None) -> SFTConfig:
    """`prime-trainer sft` flags and TOML, merged like `load_config`."""
    return parse_config(SFTConfig, [] if argv is None else argv, toml_path=toml_path, prog="prime-trainer sft")


# ------------------------------------------------------------------------------------------ eval
class EvalConfig(PrimeConfig):
    """`prime-trainer eval`: score a model on a held-out seed range of an environment."""

    model: ModelSpec = TinyModelSpec()
    """The model to score: type = "tiny", "smollm2", or "hf" (a checkpoint directory: name_or_path)."""
    env: str = "reverse-text"
    """Environment name (from `environments/`)."""
    env_version: str | None = None
    """Environment version; None = newest."""
    seed_start: int = Field(1_000_000, ge=0)
    """First task seed of the held-out range (task seed s is `env.sample(s, 1)[0]`)."""
    num_tasks: int = Field(100, ge=1)
    """Tasks scored: seeds seed_start .. seed_start + num_tasks - 1."""
    samples_per_task: int = Field(1, ge=1)
    """Completions sampled per task (all are averaged)."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature; 0 = greedy."""
    max_new_tokens: int = Field(64, ge=1)
    """Generation length limit."""
    pass_threshold: float = Field(1.0, ge=0.0, le=1.0)
    """A completion passes when its reward is at least this (1.0 = fully correct)."""
    batch_size: int = Field(32, ge=1)
    """Completions generated together."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype for generation."""
    seed: int = 0
    """Seed of the sampling noise (temperature > 0)."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 = torch's default."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Generation device."""
    output: Path | None = None
    """Write the report (summary and per-completion rewards) as JSON here."""
    show: int = Field(3, ge=0)
    """Print this many (prompt, completion, reward) examples."""


def load_eval_config(argv: list[str] | None = None, toml_path: str | Path | None = None) -> EvalConfig:
    """`prime-trainer eval` flags and TOML, merged like `load_config`."""
    return parse_config(EvalConfig, [] if argv is None else argv, toml_path=toml_path, prog="prime-trainer eval")
