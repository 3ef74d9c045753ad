"""The validator's HTTP server: uvicorn with limits on what a connection may hold before it says who it is.

uvicorn keeps a connection that sends nothing, or trickles its request line and headers, for as long as the peer
likes, and its only connection cap (`limit_concurrency`) answers everyone 503 once anyone fills it. Here each
connection is held to (`GateSettings`):

- its request line and headers complete within `header_timeout_s` of connecting or of its previous answer
  (closed otherwise); an idle keep-alive connection closes after `keep_alive_s`;
- at most `max_connections_per_address` open connections per peer address;
- at most `max_connections` in all; a new connection past it closes the oldest one still waiting for its headers
  (those are the cheap ones to send: an honest request's headers come at once), or is closed itself when none is.

What a request may hold once its headers are in (a slot, its body, a deadline) is `validator.gate`'s.
`uvicorn_config` is the one place a validator's server is configured (`prime-validator` and the loopback harness);
`settle_heap` is what a validator process does once built, before it serves (both entry points call it).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from validator.config import GateSettings
    from validator.stats import Stats

log = logging.getLogger(__name__)


def settle_heap() -> int:
    """Hide what start-up made (imports, the model, the app) from the cyclic garbage collector (`gc.freeze`);
    returns how many objects. Python's full collection walks every tracked object with every thread stopped: in a
    validator process that is ~450,000 objects before the first request and a 250-300 ms pause on a 2-core AMD
    EPYC, and under the hostile load it took a quarter of the time the process held the GIL, each pause landing in
    some honest submission's latency (`bench.load --only hostile`). Objects made later are collected as before;
    the frozen ones live as long as the process, which they did anyway. Call it once, in the process that serves,
    never in a test process that builds many services."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class ConnectionLimits:
    """Open connections by peer address and those still waiting for their headers (oldest first); the event loop's
    thread alone changes them."""

    def __init__(self, settings: GateSettings, stats: Stats | None = None) -> None:
        self.settings, self.stats = settings, stats
        self.by_address: dict[str, int] = {}
        self.open = 0
        self.waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()

    def count(self, event: str) -> None:
        if self.stats is not None:
            self.stats.count(event)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring (`limits` is set on a subclass per server)."""

    limits: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        lim, s = self.limits, self.limits.settings
        self._address = self.client[0] if self.client else "?"
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        if lim.by_address.get(self._address, 0) >= s.max_connections_per_address:
            lim.count("refused_connections_per_address")
            transport.close()
            return
        if lim.open >= s.max_connections:
            if not lim.waiting:
                lim.count("refused_connections")
                transport.close()
                return
            oldest, _ = lim.waiting.popitem(last=False)
            lim.count("evicted_waiting_connections")
            oldest._close()
        lim.open += 1
        lim.by_address[self._address] = lim.by_address.get(self._address, 0) + 1
        self._counted = True
        self._await_headers()

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self.limits.waiting[self] = None
        self._header_timer = self.loop.call_later(self.limits.settings.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        self.limits.waiting.pop(self, None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:  # still no complete request line and headers
            self.limits.count("closed_header_timeout")
            self._close()

    def _close(self) -> None:
        self._stop_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._counted and self.conn.their_state is not h11.IDLE:  # a request's headers are in
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._counted and not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_headers()  # the next request's headers get the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self._stop_header_timer()
            lim = self.limits
            lim.open -= 1
            left = lim.by_address.get(self._address, 1) - 1
            if left > 0:
                lim.by_address[self._address] = left
            else:
                lim.by_address.pop(self._address, None)
        super().connection_lost(exc)


def uvicorn_config(app: Any, settings: GateSettings, *, host: str, port: int, stats: Stats | None = None,
                   log_level: str = "warning") -> uvicorn.Config:
    """A uvicorn config serving `app` with the connection limits of `settings` (one set of limits per call)."""
    protocol = type("ValidatorH11Protocol", (GuardedH11Protocol,), {"limits": ConnectionLimits(settings, stats)})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=max(1, round(settings.keep_alive_s)),
                          h11_max_incomplete_event_size=settings.max_header_bytes)
