"""`Discovery`: what a role runs. Gossip host + admission + board + re-announcement, behind calls
that work from plain threads and from asyncio (no trio in sight).

    disc = Discovery(cfg.discovery, identity=ident, domain=domain, trust=Trust(trainer=..., is_validator=...),
                     state_dir=cfg.state_dir)
    disc.start()                                   # or: await disc.astart()
    disc.announce_validator("http://10.0.0.5:8700")  # re-signed and re-published every reannounce_s
    disc.board.current_policy()                    # read the state any time
    for ann in disc.subscribe([Topic.POLICY]): ... # or: async for ann in disc.subscribe(...)
    disc.stop()                                    # or: await disc.astop()

Every message, ours included, goes through the same gossipsub topic validator before it is
delivered or forwarded: `Admission.admit` (signature, role, freshness, replay, rates) and then the
board (only newer announcements pass). A message that fails is dropped and not forwarded, and its
reason is counted in `stats()`. A second copy of an envelope is a replay (dropped), except the
first gossip copy of one learnt over HTTP, which is forwarded (see `discovery.board.admit_to_board`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

import trio

from discovery.admission import Admission, Announcement, Limits, Trust
from discovery.board import AnnouncementBoard, Outcome, Subscription, admit_to_board
from discovery.config import DiscoveryConfig
from discovery.errors import DiscoveryError, StaleError
from discovery.host import GossipHost, GossipSettings
from discovery.http import FetchResult, fetch_announcements
from discovery.messages import (
    AnnouncedBody,
    PolicyAnnounced,
    RelayAnnounced,
    Topic,
    ValidatorAnnounced,
    topic_name,
)
from discovery.peerkey import load_or_create
from protocol.envelope import NonceGuard, seal
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.nonce import random_nonce

log = logging.getLogger(__name__)

KEY_FILE = "libp2p.key"
DIAL_BACKOFF_S = 30.0


class Discovery:
    """Announce and learn a run's policy versions, validators and relays over libp2p gossipsub."""

    def __init__(
        self,
        config: DiscoveryConfig,
        *,
        identity: Identity | None,
        domain: str,
        trust: Trust,
        state_dir: str | Path,
        replay_guard: NonceGuard | None = None,
        board: AnnouncementBoard | None = None,
        clock: Callable[[], float] = time.time,
        name: str = "discovery",
        topics: Iterable[Topic] | None = None,
    ) -> None:
        """`identity`: the role's Ethereum key, which signs our announcements (None: we only listen,
        as a node does). `topics`: the ones this role takes part in (default all). Subscribe only to topics whose
        announcements you can judge: a peer that refuses a whole topic is a dead end in its mesh
        (a relay without a chain cannot tell validators, so it leaves that topic out)."""
        self.config = config
        self.identity = identity
        self.domain = domain
        self.clock = clock
        self.admission = Admission(
            domain=domain,
            trust=trust,
            limits=Limits.from_config(config),
            replay_guard=replay_guard,
            clock=clock,
        )
        self.board = board or AnnouncementBoard(max_per_topic=config.max_per_topic, clock=clock)
        key_file = config.key_file or Path(state_dir) / KEY_FILE
        self.keys = load_or_create(key_file)
        self.topics = frozenset(Topic) if topics is None else frozenset(topics)
        self._topics = {topic_name(domain, t): t for t in Topic if t in self.topics}
        self.host = GossipHost(
            self.keys,
            listen=config.listen,
            topics=list(self._topics),
            validator=self._validate,
            settings=GossipSettings(
                degree=config.degree,
                heartbeat_s=config.heartbeat_s,
                gossip_rate=config.gossip_rate,
                eclipse_protection=config.eclipse_protection,
                # The seen-cache must outlive every announcement (see discovery.host).
                seen_ttl_s=config.ttl_s + config.max_skew_s + 60.0,
            ),
            name=name,
        )
        self.peer_id = self.host.peer_id
        self._lock = threading.Lock()
        self._intents: dict[Topic, Callable[[], AnnouncedBody]] = {}
        self._stats: Counter[str] = Counter()
        self._own_refusals: dict[bytes, ProtocolError] = {}
        self._dial_after: dict[str, float] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Start the host, dial the bootstrap peers, start re-announcing. Returns once listening
        (bootstrap dials go on in the background; an unreachable one is retried, never fatal)."""
        self.host.start(timeout)
        self.host.spawn(self._maintain)
        self.host.spawn(self._reannounce)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the host (no thread left behind) and end every subscription."""
        try:
            self.host.stop(timeout)
        finally:
            self.board.close()

    async def astart(self, timeout: float = 30.0) -> None:
        """`start` for asyncio callers (runs it in a worker thread)."""
        await asyncio.to_thread(self.start, timeout)

    async def astop(self, timeout: float = 30.0) -> None:
        """`stop` for asyncio callers."""
        await asyncio.to_thread(self.stop, timeout)

    def __enter__(self) -> Discovery:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def addrs(self) -> list[str]:
        """Our full multiaddrs (`.../p2p/<peer id>`): what other peers put in `bootstrap`."""
        return self.host.addrs

    # -- announcing --------------------------------------------------------------------------

    def announce_policy(
        self, policy_version: int, manifest_hash: bytes, urls: Iterable[str] = ()
    ) -> Announcement:
        """(Trainer) policy `policy_version` is published; re-announced until the next one."""
        urls = tuple(urls)
        return self._announce(
            Topic.POLICY,
            lambda: PolicyAnnounced(
                peer_id=self.peer_id,
                addrs=self._own_addrs(),
                policy_version=policy_version,
                manifest_hash=manifest_hash,
                urls=urls,
            ),
        )

    def announce_validator(self, http_url: str) -> Announcement:
        """(Validator) our HTTP API is at `http_url`; re-announced until `withdraw`."""
        return self._announce(
            Topic.VALIDATORS,
            lambda: ValidatorAnnounced(peer_id=self.peer_id, addrs=self._own_addrs(), http_url=http_url),
        )

    def announce_relay(self, http_url: str, versions: Iterable[int]) -> Announcement:
        """(Relay) we serve `versions` at `http_url`; call again whenever the set changes."""
        held = tuple(sorted(set(versions)))
        return self._announce(
            Topic.RELAYS,
            lambda: RelayAnnounced(
                peer_id=self.peer_id, addrs=self._own_addrs(), http_url=http_url, versions=held
            ),
        )

    def withdraw(self, topic: Topic) -> None:
        """Stop re-announcing on `topic` (peers forget us after the TTL)."""
        with self._lock:
            self._intents.pop(topic, None)

    def _announce(self, topic: Topic, make: Callable[[], AnnouncedBody]) -> Announcement:
        if not self.host.running:
            raise DiscoveryError("start discovery before announcing")
        if topic not in self.topics:
            raise DiscoveryError(f"not taking part in the {topic.value} topic")
        if self.identity is None:
            raise DiscoveryError("this discovery has no key to sign announcements with")
        make()  # a bad argument fails here, in the caller's thread, as a pydantic ValidationError
        with self._lock:
            self._intents[topic] = make
        return self.host.call(self._publish_async, topic, make)

    async def _publish_async(self, topic: Topic, make: Callable[[], AnnouncedBody]) -> Announcement:
        """Seal and publish one announcement; raise the reason if our own validator refused it.

        libp2p gives up on a validator after `validation_timeout_s` and then drops the message
        without a word (a busy machine can get there). Our admission goes on in its thread and may
        still land on the board, so we wait for it that long; if it never lands, we publish a freshly
        sealed copy once more before calling it an error."""
        for attempt in (1, 2):
            body = make()
            assert self.identity is not None  # checked by _announce before any intent is kept
            wire = seal(
                self.identity, body, domain=self.domain, nonce=random_nonce(), now=self.clock()
            ).to_bytes()
            key = hashlib.sha256(wire).digest()
            await self.host.publish_async(topic_name(self.domain, topic), wire)
            deadline = trio.current_time() + self.host.settings.validation_timeout_s
            while True:
                refusal = self._own_refusals.pop(key, None)
                if refusal is not None:
                    held = self._held_own(topic, body)
                    if isinstance(refusal, StaleError) and held is not None:
                        # the re-announcer signed the same intent a moment later and its copy landed first
                        return held
                    raise refusal
                for ann in self.board.entries(topic):
                    if ann.wire == wire:
                        return ann
                if trio.current_time() >= deadline:
                    break
                await trio.sleep(0.05)
            log.warning(
                "our own %s announcement was not admitted within %.1f s (try %d of 2)",
                topic.value,
                self.host.settings.validation_timeout_s,
                attempt,
            )
        raise DiscoveryError(
            f"our own {topic.value} announcement was not admitted: our validator did not finish in "
            f"{self.host.settings.validation_timeout_s} s twice (an overloaded machine?); re-announced every "
            f"{self.config.reannounce_s} s"
        )

    def _held_own(self, topic: Topic, body: AnnouncedBody) -> Announcement | None:
        """Our own announcement of `body` on `topic` the board holds, if any."""
        assert self.identity is not None
        for ann in self.board.entries(topic):
            if ann.signer == self.identity.address and ann.body == body:
                return ann
        return None

    def _own_addrs(self) -> tuple[str, ...]:
        if self.config.announce_addrs:
            return tuple(self.config.announce_addrs)
        suffix = f"/p2p/{self.peer_id}"
        return tuple(a.removesuffix(suffix) for a in self.host.addrs)

    # -- reading -----------------------------------------------------------------------------

    def subscribe(self, topics: Iterable[Topic] | None = None, *, replay: bool = True) -> Subscription:
        """New and changed announcements (see `AnnouncementBoard.subscribe`)."""
        return self.board.subscribe(topics, maxsize=self.config.subscriber_queue, replay=replay)

    def peers(self) -> list[str]:
        """Peer ids we have a pubsub stream with."""
        return self.host.peers()

    def connect(self, addr: str, timeout: float = 10.0) -> None:
        """Dial one peer (`.../p2p/<peer id>`) now."""
        self.host.connect(addr, timeout)

    def admit(self, data: bytes, *, topic: Topic, source: str = "http") -> Outcome:
        """Feed an envelope learnt elsewhere (HTTP) through the same checks onto the board;
        raises the reason as a `ProtocolError`."""
        return admit_to_board(self.admission, self.board, data, topic=topic, source=source)

    def fetch(self, base_url: str, timeout: float = 10.0) -> FetchResult:
        """The HTTP fallback: read another role's `/v1/announcements` onto our board."""
        return fetch_announcements(base_url, self.admission, self.board, timeout=timeout)

    def stats(self) -> dict[str, int]:
        """Counts of admitted (`accepted.<outcome>`) and dropped (`dropped.<reason code>`) messages."""
        with self._lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    # -- the gossipsub topic validator (host thread) -----------------------------------------

    async def _validate(self, topic_str: str, origin: str, data: bytes, forwarder: str) -> bool:
        topic = self._topics.get(topic_str)
        if topic is None:
            return False
        own = forwarder == self.peer_id and origin == self.peer_id
        admit = functools.partial(
            admit_to_board,
            self.admission,
            self.board,
            data,
            topic=topic,
            source="self" if own else "gossip",
            origin_peer=origin,
            forwarder=forwarder,
        )
        try:
            # Off the trio thread: signature recovery, SQLite and the role's hooks must not stall gossip.
            # (trio-typing, a libp2p dependency, ships stale trio stubs without `abandon_on_cancel`.)
            outcome = await trio.to_thread.run_sync(admit, abandon_on_cancel=True)  # type: ignore[call-arg]
        except ProtocolError as exc:
            self._count(f"dropped.{exc.code}")
            if own:
                self._own_refusals[hashlib.sha256(data).digest()] = exc
            log.debug("dropped announcement on %s from %s: %s", topic.value, forwarder, exc)
            return False
        self._count(f"accepted.{outcome.value}")
        return True

    # -- background tasks (host thread) ------------------------------------------------------

    async def _reannounce(self) -> None:
        """Re-sign and re-publish our announcements, so late joiners learn them and TTLs move."""
        while True:
            await trio.sleep(self.config.reannounce_s)
            with self._lock:
                intents = list(self._intents.items())
            for topic, make in intents:
                try:
                    await self._publish_async(topic, make)
                except (ProtocolError, DiscoveryError) as exc:
                    log.warning("re-announcement on %s refused: %s", topic.value, exc)
            self.board.sweep()

    async def _maintain(self) -> None:
        """Keep the bootstrap peers connected; below `target_peers`, dial peers named in announcements."""
        while True:
            wanted = list(self.config.bootstrap)
            connected = await self.host.peers_async()
            if len(connected) < self.config.target_peers:
                for ann in self.board.entries():
                    if ann.body.peer_id != self.peer_id:
                        wanted += [f"{a}/p2p/{ann.body.peer_id}" for a in ann.body.addrs]
            now = time.monotonic()
            for addr in [a for a, t in self._dial_after.items() if t <= now]:
                del self._dial_after[addr]
            for addr in dict.fromkeys(wanted):
                peer = addr.rsplit("/p2p/", 1)[-1]
                if peer in connected or peer == self.peer_id or self._dial_after.get(addr, 0.0) > now:
                    continue
                try:
                    await self.host.connect_async(addr, timeout=5.0)
                    connected.append(peer)
                    log.info("connected to %s", addr)
                except DiscoveryError as exc:
                    self._dial_after[addr] = now + DIAL_BACKOFF_S
                    log.info("cannot reach %s (retry in %.0f s): %s", addr, DIAL_BACKOFF_S, exc)
            await trio.sleep(min(self.config.reannounce_s, 5.0))
