"""`GET /v1/announcements`: the fallback when libp2p is unreachable (no libp2p, no trio here).

A role that serves HTTP answers the path with `AnnouncementBoard.to_json()`: a JSON list of the
signed envelopes it believes. A reader fetches that list from any role it knows (a validator's URL
from its config, say) and feeds every envelope through the same `Admission` as gossip, so a
lying or compromised server can hide announcements but cannot forge one.

    board, admission = AnnouncementBoard(), Admission(domain=..., trust=Trust(...))
    result = fetch_announcements("http://validator:8700", admission, board)
    board.current_policy()
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import httpx

from discovery.admission import Admission
from discovery.board import AnnouncementBoard, admit_to_board
from discovery.errors import DiscoveryError
from discovery.messages import topic_of_kind
from protocol.canonical import canonical_bytes, parse_json
from protocol.errors import OversizeError, ProtocolError, UnknownVersionError

log = logging.getLogger(__name__)

ANNOUNCEMENTS_PATH = "/v1/announcements"
MEDIA_TYPE = "application/json"
MAX_RESPONSE_BYTES = 4 << 20
MAX_ITEMS = 4096


@dataclass
class FetchResult:
    """What one read of another role's announcements did to our board."""

    outcomes: Counter[str] = field(default_factory=Counter)
    """Admitted envelopes by board outcome (`new`, `changed`, `refreshed`, `duplicate`)."""
    refused: Counter[str] = field(default_factory=Counter)
    """Refused envelopes by error code (`bad_signature`, `expired`, `not_believed`, ...)."""

    @property
    def admitted(self) -> int:
        return sum(self.outcomes.values())


def split_announcements(data: bytes, *, max_items: int = MAX_ITEMS) -> list[bytes]:
    """The envelopes of a `/v1/announcements` body, each re-encoded canonically (the signature is
    over the canonical form, so re-encoding cannot make a forgery pass). `ProtocolError` if the
    body is not a JSON list of objects."""
    items = parse_json(data)
    if not isinstance(items, list):
        raise ProtocolError("announcements must be a JSON list")
    if len(items) > max_items:
        raise OversizeError(f"{len(items)} announcements, limit {max_items}")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ProtocolError("each announcement must be a JSON object (an envelope)")
        out.append(canonical_bytes(item))
    return out


def ingest(envelopes: list[bytes], admission: Admission, board: AnnouncementBoard) -> FetchResult:
    """Admit each envelope onto `board` (a bad one is counted, never fatal to the rest)."""
    result = FetchResult()
    for wire in envelopes:
        try:
            obj = parse_json(wire)
            kind = obj.get("kind") if isinstance(obj, dict) else None
            topic = topic_of_kind(kind) if isinstance(kind, str) else None
            if topic is None:
                raise UnknownVersionError(f"not an announcement kind: {kind!r}")
            outcome = admit_to_board(admission, board, wire, topic=topic, source="http")
        except ProtocolError as exc:
            result.refused[exc.code] += 1
            continue
        result.outcomes[outcome.value] += 1
    if result.refused:
        log.info("announcements refused: %s", dict(result.refused))
    return result


def _url(base_url: str) -> str:
    return base_url.rstrip("/") + ANNOUNCEMENTS_PATH


def _check_size(declared: str | None, max_bytes: int) -> None:
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OversizeError(f"announcements are {declared} bytes, limit {max_bytes}")


def fetch_announcements(
    base_url: str,
    admission: Admission,
    board: AnnouncementBoard,
    *,
    timeout: float = 10.0,
    max_bytes: int = MAX_RESPONSE_BYTES,
    client: httpx.Client | None = None,
) -> FetchResult:
    """Read `base_url`'s `/v1/announcements` and admit them onto `board`.

    `DiscoveryError` when the server cannot be read; `ProtocolError` (`OversizeError`) when what
    it sent is not an announcement list.
    """
    own = client is None
    http = client or httpx.Client(timeout=timeout)
    try:
        with http.stream("GET", _url(base_url), headers={"accept": MEDIA_TYPE}) as resp:
            if resp.status_code != 200:
                raise DiscoveryError(f"{_url(base_url)} answered {resp.status_code}")
            _check_size(resp.headers.get("content-length"), max_bytes)
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise OversizeError(f"announcements exceed {max_bytes} bytes")
    except httpx.HTTPError as exc:
        raise DiscoveryError(f"cannot read {_url(base_url)}: {exc}") from exc
    finally:
        if own:
            http.close()
    return ingest(split_announcements(bytes(body)), admission, board)


async def afetch_announcements(
    base_url: str,
    admission: Admission,
    board: AnnouncementBoard,
    *,
    timeout: float = 10.0,
    max_bytes: int = MAX_RESPONSE_BYTES,
    client: httpx.AsyncClient | None = None,
) -> FetchResult:
    """`fetch_announcements` for asyncio callers (the checks run in a worker thread: the role's
    trust hooks may block)."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout)
    try:
        async with http.stream("GET", _url(base_url), headers={"accept": MEDIA_TYPE}) as resp:
            if resp.status_code != 200:
                raise DiscoveryError(f"{_url(base_url)} answered {resp.status_code}")
            _check_size(resp.headers.get("content-length"), max_bytes)
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise OversizeError(f"announcements exceed {max_bytes} bytes")
    except httpx.HTTPError as exc:
        raise DiscoveryError(f"cannot read {_url(base_url)}: {exc}") from exc
    finally:
        if own:
            await http.aclose()
    envelopes = split_announcements(bytes(body))
    return await asyncio.to_thread(ingest, envelopes, admission, board)
