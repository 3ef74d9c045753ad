"""The rollout wire format: what a node submits, the rules of the run it follows, and the verdict.

A node's `counter`-th batch at policy version v is `env.sample(task_seed(node, v, counter, ...),
tasks_per_batch)`; sample i of task t is generated with `sampling_seed(node, v, t.task_id, i, counter=...)`;
both, and the work key, also bind the run, the chain and the pool (`protocol.seeds`).
The node seals one `Submission` per batch with its key; the validator that `assigned_validator`
names checks it and answers with a `Verdict` sealed with the validator's key, so a node can prove
what it was told. Both sides read the same `RunSpec` (the validator serves its own at `/v1/info`).

Everything here is schema only (no torch): `models`, `toploc` and `environments` do the work.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from protocol.canonical import Address, Hash32, HexBytes
from protocol.envelope import Body
from protocol.errors import PrimeError, ProtocolError
from protocol.identity import checksum
from protocol.run import MAX_SAMPLES, MAX_TASKS, MAX_TOKENS
from protocol.run import RunSpec as RunSpec  # re-exported: submissions are read against the run's rules

TOKEN_ID = Annotated[int, Field(ge=0, lt=2**31)]


class SampleRollout(BaseModel):
    """One completion: its tokens, how it ended, what the node claims it earned, and its proofs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """Generated token ids (the EOS token included when `finish_reason` is `eos`)."""
    logprobs: tuple[float, ...] = Field(max_length=MAX_TOKENS)
    """Sampling log-probability of each generated token under the behaviour policy."""
    finish_reason: Literal["eos", "length"]
    """`eos`: the last token is an EOS token; `length`: the generation limit was reached."""
    reward: float
    """The environment's reward for the decoded completion, as the node computed it."""
    proofs: tuple[HexBytes, ...] = Field(max_length=MAX_TOKENS)
    """TOPLOC proofs (258 bytes each), one per 32 generated tokens."""

    @model_validator(mode="after")
    def _lengths(self) -> SampleRollout:
        if len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.tokens)} tokens")
        return self


class TaskRollouts(BaseModel):
    """All samples of one assigned task (one GRPO group)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The task's content digest (`environments.Task.task_id`)."""
    samples: tuple[SampleRollout, ...] = Field(min_length=1, max_length=MAX_SAMPLES)
    """Sample i was generated with `sampling_seed(node, version, task_id, i, counter=...)`."""


class Precision(StrEnum):
    """The dtype a node's engine computes in. The validator's sampling tolerances are measured per precision
    (`checks.precision_tolerances`): an fp32 engine's honest margins against the replay are 0.0, a bf16 one's
    reach ~0.3, so the tolerance a node gets is the one its precision needs and no looser."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


UNDECLARED_PRECISION = Precision.BF16
"""What a submission without `precision` (a node from before the field) is judged as: the loosest precision, whose
tolerances are the single ones every node got before, so an old honest node is never judged more strictly."""


class SubmissionHeader(Body):
    """The fields every submission version starts with: which assignment (run, node, policy version, counter), the
    weights that did the work, the environment and the compute precision (no `kind`: a base, not a message of its
    own)."""

    run_id: str = Field(min_length=1, max_length=128)
    """The training run."""
    node: Address
    """The node's checksummed address (must equal the envelope's signer)."""
    policy_version: int = Field(ge=0, lt=2**63)
    """The policy (trainer step) whose weights generated every sample (every turn of an episode)."""
    manifest_hash: Hash32
    """Hash of the signed SHARDCAST manifest of those weights (as recorded on chain)."""
    counter: int = Field(ge=0, lt=2**63)
    """Which assignment of this node at this version."""
    env: str = Field(min_length=1, max_length=128)
    """Environment name."""
    env_version: str = Field(min_length=1, max_length=64)
    """Environment version."""
    precision: Precision | None = None
    """The dtype the node's engine generated in (`fp32`, `bf16`, `fp16`; anything else is refused). Absent in the
    signed body of a node from before the field (never sent as null: one body, one encoding), and then judged as
    `UNDECLARED_PRECISION`."""

    @model_serializer(mode="wrap")
    def _omit_undeclared(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # an undeclared precision is no key at all, so an old node's signed body stays canonical
        out: dict[str, object] = handler(self)
        if out.get("precision", "") is None:
            del out["precision"]
        return out

    @property
    def declared_precision(self) -> Precision:
        """The precision this submission is judged as (`UNDECLARED_PRECISION` when it names none)."""
        return UNDECLARED_PRECISION if self.precision is None else self.precision


class Submission(SubmissionHeader):
    """A node's signed work for one assignment (run, node, policy version, counter)."""

    kind = "submission"
    version = 1

    tasks: tuple[TaskRollouts, ...] = Field(min_length=1, max_length=MAX_TASKS)
    """One entry per assigned task, in assignment order."""

    def n_samples(self) -> int:
        return sum(len(t.samples) for t in self.tasks)

    def n_tokens(self) -> int:
        return sum(len(s.tokens) for t in self.tasks for s in t.samples)


