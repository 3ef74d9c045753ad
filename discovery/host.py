"""A py-libp2p gossipsub host in its own thread, callable from any other thread.

py-libp2p runs on trio only (under asyncio it fails with `'RunContext' object has no attribute
'runner'`), so the host lives in a thread of its own running `trio.run`, and every call from outside
goes through `trio.from_thread` with the run's token. Roles never see trio: `discovery.service`
builds on this class, and tests use it bare as a raw peer (no validator) to play a hostile or
observing peer.

py-libp2p facts this class is built around (0.8.1, measured in tests/integration/discovery):

* the pubsub and gossipsub services must run before the first `connect()` (its notifee sends on
  an unbuffered channel: connecting first blocks forever and shutdown hangs);
* each subscription is a 32-message channel that drops overflow silently (a warning in the log),
  so every subscription is drained by its own task that never waits on anything else;
* gossipsub's spam check allows 10 messages per second per forwarding peer and topic, our own
  publications included: a burst of 50 publications reached the next peer as 10. The limit is
  raised here (`gossip_rate`); the real limits are the per-peer and per-signer buckets of
  `discovery.admission`;
* topic validators run before a message is forwarded or delivered, and their verdicts are cached
  per message id (`validation_cache_ttl`, default 300 s) while the seen-cache forgets after
  `seen_ttl` (default 120 s): a message replayed verbatim between the two would be forwarded on
  the cached verdict. `seen_ttl_s` must therefore cover the announcement's whole life (TTL + skew),
  and the validation cache lives no longer than the seen-cache;
* `Pubsub` starts a background thread (its seen-cache sweeper) that nothing stops; `stop()` stops it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from discovery.errors import DiscoveryError
from discovery.peerkey import peer_id as peer_id_of

log = logging.getLogger(__name__)

T = TypeVar("T")

MessageValidator = Callable[[str, str, bytes, str], Awaitable[bool]]
"""`(topic, origin peer, data, forwarding peer) -> forward?`, awaited on the host's trio thread."""
MessageSink = Callable[[str, str, bytes], None]
"""`(topic, origin peer, data)`, called on the host's trio thread for each delivered message."""


@dataclass(frozen=True)
class GossipSettings:
    """Knobs of the gossipsub router (see `discovery.config.DiscoveryConfig` for their meaning)."""

    degree: int = 6
    heartbeat_s: int = 1
    gossip_rate: float = 1000.0
    eclipse_protection: bool = False
    seen_ttl_s: float = 180.0
    validation_timeout_s: float = 5.0


