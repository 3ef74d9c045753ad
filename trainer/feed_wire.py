"""What a validator's `GET /v1/feed` answer is on the wire, and how it is read: bounded in bytes and time.

Nothing here is trusted: `trainer/validator_feed.py` checks the signed listing and every item's envelope.
Identity encoding only (a compressed body could expand far past the limit inside one chunk); Content-Length
checked first, then the bytes counted while reading.
"""

from __future__ import annotations

import time

import httpx
from pydantic import BaseModel, ConfigDict, Field

from protocol.deadline import request_deadline
from protocol.errors import OversizeError, PrimeError, ProtocolError


class FeedError(ProtocolError):
    """A validator's feed response or item is refused: wrong shape, out of order, or not what was signed."""

    code = "bad_feed"


class FeedUnavailableError(PrimeError):
    """A validator's feed could not be read (connection, timeout, HTTP status): polled again later."""

    code = "feed_unavailable"


class AcceptAnyNonce:
    """The replay guard `open_envelope` is given for feed items: it accepts every nonce.

    A replay guard stops a message from being acted on twice. Here the action is training on a
    piece of work, and that is de-duplicated by work key, which is stronger: it also catches the same
    work under different envelopes (two validators, a re-sealed item). A nonce seen-set would instead
    refuse the legitimate second fetch of an item after a resume (or after a failed step).
    """

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, sent_at: float, expires_at: float, now: float | None = None
    ) -> None:
        return None


class ListedItem(BaseModel):
    """One listed item of a feed page: its seq, the work key it claims, the `FeedItem` envelope (checked later)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    seq: int = Field(ge=1, lt=2**63)
    work_key: str = Field(max_length=256)
    envelope: str


class ListingPage(BaseModel):
    """A `GET /v1/feed` answer as parsed, nothing in it trusted yet."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    validator: str = Field(max_length=256)
    domain: str = Field(max_length=256)
    items: list[ListedItem]
    next: int = Field(ge=0)
    listing: str
    """A `FeedPage` envelope: the validator's signature over `after` and each item's (seq, work key, hash)."""


def read_capped(http: httpx.Client, url: str, params: dict[str, int], limit: int, timeout_s: float) -> bytes:
    """The response body of GET `url`, refused unread past `limit` bytes or `timeout_s` (connect to last byte)."""
    start = time.monotonic()
    try:
        # identity encoding: a compressed body could expand far past the limit inside one chunk
        with request_deadline(timeout_s), \
                http.stream("GET", url, params=params, headers={"accept-encoding": "identity"}) as resp:
            if resp.status_code != 200:
                raise FeedUnavailableError(f"HTTP {resp.status_code}")
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise FeedError(f"content-encoding {encoding[:32]!r} (asked for identity)")
            declared = resp.headers.get("content-length")
            if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > limit):
                raise OversizeError(f"Content-Length {declared[:32]!r}, limit {limit} bytes")
            body = bytearray()
            for chunk in resp.iter_raw():
                body += chunk
                if len(body) > limit:
                    raise OversizeError(f"response over {limit} bytes")
                if time.monotonic() - start > timeout_s:
                    raise FeedUnavailableError(f"response slower than {timeout_s} s")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise FeedUnavailableError(f"{type(exc).__name__}: {exc}") from exc