class Outcome(StrEnum):
    """What a validator decided about one assignment."""

    ACCEPTED = "accepted"
    REJECTED_HARD = "rejected_hard"
    """Cheating or broken work: slashed on chain with an evidence hash."""
    REJECTED_SOFT = "rejected_soft"
    """Not paid, never slashed: stale, not ours to check, or our own failure."""


class Reason(StrEnum):
    """Why: a stable name (in the API and the ledger) and a uint16 code (on chain)."""

    ACCEPTED = "accepted"
    # soft: not the node's fault, or not provably so
    STALE_VERSION = "stale_version"
    FUTURE_VERSION = "future_version"
    NOT_ASSIGNED_HERE = "not_assigned_here"
    NODE_INACTIVE = "node_inactive"
    VALIDATOR_ERROR = "validator_error"
    UNGRADABLE = "ungradable"
    WEIGHTS_UNAVAILABLE = "weights_unavailable"
    SUSPECTED_SYSTEMIC = "suspected_systemic"
    # hard: the node signed something that is provably wrong
    WRONG_RUN = "wrong_run"
    WRONG_MANIFEST = "wrong_manifest"
    COUNTER_OUT_OF_RANGE = "counter_out_of_range"
    WRONG_TASK = "wrong_task"
    SCHEMA = "schema"
    EQUIVOCATION = "equivocation"
    REWARD_MISMATCH = "reward_mismatch"
    PROOF_MISMATCH = "proof_mismatch"
    SAMPLING_MISMATCH = "sampling_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
    TERMINATION = "termination"
    # a multi-turn episode's environment digest, turn count or ending is not the validator's replay of the
    # environment on the node's own turns (a faked tool output, an injected hint, a turn after the end)
    ENV_MISMATCH = "env_mismatch"
    # the node's account of accepted work holds more near-tie disagreements (its token not the replay's winner,
    # within the sampling tolerance) than honest float drift gives at 1e-6 per honest node per day: it chooses
    # among near-ties (validator.near_tie_rule)
    NEAR_TIE_STEERING = "near_tie_steering"

    @property
    def code(self) -> int:
        """The uint16 reason code recorded on chain."""
        return _CODES[self]

    @property
    def hard(self) -> bool:
        return self in _HARD


_CODES: dict[Reason, int] = {r: i for i, r in enumerate(Reason)}
_HARD = frozenset(list(Reason)[list(Reason).index(Reason.WRONG_RUN):])


class Verdict(Body):
    """A validator's signed answer about one assignment; what a node shows in an appeal."""

    kind = "verdict"
    version = 1

    run_id: str = Field(min_length=1, max_length=128)
    work_key: HexBytes
    """`protocol.seeds.work_key(run, node, version, counter, chain_id=..., pool=...)`."""
    node: str
    policy_version: int = Field(ge=0, lt=2**63)
    counter: int = Field(ge=0, lt=2**63)
    submission_hash: HexBytes
    """SHA-256 of the submission envelope's canonical bytes this verdict is about."""
    outcome: Outcome
    reason: Reason
    evidence_hash: HexBytes | None = None
    """For a hard verdict: SHA-256 of the stored evidence (what goes on chain)."""


class Receipt(Body):
    """A validator's signed word that it holds one submission envelope (every 200 or 202 answer to a POST carries
    one). A node counts work as delivered only with it: an answer without it, or signed by another key, or about
    other bytes, is no delivery, and the work is resent (docs/protocol/wire-format.md, "Receipts"). It cannot be
    moved to other work: it names the exact envelope (whose random nonce makes it unique) by its hash, and the
    envelope's domain binds chain, pool and run."""

    kind = "receipt"
    version = 1

    run_id: str = Field(min_length=1, max_length=128)
    work_key: HexBytes
    """`protocol.seeds.work_key` of the assignment the envelope is for."""
    node: Address
    policy_version: int = Field(ge=0, lt=2**63)
    counter: int = Field(ge=0, lt=2**63)
    submission_hash: Hash32
    """SHA-256 of the envelope bytes this answer is about (the bytes of the request it answers)."""
    state: Literal["received", "decided"]
    """`received`: held, to be checked (a verdict follows); `decided`: its verdict is in the same answer."""