class GossipHost:
    """One libp2p host with gossipsub on a fixed set of topics, in a thread of its own."""

    def __init__(
        self,
        keys: KeyPair,
        *,
        listen: Sequence[str],
        topics: Sequence[str],
        validator: MessageValidator | None = None,
        on_message: MessageSink | None = None,
        settings: GossipSettings | None = None,
        name: str = "discovery",
    ) -> None:
        self.keys = keys
        self.peer_id = peer_id_of(keys)
        self.topics = tuple(topics)
        self.settings = settings or GossipSettings()
        self._listen = [multiaddr.Multiaddr(a) for a in listen]
        self._validator = validator
        self._on_message = on_message
        self._name = name
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._addrs: list[str] = []

    # -- lifecycle (any thread) ---------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Listen, start pubsub and subscribe; returns once ready. `DiscoveryError` on failure."""
        if self._thread is not None:
            raise DiscoveryError("host already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"{self._name}-trio", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DiscoveryError(f"libp2p host did not start within {timeout} s")
        if self._failure is not None:
            self._thread.join(timeout)
            raise DiscoveryError(f"libp2p host failed to start: {self._failure!r}") from self._failure

    def stop(self, timeout: float = 30.0) -> None:
        """Close every connection and end the thread (idempotent). `DiscoveryError` if it hangs."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        thread.join(timeout)
        if thread.is_alive():
            raise DiscoveryError(f"libp2p host thread did not stop within {timeout} s")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._ready.is_set()

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs (`.../p2p/<peer id>`) other peers can bootstrap from."""
        return list(self._addrs)

    # -- calls into the trio thread ---------------------------------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` on the host's thread and return its result (blocks the caller)."""
        if self._token is None or not self.running:
            raise DiscoveryError("libp2p host is not running")
        if threading.current_thread() is self._thread:
            raise DiscoveryError("GossipHost.call from the host's own thread would deadlock")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise DiscoveryError("libp2p host stopped") from exc

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Start `fn()` as a background task of the host (cancelled at stop)."""

        def start_soon() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(fn)

        if self._token is None or not self.running:
            raise DiscoveryError("libp2p host is not running")
        trio.from_thread.run_sync(start_soon, trio_token=self._token)

    def publish(self, topic: str, data: bytes) -> None:
        """Publish `data` on `topic` (validated locally first, like any message)."""
        self.call(self.publish_async, topic, data)

    def connect(self, addr: str, timeout: float = 10.0) -> None:
        """Dial a peer given as `.../p2p/<peer id>`; `DiscoveryError` if it cannot be reached."""
        self.call(self.connect_async, addr, timeout)

    def peers(self) -> list[str]:
        """Peers we have a pubsub stream with."""
        return self.call(self.peers_async)

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to be subscribed to `topic`."""
        return self.call(self.topic_peers_async, topic)

    # -- trio side (the host's thread only) --------------------------------------------------

    async def publish_async(self, topic: str, data: bytes) -> None:
        assert self._pubsub is not None
        await self._pubsub.publish(topic, data)

    async def connect_async(self, addr: str, timeout: float = 10.0) -> None:
        assert self._host is not None and self._pubsub is not None
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # multiaddr raises several unrelated types
            raise DiscoveryError(f"not a peer address (want .../p2p/<peer id>): {addr!r}: {exc}") from exc
        if info.peer_id == self._host.get_id():
            return
        try:
            with trio.fail_after(timeout):
                await self._host.connect(info)
            await self._pubsub.wait_for_peer(info.peer_id, timeout=timeout)
        except trio.TooSlowError as exc:
            raise DiscoveryError(f"{addr}: no pubsub stream within {timeout} s") from exc
        except Exception as exc:  # dial errors come in many types (swarm, security, muxer)
            raise DiscoveryError(f"cannot connect to {addr}: {exc}") from exc

    async def peers_async(self) -> list[str]:
        assert self._pubsub is not None
        return sorted(p.to_base58() for p in self._pubsub.peers)

    async def topic_peers_async(self, topic: str) -> list[str]:
        assert self._pubsub is not None
        return sorted(p.to_base58() for p in self._pubsub.peer_topics.get(topic, ()))

    def is_connected(self, peer: str) -> bool:
        """On the host's thread: whether a pubsub stream to `peer` is open."""
        assert self._pubsub is not None
        return any(p.to_base58() == peer for p in self._pubsub.peers)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if not self._ready.is_set():
                self._failure = exc
            else:
                log.exception("libp2p host %s died", self.peer_id)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        s = self.settings
        host = new_host(key_pair=self.keys, listen_addrs=self._listen)
        gossip = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
            degree=s.degree,
            degree_low=max(1, s.degree - 2),
            degree_high=2 * s.degree,
            heartbeat_interval=s.heartbeat_s,
            max_messages_per_topic_per_second=s.gossip_rate,
            eclipse_protection_enabled=s.eclipse_protection,
        )
        seen_ttl = math.ceil(s.seen_ttl_s)
        pubsub = Pubsub(
            host,
            gossip,
            seen_ttl=seen_ttl,
            validation_cache_ttl=seen_ttl,
            validation_timeout=s.validation_timeout_s,
        )
        if self._validator is not None:
            for topic in self.topics:
                pubsub.set_topic_validator(topic, self._topic_validator(topic), is_async_validator=True)
        self._host, self._pubsub = host, pubsub
        try:
            async with host.run(listen_addrs=self._listen):
                # Services before any connect (see the module docstring).
                async with background_trio_service(pubsub), background_trio_service(gossip):
                    await pubsub.wait_until_ready()
                    subscriptions = [(t, await pubsub.subscribe(t)) for t in self.topics]
                    async with trio.open_nursery() as nursery:
                        for topic, sub in subscriptions:
                            nursery.start_soon(self._drain, topic, sub)
                        self._nursery = nursery
                        self._stop = trio.Event()
                        self._addrs = [str(a) for a in host.get_addrs()]
                        self._token = trio.lowlevel.current_trio_token()
                        self._ready.set()
                        log.info("libp2p host %s listening on %s", self.peer_id, self._addrs)
                        await self._stop.wait()
                        nursery.cancel_scope.cancel()
        finally:
            pubsub.seen_messages.stop()
            log.info("libp2p host %s stopped", self.peer_id)

    def _topic_validator(self, topic: str) -> Callable[[ID, rpc_pb2.Message], Awaitable[bool]]:
        validator = self._validator
        assert validator is not None

        async def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            try:
                return await validator(topic, ID(msg.from_id).to_base58(), msg.data, forwarder.to_base58())
            except Exception:  # a bug in a validator must drop the message, not kill the host
                log.exception("announcement validator failed on %s", topic)
                return False

        return validate

    async def _drain(self, topic: str, sub: Any) -> None:
        """Empty one subscription as fast as messages come (its channel holds only 32)."""
        while True:
            msg: rpc_pb2.Message = await sub.get()
            if self._on_message is not None:
                try:
                    self._on_message(topic, ID(msg.from_id).to_base58(), msg.data)
                except Exception:
                    log.exception("message sink failed on %s", topic)
