"""Admission of an upload before its body: who signed its header, their standing on chain, a slot, a deadline.

Every POST that carries a body (`/v1/submissions`, `/v1/appeals`, the peers' `/v1/intake/probe`) passes here,
in the event loop, before its body is read (docs/protocol/wire-format.md, "Upload header"):

1. the upload header (`protocol.upload`): a signature by the sender over (domain, this validator, the route, the
   body's SHA-256, a recent time), checked from the headers alone: malformed 400, expired 400, forged 401;
2. the signer's standing from the cached chain view (a lane's `standing`: an active, staked node for a
   submission, a registered one for an appeal, a validator of the run for a probe): 403 otherwise. A signer the
   view does not know yet is looked up once more on a thread (`slow_standing`: one chain catch-up at most per
   interval, whoever asks); when no view read after the upload arrived can say (the last catch-up is too recent,
   or the chain does not answer), 503 `chain_unavailable` + Retry-After: a node that registered a moment ago is
   never refused for our timing;
3. a slot: at most `per_signer` of the lane's `total` per signer. Uploads with no header (older nodes and tools)
   go to a small pool of their own (`gate.anonymous_slots`, `anonymous_slots_per_address`), never a staked node's
   slot; a lane may refuse them (401). No slot: 503 + Retry-After at once, never a queue;
4. the body, read with a deadline that grows with what has arrived (`read_grace_s + n / min_bytes_per_s`) and a
   size cap: a sender that lags is cut off (408), one over the cap too (413), and a body that does not hash to
   what the header signed is refused (400).

Refusals close the connection, so no unread body is drained. The slot is held until the caller's work on the
body is done (`Upload.release`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.errors import ExpiredError, ProtocolError, SignatureError
from protocol.upload import read_upload_headers
from validator.config import GateSettings
from validator.stats import Stats


class SlotPool:
    """Slots held by key (a signer or a peer address), at most `per_key` each and `total` in all; changed only in
    the event loop's thread."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self.held: dict[str, int] = {}
        self.in_use = 0

    def take(self, key: str) -> bool:
        if self.in_use >= self.total or self.held.get(key, 0) >= self.per_key:
            return False
        self.held[key] = self.held.get(key, 0) + 1
        self.in_use += 1
        return True

    def give(self, key: str) -> None:
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        self.in_use = max(0, self.in_use - 1)


@dataclass
class Lane:
    """One upload route's admission rules."""

    path: str
    """The route, as signed in the upload header."""
    pool: SlotPool
    max_bytes: int
    standing: Callable[[str], bool]
    """The signer may upload here, from cached state (runs in the event loop: no I/O, no waiting)."""
    slow_standing: Callable[[str, float], bool | None] | None = None
    """A second look for a signer `standing` refused, given when the upload arrived (time.monotonic()): may read the
    chain, runs on a thread; None when it cannot tell yet (`validator.chainview.ChainView.fresh`)."""
    retry_after_s: Callable[[], float] = lambda: 1.0
    """When a second look that said None is worth asking again."""
    anonymous: bool = False
    """Uploads without a header are taken, in the anonymous pool."""
    what: str = "submissions"


@dataclass
class Upload:
    """An admitted upload: its body, its signer (None: anonymous), and the slot to give back when done."""

    body: bytes
    signer: str | None
    release: Callable[[], None]


def _refuse(status: int, error: str, detail: str, retry_after: float | None = None) -> JSONResponse:
    headers = {"Connection": "close"}  # the unread body is never drained
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