def submission_hash(envelope_bytes: bytes) -> bytes:
    """The identity of one submission envelope (its canonical bytes are its only encoding)."""
    return hashlib.sha256(envelope_bytes).digest()


def submission_domain(chain_id: int, pool: str, run_id: str) -> str:
    """The envelope domain of a run's submissions and verdicts: one network, one pool, one run."""
    return f"prime/{chain_id}/{checksum(pool)}/{run_id}"


def submission_venue(domain: str) -> tuple[int, str]:
    """(chain id, pool) of a `submission_domain` string: what a role holding only its domain passes to
    `protocol.seeds` (work keys and seeds bind chain and pool). `ProtocolError` if it is not one."""
    parts = domain.split("/", 3)
    try:
        if len(parts) != 4 or parts[0] != "prime" or not parts[1].isdigit():
            raise ValueError(domain)
        chain_id, pool = int(parts[1]), checksum(parts[2])
    except (ValueError, PrimeError):
        raise ProtocolError(f"{domain[:200]!r} is not a submission domain (prime/<chain id>/<pool>/<run>)") from None
    if submission_domain(chain_id, pool, parts[3]) != domain:
        raise ProtocolError(f"{domain[:200]!r} is not in canonical form")
    return chain_id, pool


class FeedSample(BaseModel):
    """One accepted completion as the trainer consumes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """Completion token ids."""
    logprobs: tuple[float, ...] = Field(max_length=MAX_TOKENS)
    """Sampling logprob of each completion token, from the validator's own replay (never the node's claim)."""
    reward: float
    """The reward the validator recomputed."""


class FeedGroup(BaseModel):
    """All accepted samples of one task (a GRPO group)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    prompt_tokens: tuple[TOKEN_ID, ...] = Field(min_length=1, max_length=MAX_TOKENS)
    """The prompt the validator rebuilt from the task (never taken from the node)."""
    samples: tuple[FeedSample, ...] = Field(min_length=1, max_length=MAX_SAMPLES)


class FeedItem(Body):
    """One accepted submission, signed by the validator that accepted it, for a trainer to train on.

    Version 2: every number in it is the validator's (tokens replayed exactly, rewards recomputed, sampling
    logprobs from its replay). Version 1 carried the node's claimed logprobs; a trainer no longer opens it."""

    kind = "feed-item"
    version = 2

    run_id: str = Field(min_length=1, max_length=128)
    work_key: HexBytes
    node: str
    policy_version: int = Field(ge=0, lt=2**63)
    env: str
    env_version: str
    groups: tuple[FeedGroup, ...] = Field(min_length=1, max_length=MAX_TASKS)


class FeedEntry(BaseModel):
    """One line of a feed listing: the position a validator gave an item, and which item it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=1, lt=2**63)
    """The item's position in this validator's feed (a trainer's cursor is a seq)."""
    work_key: HexBytes
    """The work the item is about (as listed and as signed inside the item)."""
    item_hash: HexBytes
    """SHA-256 of the listed `FeedItem` envelope's bytes."""


class FeedPage(Body):
    """A validator's signature over one page of its trainer feed (`GET /v1/feed?after=`): which items sit at
    which positions after `after`. A trainer moves its cursor only to positions a page it verified lists,
    so whoever answers in the validator's place (a proxy, a forged or replayed listing) cannot push the
    cursor past real work; it can only withhold pages, which the trainer sees as an unreachable feed."""

    kind = "feed-page"
    version = 1

    after: int = Field(ge=0, lt=2**63)
    """The cursor the page answers (a page is valid only for the request it answers)."""
    entries: tuple[FeedEntry, ...] = Field(max_length=1024)
    """The listed items in increasing `seq`."""


def feed_item_hash(envelope_bytes: bytes) -> bytes:
    """The identity of a listed feed item: SHA-256 of its envelope's canonical bytes."""
    return hashlib.sha256(envelope_bytes).digest()
