"""The validator's configuration tree. Imports no torch or web server, so `--help` answers at once.

Sources, later wins: field defaults < TOML file (`--config`) < environment (`PRIME_<SECTION>__<FIELD>`,
e.g. `PRIME_CHAIN__RPC_URL`) < command-line flags (`--chain.rpc-url ...`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from discovery.config import DiscoveryConfig
from protocol.canonical import canonical_bytes
from protocol.config import (
    KeySource,
    PrimeConfig,
    StaticWeights,
    WeightSource,
    parse_config,
)
from protocol.model_spec import ModelSpec, TinyModelSpec
from protocol.precision import DEFAULT_PRECISION_TOLERANCES, Tolerances, tolerances_for
from protocol.rollout import Precision
from protocol.run import RunSpec


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ChainSettings(Section):
    deployment: Path | None = None
    """deployment.json written by `prime-chain` (pool address, chain id, start block)."""
    rpc_url: str = "http://127.0.0.1:8545"
    """JSON-RPC URL of the chain the pool lives on."""
    poll_s: float = Field(1.0, gt=0.0)
    """How often new pool events (registrations, slashes, policy versions) are read."""


class CheckSettings(Section):
    reward_tolerance: float = Field(1e-6, ge=0.0)
    """A claimed reward further than this from the recomputed one is a hard `reward_mismatch`."""
    logprob_tolerance: float = Field(0.5, ge=0.0)
    """A claimed sampling logprob further than this from the replayed one is a `logprob_mismatch`
    (the trainer's importance ratios use them, so a node must not invent them)."""
    max_exp_mismatches: int = Field(38, ge=0)
    """TOPLOC: a chunk fails with more exponent mismatches than this (of top-k 128)."""
    max_mant_err_mean: float = Field(10.0, ge=0.0)
    """TOPLOC: a chunk fails when its mean mantissa error is above this."""
    max_mant_err_median: float = Field(8.0, ge=0.0)
    """TOPLOC: a chunk fails when its median mantissa error is above this."""
    sampling_margin_tolerance: float = Field(0.5, ge=0.0)
    """A token counts as a sampling mismatch when the replayed winner beats it by more than this. The run-wide
    ceiling: a submission is judged with its declared precision's `precision_tolerances` row, never looser than
    this (and with exactly this where the table has no row for it)."""
    max_sampling_mismatches: int = Field(0, ge=0)
    """A sample fails with more sampling mismatches than this."""
    eos_tie_drift: float = Field(0.5, ge=0.0)
    """Measured honest drift of replay margins. An EOS the replay ranks first that the node replaced by a
    token within the sampling tolerance (a skipped near-tie EOS) is a hard `termination` failure when its
    margin is above this; at or below it, float noise can explain the flip. The node is paid only up to the
    replay's EOS either way, and the trainer gets the sample as the replay drew it (cut at that EOS). The
    default admits bf16 nodes, whose honest margins against a replay reach ~0.3 (bench/validator.py, bf16;
    0.096 for SmolLM2 in vLLM at pre-flight), so it equals the sampling tolerance;
    a run whose nodes all generate in fp32 (honest margins 0.0, bench/attacks.py) sets 0.01 and then a
    node that skips near-tie EOS tokens is slashed. The run-wide ceiling of `precision_tolerances`."""
    near_tie_honest_rate: float = Field(0.07, gt=0.0, lt=1.0)
    """Honest near-tie disagreements per paid token (the node's token not the replay's winner, within
    `sampling_margin_tolerance`), an upper bound for the precision this run's nodes compute in against this
    validator's replay (`python -m bench.near_ties`). Measured at tolerance 0.5: fp32 nodes 0 (tiny model and
    SmolLM2); bf16 nodes 0.0009 (tiny) and 0.0215 (SmolLM2, 18 in 837 tokens, fp32 replay; 0.030 with a bf16
    replay); the default lies above the 1e-6 upper confidence bound of SmolLM2's (0.068). A run of fp32 nodes
    sets it far lower. A node whose accepted work here holds more near-ties than
    an honest node's could at 1e-6 per honest node per day (the Chernoff tail of `validator.near_tie_rule`) gets
    a hard `near_tie_steering` verdict on its next submission. The run-wide ceiling of `precision_tolerances`."""
    precision_tolerances: dict[Precision, Tolerances] = Field(
        default_factory=lambda: dict(DEFAULT_PRECISION_TOLERANCES))
    """Per compute precision a submission declares (`precision`; one without it is judged as `bf16`): the sampling
    margin, EOS-tie drift and near-tie honest rate its work is judged with, each no looser than the run-wide
    `sampling_margin_tolerance`, `eos_tie_drift` and `near_tie_honest_rate` above (those alone for a precision with
    no row). Measured (`python -m bench.near_ties`, bench/measured/near_ties*.json): fp32 nodes against an fp32
    replay had honest margins 0.0 and 0 near-ties (tiny model 3,513 tokens, SmolLM2 890), so fp32 gets 0.01 /
    0.01 / 0.01: small but not zero, room for a validator on another CPU, and a node that declares fp32 can no
    longer steer the tokens within 0.5 of the winner (43% of the tiny model's). bf16 nodes reached margins ~0.3
    and 18 near-ties in 837 SmolLM2 tokens, so bf16 keeps 0.5 / 0.5 / 0.07; fp16 (not measured) gets bf16's row.
    Work is judged with the looser of its precision's row and the row of this validator's `dtype` (an fp32 node
    against a bf16 prefill drifts like a bf16 node)."""
    batch_tokens: int = Field(8192, ge=64)
    """Padded tokens per validation prefill."""
    batch_submissions: int = Field(8, ge=1)
    """Submissions checked together in one model stage."""
    retries: int = Field(3, ge=0)
    """Times a submission is re-checked after a failure on our side before it is soft-rejected."""
    counter_gap: int = Field(1, ge=0, le=64)
    """Counters in order: with m the smallest counter of a (node, version) this validator holds no work for,
    counter c is taken only if m <= c <= m + counter_gap; beyond it is refused (409
    `counter_out_of_order`, no slash, nothing recorded: the node resends in order). A node that sends in
    order never needs a gap; a small one absorbs reordering without letting a node choose its tasks."""

    def tolerances(self, precision: Precision, replay: Precision = Precision.FP32) -> Tolerances:
        """What work declared in `precision` and replayed in `replay` is judged with
        (`protocol.precision.tolerances_for`)."""
        ceiling = Tolerances(sampling_margin=self.sampling_margin_tolerance, eos_tie_drift=self.eos_tie_drift,
                             near_tie_honest_rate=self.near_tie_honest_rate)
        return tolerances_for(self.precision_tolerances, ceiling, precision, replay)

    def digest(self) -> str:
        """What `run.checks_hash` pins: SHA-256 of every setting here that can change a verdict (all but the
        batch sizes and retries, which change how fast, never what, is decided; a setting added later is
        pinned unless it is named in `_NOT_VERDICTS`)."""
        return "0x" + hashlib.sha256(canonical_bytes(self.model_dump(mode="json", exclude=_NOT_VERDICTS))).hexdigest()


_NOT_VERDICTS = {"batch_tokens", "batch_submissions", "retries"}


class AppealSettings(Section):
    """How this validator re-checks another validator's hard verdict when the node appeals (`POST /v1/appeals`).

    The re-check runs every check again on the node's own copy of the submission with exactly the intake
    thresholds (`checks.*`): an appeal corrects a validator's mistakes (wrong weights, a miscalibrated or
    too strict threshold, a bug), never pays work that intake here would reject. Looser appeal limits
    would be a band a cheat could aim for: slashed, appealed, overturned, paid."""

    enabled: bool = True
    """Answer appeals and resolve them on chain."""
    max_appeal_bytes: int = Field(16 << 20, ge=4096)
    """Appeals larger than this (they carry the whole submission) are refused (413) before parsing."""
    max_concurrent: int = Field(2, ge=1)
    """Appeal uploads read and checked at once, all appellants together (one per appellant); one more is
    answered 503 + Retry-After at once. An appeal must carry the upload header of a key this pool has
    registered (`gate`): its body takes a slot only after that signature is checked."""


class SystemicSettings(Section):
    """The correlation guard (`validator.guard`): when the validator may blame itself for failures. Only
    failures in the drift band can be softened, established nodes (accepted history x stake) pull the
    trigger, and the validator re-checks known-good work before it stops slashing."""

    window_s: float = Field(300.0, gt=0.0)
    """Drift-band failures inside this sliding window (per policy version) are compared; history before
    it weighs; a self-test result stands this long."""
    min_nodes: int = Field(3, ge=2)
    """At least this many distinct established nodes (accepted history before the window) failing in the
    drift band before the validator tests itself."""
    fraction: float = Field(0.5, gt=0.0, le=1.0)
    """...and at least this fraction of the active nodes' weight (fresh keys weigh nothing)."""
    drift_band_factor: float = Field(2.0, ge=1.0)
    """A failure counts as possible honest drift only while each measurement that crosses a threshold
    (TOPLOC chunk statistics, sampling margin, logprob error) is within this multiple of it."""
    history_cap: int = Field(100, ge=1)
    """Accepted submissions counted per node in its weight (so no single history dominates)."""
    stake_cap: float = Field(4.0, ge=1.0)
    """A node's stake counts in its weight in units of the pool minimum, at most this many (so one rich key
    cannot pull the trigger alone)."""
    self_test_submissions: int = Field(3, ge=1)
    """Known-good submissions of the version re-measured by a self-test, drawn at random from established
    nodes outside the failing set; it fails when most of them fail."""


class FloodSettings(Section):
    """Bounds on what submissions may cost this validator before any slash lands (disk, memory, CPU). Each
    refusal comes before the envelope's nonce is used, so a refused node may send the same bytes again later."""

    window_s: float = Field(300.0, gt=0.0)
    """The window of `node_bytes_per_window`."""
    node_bytes_per_window: int = Field(256 << 20, ge=1024)
    """Submission bytes one node may have stored here per window (beyond it: 429 + Retry-After)."""
    node_stored_bytes: int = Field(16 << 30, ge=1024)
    """Submission bytes of one node stored here in all (kept in the ledger, so a restart keeps the count; freed as
    envelopes are pruned once the chain's invalidation window passed). Beyond it: 429 + Retry-After."""
    max_backlog: int = Field(20_000, ge=1)
    """Submissions not yet decided or not yet reported on chain, all nodes together (beyond it: 503 +
    Retry-After), so a flood waits at the senders instead of in this ledger."""
    rate: float = Field(200.0, gt=0.0)
    """Submissions per second from all nodes together (token bucket; beyond it: 503 + Retry-After)."""
    burst: int = Field(400, ge=1)
    """Bucket size of `rate`."""
    max_concurrent: int = Field(16, ge=1)
    """Signed submission uploads read and checked at once, all staked signers together (each holds up to
    `max_submission_bytes` in memory; `gate.slots_per_node` each); one more is answered 503 + Retry-After at
    once, never queued. Only an upload header whose signer is active on chain takes one."""
    hold_slashable: bool = True
    """A node with a hard verdict here that is not on chain yet sends nothing more until it is (its slash
    is coming: 429 + Retry-After), so it cannot keep filling the ledger while the verdict waits out the
    systemic window; with `peers`, a hard verdict pending at a peer (its signed notes, `pool_notes`) holds the
    node here too."""
    max_holes: int = Field(8, ge=0)
    """Skipped assignments (`counter_holes`, counted here once a version leaves the async window) a node may
    have at the last `holes_window` policy versions; with more, its submissions are refused (429
    `too_many_holes` + Retry-After, no row) until enough of those versions are older than the window: what
    skipping costs (docs/protocol/assignment.md, "Skipping")."""
    holes_window: int = Field(16, ge=1)
    """The policy versions over which `max_holes` counts (the current one and the `holes_window - 1` before)."""


class PoolNotesSettings(Section):
    """What this validator tells the run's other validators about nodes, and takes from them (`GET /v1/peer/notes`,
    docs/protocol/verdicts.md, "Pool notes"): hard verdicts not on chain yet, skipped assignments and near-tie
    accounts, so a node that spreads its work across validators gains nothing. Only with `peers` set."""

    enabled: bool = True
    """Fetch the peers' notes and count them here (this validator serves its own either way)."""
    interval_s: float = Field(5.0, gt=0.0)
    """How often each peer's notes are fetched."""
    cache_s: float = Field(2.0, ge=0.0)
    """The served document is rebuilt from the ledger at most this often."""
    max_age_s: float = Field(60.0, gt=0.0)
    """A peer's notes count while their signature is at most this old; a peer that stops answering stops counting
    after it (refused when fetched older than this too)."""
    claim_max_s: float = Field(3600.0, gt=0.0)
    """A peer's pending hard verdict holds a node here at most this long after the peer decided it, and never past
    the chain's invalidation window (after it, the verdict can no longer land on chain)."""
    timeout_s: float = Field(5.0, gt=0.0)
    """Total deadline of one fetch or push (a peer that trickles bytes ends there)."""
    push: bool = True
    """Send our notes to every identified peer (`POST /v1/peer/notes`) as soon as a hard verdict is pending here that
    they were not sent, so the hold reaches them in one round trip, not at their next fetch."""
    push_check_s: float = Field(0.5, gt=0.0)
    """How often the ledger is asked for hard verdicts the peers were not sent yet."""
    crosscheck: bool = True
    """Read the pool's `WorkRecorded` events for assignments a peer recorded that this validator also holds, and
    fetch the peer's envelope (`validator.crosscheck`): a different payload the node signed is an equivocation
    verdict here, with both envelopes as evidence (a node that split one assignment between validators)."""
    crosscheck_s: float = Field(2.0, gt=0.0)
    """How often the pool's new `WorkRecorded` events are read for that."""
    max_nodes: int = Field(1024, ge=1, le=1024)
    """Nodes listed in the served document at most (see `protocol.pool_notes`)."""


class GateSettings(Section):
    """What a connection or an upload may hold before it is known to come from stake (`validator.server`,
    `validator.gate`): a sender without stake can take a few small, short-lived slots at most, never the
    slots of staked nodes (docs/protocol/wire-format.md, "Upload header")."""

    header_timeout_s: float = Field(10.0, gt=0.0)
    """A connection's request line and headers must be in within this of connecting or of its previous answer."""
    keep_alive_s: float = Field(5.0, gt=0.0)
    """An idle keep-alive connection is closed after this."""
    max_header_bytes: int = Field(16 << 10, ge=1024)
    """Request line and headers larger than this are refused (400)."""
    max_connections: int = Field(1024, ge=1)
    """Open connections in all; past it a new one closes the oldest connection still waiting for its headers."""
    max_connections_per_address: int = Field(64, ge=1)
    """Open connections per peer address (behind a reverse proxy: the proxy's; give it its own limits)."""
    read_grace_s: float = Field(5.0, gt=0.0)
    """An upload's body may lag `min_bytes_per_s` by this much at any moment; past it the upload is cut (408)."""
    min_bytes_per_s: int = Field(64 << 10, ge=1)
    """The slowest body an upload may send: by `read_grace_s + n / min_bytes_per_s` seconds after its headers
    it has sent n bytes, else 408. Bounds how long any slot is held."""
    slots_per_node: int = Field(2, ge=1)
    """Submission uploads one signer may have in flight (of `flood.max_concurrent`)."""
    anonymous_slots: int = Field(4, ge=0)
    """Submission uploads without an upload header (older nodes, tools) read at once, all senders together;
    0 refuses them. They never take a staked node's slot."""
    anonymous_slots_per_address: int = Field(1, ge=1)
    """...and per peer address."""
    header_max_age_s: float = Field(120.0, gt=0.0)
    """An upload header older than this is refused (a captured one is worth nothing after it)."""


class ReporterSettings(Section):
    enabled: bool = True
    """Report verdicts on chain (recordWorkBatch, invalidateHard/Soft)."""
    batch: int = Field(32, ge=1)
    """Accepted work keys per recordWorkBatch transaction."""
    interval_s: float = Field(1.0, gt=0.0)
    """How often the outbox is drained."""
    units_per_token: float = Field(1.0, gt=0.0)
    """Work units credited per generated token (rounded up, at least 1 per submission)."""
    retry_backoff_s: float = Field(1.0, gt=0.0)
    """First wait after the RPC failed (the whole outbox) or a row's transaction reverted for a reason that
    may pass (that row only); doubled on each further failure."""
    max_backoff_s: float = Field(300.0, gt=0.0)
    """The longest such wait. With `systemic.window_s` it must stay below the pool's invalidation window and
    unbonding period, or the validator refuses to start (a slash retried that late could never land)."""


class ValidatorConfig(PrimeConfig):
    """prime-validator: checks nodes' signed rollouts, slashes bad work on chain, feeds the trainer."""

    host: str = "127.0.0.1"
    """Address the HTTP API binds to (loopback by default; put a reverse proxy in front for the internet)."""
    port: int = Field(8700, ge=0, lt=65536)
    """HTTP port (0 picks a free one)."""
    state_dir: Path = Path("validator-state")
    """Ledger, evidence, replay guard, nonce counter and weights live here."""
    ledger_dsn: str | None = None
    """PostgreSQL DSN (postgresql://...) for a ledger shared by several validator processes; default SQLite."""
    feed_dir: Path | None = None
    """Write each accepted submission as a Parquet rollout file here (the trainer's `directory` source)."""
    run: RunSpec = RunSpec()
    """The run's rules (served at /v1/info; nodes must follow the same)."""
    model: ModelSpec = TinyModelSpec(hidden_size=128)
    """The run's base model (tokenizer, architecture, and the weights of the base version). The tiny
    default is 128 wide: a TOPLOC chunk needs at least top-k (128) values, so a completion whose last
    chunk holds one token can only be proved when one hidden state has 128 values."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the validation prefill (bf16 is 1000x slower than fp32 on CPUs without AMX: measure
    with bench/validator.py). TOPLOC compares bf16-rounded activations either way."""
    weights: WeightSource = StaticWeights()
    """Where the weights of each policy version come from."""
    chain: ChainSettings = ChainSettings()
    """The pool contract."""
    key: KeySource = KeySource()
    """The validator's signing key (it must hold VALIDATOR_ROLE on the pool)."""
    validators: list[str] = []
    """The announced validator set of the run (rendezvous assignment); empty means this validator only."""
    peers: list[str] = []
    """URLs of the run's other validators. While the validator a node's work is assigned to cannot be
    reached from here, the next one in rendezvous order takes the work (failover)."""
    failover_after_s: float = Field(30.0, gt=0.0)
    """How long a peer must fail every probe before its work is taken over."""
    pool_notes: PoolNotesSettings = PoolNotesSettings()
    """Sharing what this validator knows about nodes with `peers` (holds, holes, near-tie accounts)."""
    public_url: str | None = None
    """URL other roles reach this API at, announced over discovery (default http://host:port, which
    is announced only when both are concrete: not port 0, not 0.0.0.0)."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    """libp2p gossipsub discovery, off unless `enabled` or `bootstrap` is set: announce this validator,
    learn the run's policy versions, validators and relays, serve them at /v1/announcements. The
    explicit URLs above (`peers`, weight relays) work without it."""
    max_submission_bytes: int = Field(4 << 20, ge=1024)
    """Submissions larger than this are refused (413) before their body is read."""
    audit_cache_s: float = Field(30.0, ge=0.0)
    """`GET /v1/audit` with its row listings, asked without the operator's token, is built from a scan of the
    ledger at most this often (requests in between get the same report, its age in `age_s`); scans never run two
    at a time, on a thread of their own. 0: every full audit is fresh (a local devnet, where `prime-devnet audit`
    reconciles a live network with fresh reads). `?rows=false` answers the counts from running tallies, never a
    scan: that is what dashboards poll."""
    audit_token_env: str | None = None
    """Name of an environment variable holding the operator's audit token: `GET /v1/audit` with
    `Authorization: Bearer <token>` always scans afresh (`audit_cache_s` does not apply)."""
    audit_rate_per_address: float = Field(1.0, gt=0.0)
    """Full audits (`GET /v1/audit` with rows) one source address may sustain per second without the operator's
    token (token bucket, `audit_burst_per_address`; excess gets 429 + Retry-After): the report is cached, but
    answering it still costs the event loop that intake shares. `?rows=false` is not limited."""
    audit_burst_per_address: int = Field(10, ge=1)
    """Bucket size of the per-address audit limit."""
    max_age_s: float = Field(600.0, gt=0.0)
    """Envelopes older than this are refused."""
    rate_per_node: float = Field(5.0, gt=0.0)
    """Submissions per second one node may sustain (token bucket; excess gets 429 + Retry-After)."""
    rate_burst: int = Field(20, ge=1)
    """Bucket size of the per-node rate limit."""
    flood: FloodSettings = FloodSettings()
    """Bounds on bytes per node, the global backlog, intake rate and concurrency."""
    gate: GateSettings = GateSettings()
    """Connection and upload limits: what a sender may hold before its stake is checked."""
    checks: CheckSettings = CheckSettings()
    """Verdict thresholds (policy lives here; measurements are logged raw)."""
    systemic: SystemicSettings = SystemicSettings()
    """The correlation guard: when established nodes fail in the drift band and our self-test fails, suspect
    ourselves."""
    appeals: AppealSettings = AppealSettings()
    """Re-checking other validators' hard verdicts that nodes appeal (with the intake thresholds)."""
    reporter: ReporterSettings = ReporterSettings()
    """The chain reporter."""
    threads: int = Field(1, ge=1)
    """torch threads of the model stage."""
    log_json: bool = False
    """Log one JSON object per line."""


    @model_validator(mode="after")
    def _pinned_checks(self) -> ValidatorConfig:
        pinned, mine = self.run.checks_hash, self.checks.digest()
        if pinned is not None and pinned != mine:
            raise ValueError(f"run.checks_hash pins the run's verdict thresholds to {pinned}, and this config's "
                             f"checks.* hash to {mine}: every validator of a run judges (and re-judges appeals) with "
                             f"the same thresholds; use the run's checks, or leave the run")
        return self


def load_config(argv: list[str] | None = None) -> ValidatorConfig:
    return parse_config(ValidatorConfig, argv, prog="prime-validator")