class Gate:
    """The checks of the module docstring for the lanes of one validator."""

    def __init__(self, settings: GateSettings, *, domain: str, validator: str, stats: Stats) -> None:
        self.settings, self.domain, self.validator, self.stats = settings, domain, validator, stats
        self.anonymous = SlotPool(settings.anonymous_slots, settings.anonymous_slots_per_address)
        self._slow = asyncio.Semaphore(1)  # second looks run one at a time (each may read the chain)

    async def admit(self, request: Request, lane: Lane) -> Upload | Response:
        """The upload's body within its slot, or the refusal to answer with."""
        arrived = time.monotonic()
        try:
            claim = read_upload_headers(request.headers, domain=self.domain, validator=self.validator,
                                        path=lane.path, max_age_s=self.settings.header_max_age_s)
        except SignatureError as exc:
            self.stats.count("gate_bad_signature")
            return _refuse(401, exc.code, str(exc))
        except (ExpiredError, ProtocolError) as exc:
            self.stats.count("gate_bad_header")
            return _refuse(400, exc.code, str(exc))
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isascii() or not declared.isdigit() or int(declared) > lane.max_bytes):
            self.stats.count("refused_oversize")
            return _refuse(413, "oversize", f"Content-Length {declared[:32]!r}, limit {lane.max_bytes}")
        if claim is None:
            if not lane.anonymous:
                self.stats.count("gate_no_header")
                return _refuse(401, "upload_header_required", f"{lane.what} need the signed upload header "
                               "(x-prime-signer, x-prime-body-sha256, x-prime-timestamp-ms, x-prime-signature)")
            pool, key = self.anonymous, request.client.host if request.client else "?"
        else:
            standing = lane.standing(claim.signer) or await self._slow_look(lane, claim.signer, arrived)
            if standing is None:
                self.stats.count("gate_standing_unknown")
                return _refuse(503, "chain_unavailable", f"cannot tell yet whether {claim.signer} may upload "
                               f"{lane.what} here (our view of the chain is older than this upload); send again",
                               retry_after=lane.retry_after_s())
            if not standing:
                self.stats.count("gate_no_standing")
                return _refuse(403, "no_standing", f"{claim.signer} may not upload {lane.what} here")
            pool, key = lane.pool, claim.signer
        if not pool.take(key):
            self.stats.count("refused_busy" if claim is not None else "refused_busy_anonymous")
            return _refuse(503, "overloaded", f"no free slot for {lane.what} from "
                           f"{'this signer' if claim is not None else 'unsigned senders'} (limits: "
                           f"{pool.per_key} each, {pool.total} in all)", retry_after=1.0)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                pool.give(key)

        try:
            body = await self._read(request, lane.max_bytes)
        except BaseException:
            release()
            raise
        if isinstance(body, Response):
            release()
            return body
        if claim is not None and hashlib.sha256(body).digest() != claim.body_sha256:
            release()
            self.stats.count("gate_body_mismatch")
            return _refuse(400, "body_mismatch", "the body does not hash to the signed x-prime-body-sha256")
        return Upload(body, None if claim is None else claim.signer, release)

    async def _slow_look(self, lane: Lane, signer: str, arrived: float) -> bool | None:
        if lane.slow_standing is None:
            return False
        async with self._slow:
            return await asyncio.to_thread(lane.slow_standing, signer, arrived)

    async def _read(self, request: Request, limit: int) -> bytes | Response:
        """The body, or a refusal once it lags the minimum rate (`read_grace_s + n / min_bytes_per_s`) or
        passes `limit`."""
        s = self.settings
        start = time.monotonic()
        chunks: list[bytes] = []
        size = 0
        while True:
            due = start + s.read_grace_s + size / s.min_bytes_per_s
            try:
                message = await asyncio.wait_for(request.receive(), max(0.0, due - time.monotonic()))
            except TimeoutError:
                self.stats.count("refused_slow_upload")
                return _refuse(408, "slow_upload", f"{size} bytes in {time.monotonic() - start:.1f} s: an upload "
                               f"must keep up {s.min_bytes_per_s} bytes/s after {s.read_grace_s:g} s")
            if message["type"] == "http.disconnect":
                return _refuse(400, "disconnected", "the sender went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                self.stats.count("refused_oversize")
                return _refuse(413, "oversize", f"body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
