"""Which work the chain shows accepted, and by which validator: the trainer's gate on feed items.

A validator's signature on a feed item says it accepted the work; the pool's events say whether that
acceptance stands: `WorkRecorded(node, workKey, validator, ...)` names the validator that recorded (and is
answerable for) the key, `WorkInvalidated` removes it (hard or soft), `WorkRestored` (an appeal won)
puts it back. `trainer/validator_feed.py` trains on an item only when its key is recorded by the
validator that signed it and not invalidated since.

Caught up incrementally, as the validator's chain view is (`contracts.events.reread_from`): each `refresh`
is one event read from the last block read (the last `REORG_DEPTH` blocks again), never a re-read from the
deployment block. Events set state (recorder, invalidated or not) in chain order, so reading a block
twice changes nothing. A key is remembered for the life of the process (32 bytes and an address each).
"""

from __future__ import annotations

import logging
from enum import Enum

from contracts.events import reread_from
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
        self._start_block = start_block
        self._next_block = start_block
        self._recorder: dict[bytes, str] = {}
        self._invalidated: set[bytes] = set()
        self.refreshes = 0
        """Event reads done (one per `refresh` that found new blocks)."""

    def refresh(self) -> int:
        """Read the events since the last refresh; returns how many new ones were applied. `ChainError` when
        the chain does not answer (nothing is changed then)."""
        latest = int(self.pool.tx.rpc("block number", lambda: self.pool.w3.eth.block_number))
        cursor = self._next_block
        start = reread_from(cursor, latest, self._start_block)
        if latest < start:
            return 0
        events = self.pool.events(start, latest, names=EVENTS)
        self.refreshes += 1
        for ev in events:
            key = bytes(ev.args["workKey"])
            if ev.name == "WorkRecorded":
                self._recorder[key] = checksum(str(ev.args["validator"]))
            elif ev.name == "WorkInvalidated":
                self._invalidated.add(key)
            else:  # WorkRestored
                self._invalidated.discard(key)
        self._next_block = latest + 1
        new = sum(1 for ev in events if ev.block_number >= cursor)
        if new:
            log.debug("chain: %d work events up to block %d", new, latest)
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
    def block(self) -> int:
        """The last block read (the deployment block less one before the first refresh)."""
        return self._next_block - 1
