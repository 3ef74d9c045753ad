"""Pool notes: what one validator knows about nodes that every other validator of the run must know too.

Work of (node, version) goes to one validator (rendezvous ranking), so a node's work at different versions lands on
different validators. What decides whether a node may send more (a hard verdict not on chain yet, skipped
assignments) or whether its tokens look steered (its near-tie account) would otherwise stay with the one validator
that saw it, and a node that splits its work across validators would gain by it (issue 35 item 7). Each validator
serves a `PoolNotes` document signed with its key (`GET /v1/peer/notes`); its peers fetch it, check the signer is
the validator they announced, and count it with their own (`validator.poolview`). Money stays on chain: a note
holds a node back for a bounded time, it never slashes or pays anything.

The document is bounded: at most `MAX_NODES` nodes, `MAX_WORK_KEYS` work keys and `MAX_VERSIONS` versions of holes
each, at most `MAX_NOTES_BYTES` on the wire; what the sender left out is counted in `dropped`. See
docs/protocol/verdicts.md, "Pool notes".
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from protocol.canonical import Address, Hash32
from protocol.envelope import Body

MAX_NODES = 1024
"""Nodes one document lists at most (pending hard verdicts first, then holes, then the most near-ties)."""
MAX_WORK_KEYS = 8
"""Work keys of pending hard verdicts listed per node at most (the count is complete)."""
MAX_VERSIONS = 64
"""Versions with holes listed per node at most (the newest)."""
MAX_NOTES_BYTES = 2 << 20
"""A notes envelope longer than this is not read (a full document is about 1.3 MiB)."""
PATH = "/v1/peer/notes"
"""Where a validator serves its signed notes."""


class VersionHoles(BaseModel):
    """Assignments a node skipped at one policy version, as the sender counted them (`counter_holes`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy_version: int = Field(ge=0, lt=2**63)
    holes: int = Field(ge=1, lt=2**63)


class NodeNote(BaseModel):
    """What the sender knows about one node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: Address
    hard_pending: int = Field(0, ge=0, lt=2**63)
    """Hard verdicts of the node decided by the sender and not on chain yet (or reported so recently that the
    slash may not be read back yet)."""
    hard_oldest_ms: int | None = Field(None, ge=0, lt=2**63)
    """When the oldest of them was decided (unix milliseconds, the sender's clock); None when there is none."""
    hard_work_keys: tuple[Hash32, ...] = Field((), max_length=MAX_WORK_KEYS)
    """Work keys of some of them (the oldest first), so a reader can find them on chain later."""
    holes: tuple[VersionHoles, ...] = Field((), max_length=MAX_VERSIONS)
    """Skipped assignments counted by the sender at the versions of its holes window (newest versions kept)."""
    tokens: int = Field(0, ge=0, lt=2**63)
    """Paid tokens of the node's work the sender accepted (its near-tie account)."""
    near_ties: int = Field(0, ge=0, lt=2**63)
    """Of those, tokens where the replay's winner was within the sampling margin and not the node's token."""
    eos_near_ties: int = Field(0, ge=0, lt=2**63)
    """Near-tie disagreements at an end of sequence."""


class PoolNotes(Body):
    """One validator's notes for its peers, signed with its key in the run's domain. A reader keeps the newest
    one per signer: a document signed no later than the last one taken is refused (a replay), unless it is those
    very bytes again (a cached document fetched twice), which changes nothing."""

    kind = "pool-notes"
    version = 1

    current_version: int | None = Field(None, ge=0, lt=2**63)
    """The newest policy version on chain as the sender saw it."""
    nodes: tuple[NodeNote, ...] = Field((), max_length=MAX_NODES)
    dropped: int = Field(0, ge=0, lt=2**63)
    """Nodes the sender had something on and left out (the cap): those with the fewest near-ties and no pending
    hard verdict or hole go first."""
