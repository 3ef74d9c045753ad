"""Reading a contract's events from a block onward, decoded by its ABI, in chain order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eth_abi.exceptions import DecodingError
from eth_utils.abi import event_abi_to_log_topic
from hexbytes import HexBytes
from web3._utils.events import get_event_data
from web3.exceptions import Web3Exception

from contracts.transactor import Transactor
from protocol.errors import ChainError

REORG_DEPTH = 12
"""Blocks an incremental reader of events reads again on every refresh: a reorg (on anvil, `evm_revert`) may
replace them, and an event re-emitted there (a transaction sent again) must not fall behind the cursor."""


def reread_from(next_block: int, latest: int, start_block: int, depth: int = REORG_DEPTH) -> int:
    """The first block an incremental reader whose cursor is `next_block` reads when the head is `latest`: the
    last `depth` blocks again, and from below the head when the chain went back (a rollback shortens it).
    Greater than `latest` when there is nothing to read."""
    return max(start_block, min(next_block, latest + 1) - depth)


@dataclass(frozen=True)
class ChainEvent:
    """One decoded log."""

    name: str
    args: dict[str, Any]
    block_number: int
    tx_hash: str
    log_index: int


def read_events(
    tx: Transactor,
    address: str,
    abi: list[dict[str, Any]],
    from_block: int,
    to_block: int | None = None,
    *,
    names: set[str] | None = None,
    chunk: int = 5000,
) -> list[ChainEvent]:
    """Events of `address` in [from_block, to_block], queried in `chunk`-block ranges (RPCs cap ranges)."""
    if from_block < 0 or chunk < 1:
        raise ChainError(f"bad event range: from {from_block}, chunk {chunk}")
    by_topic = {
        HexBytes(event_abi_to_log_topic(item)): item  # type: ignore[arg-type]
        for item in abi
        if item["type"] == "event" and (names is None or item["name"] in names)
    }
    if names is not None and len(by_topic) != len(names):
        unknown = names - {item["name"] for item in by_topic.values()}
        raise ChainError(f"unknown event names: {sorted(unknown)}")
    w3 = tx.w3
    last = to_block if to_block is not None else int(tx.rpc("block number", lambda: w3.eth.block_number))
    events: list[ChainEvent] = []
    start = from_block
    while start <= last:
        end = min(start + chunk - 1, last)
        query: dict[str, Any] = {"address": address, "fromBlock": start, "toBlock": end}
        if names is not None:
            query["topics"] = [[t.to_0x_hex() for t in by_topic]]
        logs = tx.rpc("get_logs", lambda q=query: w3.eth.get_logs(q))  # type: ignore[misc]
        for log in logs:
            item = by_topic.get(HexBytes(log["topics"][0])) if log["topics"] else None
            if item is None:
                continue
            try:
                data = get_event_data(w3.codec, item, log)
            except (Web3Exception, DecodingError) as exc:  # e.g. an ABI older than the deployed contract
                raise ChainError(
                    f"log {log.get('logIndex')} of block {log.get('blockNumber')} does not decode as "
                    f"{item['name']}: {exc}", reason="bad_log"
                ) from exc
            events.append(
                ChainEvent(
                    name=str(data["event"]),
                    args=dict(data["args"]),
                    block_number=int(data["blockNumber"]),
                    tx_hash=HexBytes(data["transactionHash"]).to_0x_hex(),
                    log_index=int(data["logIndex"]),
                )
            )
        start = end + 1
    return events


class EventCursor:
    """An incremental reader of one contract's events: each `read` returns the events from the last block read
    (the last `REORG_DEPTH` blocks again, see `reread_from`) up to the head, oldest first, and moves the cursor
    there. A block read twice gives its events twice: readers apply them idempotently. `head()` is the chain's
    latest block, `events(from_block, to_block)` reads a range (`PoolClient.cursor` gives both)."""

    def __init__(self, head: Callable[[], int], events: Callable[[int, int], list[ChainEvent]],
                 start_block: int) -> None:
        self._head, self._events = head, events
        self.start_block = start_block
        self._next_block = start_block
        self.reads = 0
        """Reads that queried the chain's logs (a head not past the cursor's re-read range queries nothing)."""

    def read(self) -> list[ChainEvent]:
        """The events since the last read; `ChainError` when the chain does not answer (the cursor stays)."""
        latest = self._head()
        start = reread_from(self._next_block, latest, self.start_block)
        if latest < start:
            return []
        events = self._events(start, latest)
        self._next_block = latest + 1
        self.reads += 1
        return events

    @property
    def block(self) -> int:
        """The last block read (the start block less one before the first read)."""
        return self._next_block - 1
