"""The appeal of a hard verdict: what a node sends a second validator, and what that validator answers.

A node slashed by validator A (a `Verdict` envelope with outcome `rejected_hard`, signed by A) files an
appeal on chain (`ComputePool.appeal(workKey)`, inside the appeal window) and sends an `Appeal` to
another validator B: the verdict envelope exactly as A signed it and the node's own submission envelope
exactly as it was sent (its SHA-256 is the verdict's `submission_hash`); for an equivocation verdict also
A's evidence document (both envelopes the key signed for the assignment), which B checks on its own. The `Appeal` itself is sealed
by the node key or its operator's key, with a fresh nonce, so it cannot be replayed. B re-checks the
submission with the same thresholds it applies at intake (an appeal corrects a validator's mistake; it
is never a looser second chance) and answers with an `AppealDecision` it signs, and resolves the
appeal on chain (`resolveAppeal`): overturned returns the slashed stake and restores the work.

Schema only: `validator.appeals` does the checking, `node.appeal` the sending.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from protocol.canonical import Address, Hash32, HexBytes
from protocol.envelope import Body

MAX_INNER_ENVELOPE_CHARS = 8 << 20
"""Upper bound on each envelope carried inside an appeal (the receiver's size cap is usually lower)."""


class Appeal(Body):
    """A node's request that another validator re-check a hard verdict against it."""

    kind = "appeal"
    version = 1

    run_id: str = Field(min_length=1, max_length=128)
    """The training run."""
    node: Address
    """The slashed node's checksummed address."""
    work_key: Hash32
    """The assignment's work key (the key slashed on chain)."""
    verdict: str = Field(min_length=2, max_length=MAX_INNER_ENVELOPE_CHARS)
    """The hard `Verdict` envelope as its validator signed it (canonical JSON text)."""
    submission: str = Field(min_length=2, max_length=MAX_INNER_ENVELOPE_CHARS)
    """The node's `Submission` envelope as it was sent (canonical JSON text; SHA-256 = verdict.submission_hash)."""
    evidence: str | None = Field(default=None, min_length=2, max_length=2 * MAX_INNER_ENVELOPE_CHARS + 65536)
    """For a verdict that rests on more than the submission: the slasher's evidence document as it serves it
    (`GET /v1/evidence/{hash}`; SHA-256 = verdict.evidence_hash). For equivocation it holds both signed
    envelopes, so the re-check needs nothing from the slasher; for near_tie_steering it holds the node's
    near-tie account, judged again at the appeal validator's own honest rate."""


class AppealOutcome(StrEnum):
    """What the re-check concluded."""

    OVERTURNED = "overturned"
    """The submission passes the intake thresholds: the slash is reversed and the work restored."""
    UPHELD = "upheld"
    """It fails them too: the verdict stands and the escrowed stake goes to the treasury."""


class AppealDecision(Body):
    """The re-checking validator's signed answer to one appeal (also kept in its ledger)."""

    kind = "appeal-decision"
    version = 1

    run_id: str = Field(min_length=1, max_length=128)
    work_key: HexBytes
    node: str
    slasher: str
    """The validator whose hard verdict was appealed."""
    original_reason: str = Field(max_length=64)
    """The reason of the appealed verdict."""
    outcome: AppealOutcome
    reason: str = Field(max_length=64)
    """`accepted` when overturned; else the reason the submission still fails (a `Reason` value)."""
    evidence_hash: HexBytes
    """SHA-256 of the stored re-check record (what `resolveAppeal` carries on chain)."""
