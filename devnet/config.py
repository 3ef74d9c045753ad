"""The devnet's configuration tree. Imports no torch, web3 or web server, so `prime-devnet --help` is instant.

Sources, later wins: field defaults < TOML file (`--config devnet.toml`) < environment
(`PRIME_NODES=5`, `PRIME_TRAINER__LR=0.01`) < command-line flags (`--nodes 5`, `--model smollm2`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.config import PrimeConfig, parse_config


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TrainerEval(Section):
    every: int = Field(0, ge=0)
    """Score the policy on held-out tasks every this many steps and after the last one (the trainer's
    `eval.every`; rows `eval/<greedy|t<temperature>>/pass_rate`, `mean_reward`, ... in `trainer/metrics.jsonl`);
    0 = never."""
    seed_start: int = Field(1_000_000, ge=0)
    """First task seed of the held-out range (task seed s is the environment's `sample(s, 1)[0]`; nodes' tasks
    come from hashed seeds, disjoint from it)."""
    num_tasks: int = Field(64, ge=1)
    """Tasks scored: seeds seed_start .. seed_start + num_tasks - 1."""
    samples_per_task: int = Field(1, ge=1)
    """Completions per task and temperature."""
    temperatures: list[float] = Field([0.0], min_length=1)
    """One evaluation per temperature: 0 = greedy, t > 0 = seeded sampling."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation limit of the evaluation; default the run's `max_new_tokens`."""
    seed: int = 0
    """Seed of the evaluation's sampling noise (temperature > 0)."""


