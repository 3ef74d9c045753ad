"""Which work the chain shows accepted, and by which validator: the trainer's gate on feed items.

A validator's signature on a feed item says it accepted the work; the pool's events say whether that
acceptance stands: `WorkRecorded(node, workKey, validator, ...)` names the validator that recorded (and is
answerable for) the key, `WorkInvalidated` removes it (hard or soft), `WorkRestored` (an appeal won)
puts it back. `trainer/validator_feed.py` trains on an item only when its key is recorded by the
validator that signed it and not invalidated since.

Caught up incrementally (`contracts.events.EventCursor`): each `refresh`
is one event read from the last block read (the last `REORG_DEPTH` blocks again), never a re-read from the
deployment block. Events set state (recorder, invalidated or not) in chain order, so reading a block
twice changes nothing. A key is remembered for the life of the process (32 bytes and an address each).
"""

from __future__ import annotations

import logging
from enum import Enum

from contracts.pool import PoolClient
from protocol.identity import checksum

log = logging.getLogger(__name__)

EVENTS = {"WorkRecorded", "WorkInvalidated", "WorkRestored"}


class OnChain(Enum):
    """What the chain shows for a (work key, signing validator), as of the last refresh."""

    ACCEPTED = "accepted"
    """Recorded by this validator and not invalidated."""
    UNKNOWN = "unknown"
    """Not recorded (yet): validators record in batches, so the item waits."""
    OTHER_VALIDATOR = "other_validator"
    """Recorded by another validator: the signer vouches for work it did not record."""
    INVALIDATED = "invalidated"
    """Recorded, then invalidated (hard or soft) and not restored."""


class RecordedWork:
    """Work keys the pool shows recorded, their recorders and invalidations (see the module docstring)."""

    def __init__(self, pool: PoolClient, start_block: int) -> None:
        self.pool = pool
        self._events = pool.cursor(start_block, EVENTS)
        self._recorder: dict[bytes, str] = {}
        self._invalidated: set[bytes] = set()

    def refresh(self) -> int:
        """Read the events since the last refresh; returns how many new ones were applied. `ChainError` when
        the chain does not answer (nothing is changed then)."""
        cursor = self._events.block + 1
        events = self._events.read()
        for ev in events:
            key = bytes(ev.args["workKey"])
            if ev.name == "WorkRecorded":
                self._recorder[key] = checksum(str(ev.args["validator"]))
            elif ev.name == "WorkInvalidated":
                self._invalidated.add(key)
            else:  # WorkRestored
                self._invalidated.discard(key)
        new = sum(1 for ev in events if ev.block_number >= cursor)
        if new:
            log.debug("chain: %d work events up to block %d", new, self._events.block)
        return new

    def status(self, work_key: bytes, validator: str) -> OnChain:
        """What the chain showed at the last refresh for `work_key` signed by `validator`."""
        recorder = self._recorder.get(work_key)
        if recorder is None:
            return OnChain.INVALIDATED if work_key in self._invalidated else OnChain.UNKNOWN
        if work_key in self._invalidated:
            return OnChain.INVALIDATED
        return OnChain.ACCEPTED if recorder == checksum(validator) else OnChain.OTHER_VALIDATOR

    @property
    def refreshes(self) -> int:
        """Event reads done (one per `refresh` that found blocks to read)."""
        return self._events.reads

    @property
    def block(self) -> int:
        """The last block read (the deployment block less one before the first refresh)."""
        return self._events.block
