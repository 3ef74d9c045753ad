"""The announcement board: the latest believed announcement per (topic, signer), until its TTL.

Everything admitted (over gossip, over HTTP, or our own) is offered to the board; the board keeps
only what is newer than what it holds (`Outcome`), so a delayed or replayed older announcement
changes nothing. Roles read it (`current_policy`, `validators`, `relays`), serve it as
`GET /v1/announcements` (`to_json`: the signed envelopes, so a reader verifies them itself), and
subscribe to changes (`subscribe`): a bounded queue per subscriber, iterable from a thread or
from asyncio. A slow subscriber loses the oldest events (counted in `dropped`), never the board's
state: the board is the truth, the events are hints to read it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from enum import StrEnum
from types import TracebackType

from discovery.admission import Admission, Announcement
from discovery.errors import DiscoveryError, StaleError
from discovery.messages import PolicyAnnounced, RelayAnnounced, Topic
from protocol.errors import ReplayError

log = logging.getLogger(__name__)

SERVE_MAX_ITEMS = 1024
"""At most this many envelopes in one `/v1/announcements` answer (readers accept up to 4096)."""
SERVE_MAX_BYTES = 2 << 20
"""At most this many bytes in one `/v1/announcements` answer (readers accept up to 4 MiB)."""


class Outcome(StrEnum):
    """What offering an announcement to the board did."""

    NEW = "new"
    """First live announcement from this signer on this topic."""
    CHANGED = "changed"
    """Newer than the one held, with a different body (subscribers are told)."""
    REFRESHED = "refreshed"
    """Newer than the one held, same body: only the TTL moves (subscribers are not told)."""
    DUPLICATE = "duplicate"
    """Exactly the envelope already held."""
    STALE = "stale"
    """Not newer than the one held, or already past its TTL: ignored."""


def admit_to_board(
    admission: Admission,
    board: AnnouncementBoard,
    data: bytes,
    *,
    topic: Topic,
    source: str,
    origin_peer: str | None = None,
    forwarder: str | None = None,
) -> Outcome:
    """The one receive path (gossip validator and HTTP reader alike): admit, then offer to the board.

    Raises the reason as a `ProtocolError`; an older announcement than the one held is `StaleError`.
    A second gossip copy of an envelope is a `ReplayError` (dropped, not forwarded), with one
    exception: the first gossip copy of an envelope we learnt over HTTP is `DUPLICATE` (forwarded,
    not delivered twice), so reading `/v1/announcements` first does not make us a dead end. An HTTP
    read of what we hold is `DUPLICATE` too.
    """
    try:
        ann = admission.admit(data, topic=topic, origin_peer=origin_peer, forwarder=forwarder, source=source)
    except ReplayError:
        if source == "http" and board.holds(data):
            return Outcome.DUPLICATE  # re-reading a list: what we hold is not news
        if source != "http" and board.claim_for_gossip(data, source):
            return Outcome.DUPLICATE  # first gossip copy of an envelope we had over HTTP: forward it once
        raise
    outcome = board.offer(ann)
    if outcome is Outcome.STALE:
        raise StaleError(f"not newer than the {topic.value} announcement held from {ann.signer}")
    return outcome


def _order(ann: Announcement) -> tuple[int, float]:
    """Which of two announcements from one signer is newer: policy version first, then signing time."""
    if isinstance(ann.body, PolicyAnnounced):
        return ann.body.policy_version, ann.sent_at
    return 0, ann.sent_at


def _digest(wire: bytes) -> bytes:
    return hashlib.sha256(wire).digest()


class AnnouncementBoard:
    """Thread-safe store of live announcements; see the module docstring."""

    def __init__(self, *, max_per_topic: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self.max_per_topic = max_per_topic
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Topic, dict[str, Announcement]] = {t: {} for t in Topic}
        self._wires: dict[bytes, tuple[Topic, str]] = {}  # digest of a held envelope -> its key
        self._subs: list[Subscription] = []

    # -- writing ---------------------------------------------------------------------------

    def offer(self, ann: Announcement, *, now: float | None = None) -> Outcome:
        """Keep `ann` if it is newer than what this signer has on its topic; tell subscribers of changes."""
        now_s = self.clock() if now is None else now
        if ann.expires_at <= now_s:
            return Outcome.STALE
        with self._lock:
            table = self._entries[ann.topic]
            held = table.get(ann.signer)
            if held is not None and held.expires_at <= now_s:
                self._drop_locked(table, ann.signer)
                held = None
            if held is not None:
                if held.wire == ann.wire:
                    return Outcome.DUPLICATE
                if _order(ann) <= _order(held):
                    return Outcome.STALE
                outcome = Outcome.REFRESHED if held.body == ann.body else Outcome.CHANGED
                self._drop_locked(table, ann.signer)
            else:
                outcome = Outcome.NEW
                if len(table) >= self.max_per_topic:
                    self._evict_locked(table, now_s)
            table[ann.signer] = ann
            self._wires[_digest(ann.wire)] = (ann.topic, ann.signer)
            subs = list(self._subs) if outcome in (Outcome.NEW, Outcome.CHANGED) else []
        for sub in subs:
            sub._push(ann)
        return outcome

    def _drop_locked(self, table: dict[str, Announcement], signer: str) -> None:
        old = table.pop(signer)
        self._wires.pop(_digest(old.wire), None)

    def _evict_locked(self, table: dict[str, Announcement], now_s: float) -> None:
        """Make room: expired entries first, else the one signed longest ago (a live signer comes
        back at its next re-announcement)."""
        for signer in [s for s, a in table.items() if a.expires_at <= now_s]:
            self._drop_locked(table, signer)
        if len(table) >= self.max_per_topic:
            oldest = min(table, key=lambda s: table[s].sent_at)
            log.warning("announcement board full on %s: forgetting %s", table[oldest].topic, oldest)
            self._drop_locked(table, oldest)

    def sweep(self, *, now: float | None = None) -> int:
        """Forget every expired announcement; returns how many."""
        now_s = self.clock() if now is None else now
        removed = 0
        with self._lock:
            for table in self._entries.values():
                for signer in [s for s, a in table.items() if a.expires_at <= now_s]:
                    self._drop_locked(table, signer)
                    removed += 1
        return removed

    # -- reading ---------------------------------------------------------------------------

    def holds(self, wire: bytes, *, now: float | None = None) -> bool:
        """Whether exactly this envelope is held and live (a duplicate, not a replay)."""
        now_s = self.clock() if now is None else now
        with self._lock:
            key = self._wires.get(_digest(wire))
            if key is None:
                return False
            held = self._entries[key[0]].get(key[1])
            return held is not None and held.wire == wire and held.expires_at > now_s

    def claim_for_gossip(self, wire: bytes, source: str, *, now: float | None = None) -> bool:
        """If exactly this envelope is held, live, and was learnt over HTTP, mark it as seen on
        gossip (`source`) and return True; else False. Each envelope is claimed at most once."""
        now_s = self.clock() if now is None else now
        with self._lock:
            key = self._wires.get(_digest(wire))
            if key is None:
                return False
            held = self._entries[key[0]].get(key[1])
            if held is None or held.wire != wire or held.expires_at <= now_s or held.source != "http":
                return False
            self._entries[key[0]][key[1]] = dataclasses.replace(held, source=source)
            return True

    def entries(self, topic: Topic | None = None, *, now: float | None = None) -> list[Announcement]:
        """Live announcements (of one topic, or all), ordered by topic then signer."""
        now_s = self.clock() if now is None else now
        topics = list(Topic) if topic is None else [topic]
        with self._lock:
            return [a for t in topics for _, a in sorted(self._entries[t].items()) if a.expires_at > now_s]

    def current_policy(self, *, now: float | None = None) -> Announcement | None:
        """The newest live policy announcement (highest version), if any."""
        live = self.entries(Topic.POLICY, now=now)
        return max(live, key=_order) if live else None

    def validators(self, *, now: float | None = None) -> list[Announcement]:
        """Live validator announcements."""
        return self.entries(Topic.VALIDATORS, now=now)

    def relays(self, version: int | None = None, *, now: float | None = None) -> list[Announcement]:
        """Live relay announcements (only those holding `version`, when given)."""
        live = self.entries(Topic.RELAYS, now=now)
        if version is None:
            return live
        return [a for a in live if isinstance(a.body, RelayAnnounced) and version in a.body.versions]

    def to_json(
        self, *, now: float | None = None, max_items: int = SERVE_MAX_ITEMS, max_bytes: int = SERVE_MAX_BYTES
    ) -> bytes:
        """`GET /v1/announcements`: a JSON list of the live signed envelopes, each in canonical form.

        Bounded by `max_items` and `max_bytes` (below what `discovery.http` readers accept), whatever the
        board holds: the newest policy announcement first, then validators, then relays, each topic newest
        first, so junk on one topic can push out only the oldest of that topic, never the list as a whole."""
        live = self.entries(now=now)
        order = {Topic.POLICY: 0, Topic.VALIDATORS: 1, Topic.RELAYS: 2}
        live.sort(key=lambda a: (order[a.topic], tuple(-x for x in _order(a))))
        out: list[bytes] = []
        size = 2
        for a in live:
            if len(out) >= max_items or size + len(a.wire) + 1 > max_bytes:
                break
            out.append(a.wire)
            size += len(a.wire) + 1
        return b"[" + b",".join(out) + b"]"

    def __len__(self) -> int:
        return len(self.entries())

    # -- subscribers -----------------------------------------------------------------------

    def subscribe(
        self, topics: Iterable[Topic] | None = None, *, maxsize: int = 256, replay: bool = True
    ) -> Subscription:
        """Events for new and changed announcements on `topics` (all by default). With `replay`,
        the live announcements come first, so a late subscriber misses nothing current."""
        sub = Subscription(self, frozenset(Topic) if topics is None else frozenset(topics), maxsize)
        with self._lock:
            self._subs.append(sub)
        if replay:
            for ann in self.entries():
                sub._push(ann)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        """End every subscription (iterators stop, waiting `get`s raise `DiscoveryError`)."""
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.close()


class Subscription:
    """A bounded queue of board events, readable from a thread (`get`, `for`) or asyncio
    (`await aget()`, `async for`). Full: the oldest event is dropped and counted."""

    def __init__(self, board: AnnouncementBoard, topics: frozenset[Topic], maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.topics = topics
        self.dropped = 0
        """Events lost because this subscriber was slow (read the board to catch up)."""
        self._board = board
        self._items: deque[Announcement] = deque()
        self._maxsize = maxsize
        self._cond = threading.Condition()
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def _push(self, ann: Announcement) -> None:
        if ann.topic not in self.topics:
            return
        with self._cond:
            if self._closed:
                return
            if len(self._items) >= self._maxsize:
                self._items.popleft()
                self.dropped += 1
            self._items.append(ann)
            self._cond.notify_all()
            self._wake_locked()

    def _wake_locked(self) -> None:
        for loop, fut in self._waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass
        self._waiters.clear()

    def get(self, timeout: float | None = None) -> Announcement | None:
        """The next event; None after `timeout` seconds; `DiscoveryError` once closed and empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                if self._closed:
                    raise DiscoveryError("subscription closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._items.popleft()

    async def aget(self) -> Announcement:
        """The next event, awaited on the running asyncio loop; `DiscoveryError` once closed and empty."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise DiscoveryError("subscription closed")
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            try:
                await fut
            finally:
                with self._cond:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))

    def __iter__(self) -> Iterator[Announcement]:
        while True:
            try:
                item = self.get()
            except DiscoveryError:
                return
            if item is not None:
                yield item

    async def __aiter__(self) -> AsyncIterator[Announcement]:
        while True:
            try:
                yield await self.aget()
            except DiscoveryError:
                return

    def close(self) -> None:
        """Stop receiving; readers drain what is queued, then stop."""
        self._board._unsubscribe(self)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._wake_locked()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