class TrainerSettings(Section):
    max_steps: int = Field(1000, ge=1)
    """Trainer steps before the trainer stops (the devnet keeps serving until stopped)."""
    groups_per_step: int | None = Field(None, ge=1)
    """GRPO groups (tasks) per step; each accepted submission brings `run.tasks_per_batch` groups. Default: one
    submission from each node per step (nodes x run.tasks_per_batch)."""
    lr: float | None = Field(None, gt=0.0)
    """Learning rate; default by model (tiny 0.01, smollm2 2e-6)."""
    async_level: int = Field(2, ge=0)
    """Step n trains on work of policy versions n - async_level .. n (also the run's window)."""
    fill_timeout_s: float = Field(20.0, gt=0.0)
    """A step that has waited this long for its groups trains on the fresh ones it has (at least
    `min_groups_per_step`): a node that died or left costs one step this wait, it does not stall training (the
    next steps take as many groups as that one got at once; docs/protocol/README.md)."""
    min_groups_per_step: int | None = Field(None, ge=1)
    """Fewest groups a step trains on after `fill_timeout_s`; default one submission (`run.tasks_per_batch`)."""
    threads: int = Field(1, ge=1)
    """torch threads of the trainer."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The trainer's compute dtype (its `dtype`): auto = float32 on CPU, bfloat16 autocast on GPU; bfloat16 trains
    SmolLM2 about 1.5x faster on a CPU with native bf16 (AVX-512 bf16, AMX), far slower on one without."""
    publish_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype the trainer publishes its weights in (its `publish.dtype`; it keeps fp32 master weights); auto =
    the dtype the nodes serve: bfloat16 with `node_engine = "vllm"`, float32 with the cpu engine. A version
    travels as a delta when that is smaller than the full weights: in float32 every weight Adam moves changes (the
    tiny model at its default learning rate: 92-97% of its elements per step), coded as XOR planes (deltas of 75-79%
    of the full weights); in bfloat16 most small updates round to no change and the rest go as positions and values
    (the tiny model at lr 1e-5: 28-46%)."""
    std_normalize: bool = False
    """Divide group-centred advantages by the group's standard deviation (the trainer's `loss.std_normalize`)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up in steps (the trainer's `optim.warmup_steps`)."""
    eval: TrainerEval = TrainerEval()
    """Held-out evaluation during training (the trainer's `[eval]`, on the run's environment): off unless
    `every` > 0."""


class ChainSettings(Section):
    block_time: float | None = Field(None, gt=0.0)
    """Seconds between blocks (anvil `--block-time`): a chain that behaves like a public one, where a transaction
    waits for its block and the roles' transactors resend what gets dropped. Unset: a block per transaction
    (instant)."""


class RunSettings(Section):
    env: str | None = None
    """Environment; default by model (tiny: `lowercase`, which it visibly learns; smollm2: `reverse-text`)."""
    tasks_per_batch: int = Field(2, ge=1)
    """Tasks in one assignment (one submission)."""
    samples_per_task: int = Field(8, ge=2)
    """Completions per task (the GRPO group size)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation limit per completion; default by model (tiny 12, smollm2 32)."""
    batches_per_version: int | None = Field(None, ge=1)
    """Assignments each node makes per policy version; default ceil(submissions a trainer step needs / nodes):
    the step's demand and no more, so the trainer trains on fresh work instead of a growing backlog of stale
    work (learning per sample then matches local mode). More gives slack when nodes die, at the price of
    staleness and of accepted work the trainer drops as stale; with the default a dead node's share of each step
    is missing: one step trains on the rest after `trainer.fill_timeout_s`, the next ones without that wait."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature of the nodes' seeded sampler (the run's rules, checked by the validators' replay); the
    trainer's `loss.temperature` is the same."""
    run_id: str = Field("devnet", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Name of the run (in every seed, work key, manifest and envelope domain)."""


class DevnetConfig(PrimeConfig):
    """prime-devnet: the whole network on one machine, on 127.0.0.1 or a host per role (DEV ONLY: anvil's
    public keys)."""

    state_dir: Path = Path("devnet-state")
    """Everything lives here: configs, logs, ledgers, checkpoints, the chain's deployment, processes.json."""
    model: Literal["tiny", "smollm2"] = "tiny"
    """tiny: a seeded random model learning `lowercase` in minutes; smollm2: SmolLM2-135M on reverse-text."""
    init: Path | None = None
    """A trained checkpoint the run starts from instead of `model`'s own weights: a Hugging Face safetensors directory
    with its tokenizer (`prime-trainer sft`'s `output_dir`, a trainer's `step-N`) of `model`'s architecture and
    vocabulary (`up` refuses any other). The trainer loads it and publishes it as version 0 through the origin and on
    chain; nodes and validators pull version 0 over the relays like every later version (`weights.base_version =
    -1`), `model` only giving them the architecture and tokenizer. Unset: version 0 is `model` itself, which every
    role builds or loads locally."""
    nodes: int = Field(3, ge=1, le=20)
    """CPU nodes."""
    spare_nodes: int = Field(0, ge=0, le=20)
    """Nodes that join later (`Network.add_node`, bench/churn.py): their accounts are funded and their hosts
    planned at `up`, and nothing of them runs until they join."""
    validators: int = Field(2, ge=1, le=8)
    """Validators (rendezvous assignment between them; each is the other's failover peer)."""
    relays: int = Field(2, ge=1, le=8)
    """SHARDCAST relays below the trainer's origin."""
    trainer: TrainerSettings = TrainerSettings()
    """The trainer."""
    run: RunSettings = RunSettings()
    """The run's rules (served by the validators to the nodes)."""
    chain: ChainSettings = ChainSettings()
    """The dev chain (anvil)."""
    hosts: Literal["loopback", "netns"] = "loopback"
    """loopback: every role on 127.0.0.1, each on a free port. netns (root only, Linux with iproute2): every role
    (chain, origin, each relay, each validator, the trainer, each node) in its own network namespace with its own
    address on a bridge the devnet creates, binding and advertising that address; `down` or Ctrl-C removes
    them (devnet/hosts.py)."""
    subnet: str = "10.77.0.0/24"
    """With `hosts = "netns"`: the private IPv4 subnet of the bridge (its first address is the devnet's own, the
    next ones the roles'); `up` refuses one already in use on this machine."""
    dashboard_port: int = Field(8800, ge=0, lt=65536)
    """Port of the devnet's HTTP server (summary API, dashboard) on 127.0.0.1, and with `hosts = "netns"` also on
    the devnet's own address on the bridge; 0 picks a free one."""
    start_timeout_s: float = Field(180.0, gt=0.0)
    """How long each role may take to answer its health check before `up` gives up (and stops everything)."""
    summary_interval_s: float = Field(5.0, gt=0.0)
    """Seconds between two live summary lines."""
    node_threads: int = Field(1, ge=1)
    """torch threads per node."""
    node_engine: Literal["cpu", "vllm"] = "cpu"
    """The nodes' inference engine: `cpu` (the models/ engine) or `vllm` (run `prime-devnet` from .venv-vllm,
    `make setup-vllm`; one vLLM engine process per node)."""
    restart: bool = False
    """Restart a role whose process dies (a crash, `kill -9`) with the same command and environment, as a
    process manager would (the fault suite, bench/faults.py, uses it); the chain is never restarted (anvil
    keeps its state in memory). Off: the role stays down and is reported."""
    fresh: bool = True
    """Start from an empty state directory (the previous run's is removed); --no-fresh keeps it."""

    def publish_dtype(self) -> Literal["float32", "bfloat16"]:
        """`trainer.publish_dtype` resolved: auto is the dtype the nodes serve (vLLM bfloat16, the cpu engine
        float32)."""
        if self.trainer.publish_dtype != "auto":
            return self.trainer.publish_dtype
        return "bfloat16" if self.node_engine == "vllm" else "float32"


def load_config(argv: list[str] | None = None, *, prog: str = "prime-devnet up") -> DevnetConfig:
    return parse_config(DevnetConfig, argv, prog=prog)
