"""`data.type = "validators"`: accepted work pulled from validators' signed feeds.

A validator serves `GET /v1/feed?after=<seq>&limit=<n>` (validator/app.py): a listing
`{"validator", "domain", "items": [{"seq", "work_key", "envelope"}], "next"}` whose items are
`FeedItem` envelopes it signed. Nothing in the listing is trusted: each item is opened with
`open_envelope` (our domain, the validator's address, `FeedItem` or, for multi-turn episodes,
`EpisodeFeedItem` only), its listed work key must be
the signed one, and its samples must be valid rollout samples. A refused item is logged and counted
(`rejected_files`), never trained on and never retried; a refused response (too large, not JSON,
wrong shape, items out of order) is counted the same way and asked for again at the next poll; an
unreachable validator is logged and polled again. None of these stops the trainer: only a step
that waits `wait_timeout_s` without enough fresh groups does (`DataStarvedError`).

Positions: a page carries `listing`, a `FeedPage` envelope in which the validator signs the `after` it
answers and each listed item's (seq, work key, SHA-256 of its envelope). A page whose listing does not
verify (missing, another signer, signed for another `after`, other items or positions than served) is
refused whole, so the cursor only ever moves to seqs the validator itself gave: a forged or edited
listing cannot push it past real work (issue 23 item 11). With `accepted` (no address per URL), the
first verified listing pins its signer for that URL. A validator signs a fresh listing for every request, so
a listing signed before the last one this source verified from that URL (or that very listing again) is a
replay, refused like a forgery: whoever sits between cannot keep serving an old, shorter page to starve the
trainer of a validator's newer work.

Bounds: a response is read up to `max_response_bytes` (Content-Length checked first, then counted
while reading, uncompressed bytes only) and within `request_timeout_s` from connect to last byte (a
`protocol.deadline` client: a trickled status line and headers are cut off too); a page holds at most the
`limit` asked for. A page refused as too large halves that validator's `limit` (down to 1). Validators
are read concurrently, one request in flight each: a hung one (accepts, never answers) delays neither the
others nor the step, and counts as unavailable once its request times out.

De-duplication: the same work (work key) may be served by several validators; it is trained once.
Keys are remembered with the item that first brought them (url, seq) and its policy version, and
forgotten once that version is outside the async window (a late copy would be dropped as stale).
Identical groups under different work keys (the same prompt tokens and the same completions, in any
order: cached answers replayed for a repeated task) are trained once too: a repeat is dropped and
listed as `duplicate` in the step's work (the work ledger), its fingerprint forgotten like the keys.

Position (exact resume): groups are consumed first-in first-out, so per validator the consumed part
is a prefix of its feed: `cursor` (every item with seq <= cursor is done: trained, dropped by the
window, refused or a duplicate) plus `partial` (how many leading groups of the next item are done).
Fetched but unconsumed items are not part of the position; a resumed run fetches them again. Only a
returned batch moves the position: a step that fails for lack of data puts its groups back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.canonical import parse_json, to_hex
from protocol.deadline import deadline_client, request_deadline
from protocol.envelope import Envelope, open_envelope
from protocol.episodes import EpisodeFeedItem
from protocol.errors import OversizeError, PrimeError, ProtocolError, SignatureError
from protocol.identity import checksum
from protocol.rollout import FeedItem, FeedPage, feed_item_hash
from protocol.rollout_files import feed_groups
from trainer.config import ValidatorsData
from trainer.source import Batch, DataStarvedError, Fill, Group, RolloutSource, window_verdict

log = logging.getLogger(__name__)

STATE_VERSION = 1
SLOW_FEED_S = 1.0
"""How long one poll waits for every validator's answer; a slower one's page is taken at a later poll."""


class FeedError(ProtocolError):
    """A validator's feed response or item is refused: wrong shape, out of order, or not what was signed."""

    code = "bad_feed"


class FeedUnavailableError(PrimeError):
    """A validator's feed could not be read (connection, timeout, HTTP status): polled again later."""

    code = "feed_unavailable"


class _AcceptAnyNonce:
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


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    seq: int = Field(ge=1, lt=2**63)
    work_key: str = Field(max_length=256)
    envelope: str


class _Page(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    validator: str = Field(max_length=256)
    domain: str = Field(max_length=256)
    items: list[_Entry]
    next: int = Field(ge=0)
    listing: str
    """A `FeedPage` envelope: the validator's signature over `after` and each item's (seq, work key, hash)."""


@dataclass
class _Item:
    """A fetched feed item's progress: groups handed out (or dropped) so far out of `total`."""

    seq: int
    total: int
    done: int = 0


@dataclass
class _Feed:
    """One validator: where to fetch next and which fetched items are not fully consumed yet."""

    url: str
    signer: str | None  # the expected signer; None: any of the source's accepted addresses
    limit: int
    lister: str | None = None  # who signs this URL's listings (pinned from the first verified page)
    listed_at: tuple[int, int] = (-1, -1)  # (timestamp_ms, nonce) of the newest verified listing: older is a replay
    cursor: int = 0  # committed: every item with seq <= cursor is done
    fetched: int = 0  # the next request's `after`
    skip: dict[int, int] = field(default_factory=dict)  # after a resume: seq -> leading groups already done
    items: deque[_Item] = field(default_factory=deque)  # fetched, seq > cursor, in seq order
    last_problem: str | None = None

    def advance(self) -> None:
        while self.items and self.items[0].done >= self.items[0].total:
            self.cursor = self.items.popleft().seq


@dataclass
class _Queued:
    feed: _Feed
    item: _Item
    group: Group
    work_key: str


class ValidatorFeedSource(RolloutSource):
    """Groups from one or more validators' feeds, checked, de-duplicated and windowed; see the module doc."""

    def __init__(
        self,
        urls: list[str],
        domain: str,
        *,
        addresses: list[str] | None = None,
        accepted: list[str] | None = None,
        run_id: str | None = None,
        poll_interval_s: float = 1.0,
        wait_timeout_s: float = 600.0,
        request_timeout_s: float = 10.0,
        page_items: int = 64,
        max_response_bytes: int = 64 << 20,
        max_item_bytes: int = 16 << 20,
        max_item_age_s: float = 30 * 86400.0,
        vocab_size: int | None = None,
    ) -> None:
        if bool(addresses) == bool(accepted):
            raise ValueError("give exactly one of addresses (one per url) or accepted")
        if addresses and len(addresses) != len(urls):
            raise ValueError(f"{len(addresses)} addresses for {len(urls)} urls")
        signers = [checksum(a) for a in addresses] if addresses else [None] * len(urls)
        self.accepted = frozenset(checksum(a) for a in accepted or ())
        self.feeds = [_Feed(u.rstrip("/"), s, page_items) for u, s in zip(urls, signers, strict=True)]
        self.domain = domain
        self.run_id = run_id
        self.poll_interval_s = poll_interval_s
        self.wait_timeout_s = wait_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_response_bytes = max_response_bytes
        self.max_item_bytes = max_item_bytes
        self.max_item_age_s = max_item_age_s
        self.vocab_size = vocab_size
        self.stats: Counter[str] = Counter()
        """Running totals: items, groups, duplicates (items), duplicate_groups, refused_<code> (items),
        refused_pages, unavailable."""
        self._seen: dict[str, tuple[str, int, int]] = {}  # work key -> (url, seq, policy version)
        self._groups: dict[str, int] = {}  # fingerprint of a trained group -> its policy version
        self._buffer: deque[_Queued] = deque()
        self._guard = _AcceptAnyNonce()
        # a validator that trickles its status line and headers is given up at request_timeout_s too
        self._http = deadline_client(request_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.feeds), thread_name_prefix="feed")
        self._inflight: dict[int, tuple[int, concurrent.futures.Future[_Page]]] = {}
        """Feed index -> (the `after` asked, the request): at most one request in flight per validator."""

    @classmethod
    def from_config(cls, cfg: ValidatorsData, vocab_size: int | None = None) -> ValidatorFeedSource:
        return cls(
            cfg.urls, cfg.envelope_domain(), addresses=cfg.addresses, accepted=cfg.accepted, run_id=cfg.run_id,
            poll_interval_s=cfg.poll_interval_s, wait_timeout_s=cfg.wait_timeout_s,
            request_timeout_s=cfg.request_timeout_s, page_items=cfg.page_items,
            max_response_bytes=cfg.max_response_bytes, max_item_bytes=cfg.max_item_bytes,
            max_item_age_s=cfg.max_item_age_s, vocab_size=vocab_size,
        )

    # -- RolloutSource ----------------------------------------------------------------------------

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:
        batch = Batch(groups=[])
        popped: list[_Queued] = []
        fresh: dict[str, int] = {}  # fingerprints first trained by this batch (kept only if it is returned)
        dropped = 0  # groups identical to trained ones
        fill = Fill.start(n_groups, min_groups, fill_timeout_s, expected)
        deadline = time.monotonic() + self.wait_timeout_s
        try:
            while True:
                while self._buffer and len(batch.groups) < n_groups:
                    q = self._buffer.popleft()
                    popped.append(q)
                    verdict = window_verdict(q.group, step, async_level)
                    if verdict == "ok":
                        fp = group_fingerprint(q.group)
                        if fp in self._groups or fp in fresh:
                            verdict = "duplicate"
                            dropped += 1
                            log.info("work %s: a group identical to one already trained; dropped", q.work_key)
                        else:
                            fresh[fp] = q.group[0].policy_version
                    keys = batch.work.setdefault("trained" if verdict == "ok" else verdict, [])
                    if q.work_key not in keys:
                        keys.append(q.work_key)
                    if verdict == "ok":
                        batch.groups.append(q.group)
                        batch.counts.accepted += len(q.group)
                    elif verdict == "stale":
                        batch.counts.stale += len(q.group)
                    elif verdict == "future":
                        batch.counts.future += len(q.group)
                if fill.done(len(batch.groups)):
                    break
                if time.monotonic() > deadline:
                    raise DataStarvedError(
                        f"step {step}: {len(batch.groups)}/{n_groups} fresh groups from {len(self.feeds)} "
                        f"validator(s) after {self.wait_timeout_s:.0f} s"
                    )
                wait = min(self.poll_interval_s, max(0.0, deadline - time.monotonic()), fill.wake_in(len(batch.groups)))
                if not self._poll(batch, wait):
                    time.sleep(wait)
        except BaseException:
            batch.work.clear()
            self._buffer.extendleft(reversed(popped))  # nothing of a failed step counts as consumed
            raise
        self._groups.update(fresh)
        self.stats["duplicate_groups"] += dropped
        for q in popped:
            q.item.done += 1
        for feed in self.feeds:
            feed.advance()
        self._forget_before(step - async_level)
        return batch

    def state_dict(self) -> dict[str, Any]:
        feeds = {}
        for f in self.feeds:
            head = f.items[0] if f.items else None
            partial = [head.seq, head.done] if head is not None and head.done > 0 else None
            feeds[f.url] = {"cursor": f.cursor, "partial": partial}
        return {
            "version": STATE_VERSION,
            "validators": feeds,
            "seen": {k: [url, seq, v] for k, (url, seq, v) in sorted(self._seen.items())},
            "groups": dict(sorted(self._groups.items())),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"validators source state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved = state["validators"]
        self._buffer.clear()
        for f in self.feeds:
            pos = saved.get(f.url, {"cursor": 0, "partial": None})
            f.cursor = f.fetched = int(pos["cursor"])
            f.items.clear()
            f.skip = {}
            if pos.get("partial") is not None:
                seq, done = (int(x) for x in pos["partial"])
                f.skip[seq] = done
        for url in set(saved) - {f.url for f in self.feeds}:
            log.warning("checkpoint names validator %s, which is no longer configured: its position is dropped", url)
        self._seen = {str(k): (str(u), int(s), int(v)) for k, (u, s, v) in state["seen"].items()}
        self._groups = {str(k): int(v) for k, v in state.get("groups", {}).items()}  # absent before issue 23

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a hung request ends at its own timeout
        self._http.close()

    def cursors(self) -> dict[str, int]:
        """Per validator URL: every feed item with seq <= this is done (trained, dropped or refused)."""
        return {f.url: f.cursor for f in self.feeds}

    def queued(self) -> list[str]:
        """Work keys fetched and admitted but not (fully) consumed yet, in feed order."""
        return list(dict.fromkeys(q.work_key for q in self._buffer))

    # -- fetching ---------------------------------------------------------------------------------

    def _poll(self, batch: Batch, wait_s: float = 0.0) -> bool:
        """A page from every validator that answers within `wait_s` (at least SLOW_FEED_S: healthy validators
        are then read in their configured order, which decides who a duplicate is taken from); True if any
        had new items (then poll again at once).

        Each validator's request runs on its own thread, at most one in flight per validator: one that hangs
        (accepts and never answers, or a byte a minute) keeps its request pending, up to `request_timeout_s`,
        while the others are read at every poll; its page, when it comes, is taken at a later poll.
        """
        for i, feed in enumerate(self.feeds):
            if i not in self._inflight:
                self._inflight[i] = (feed.fetched, self._pool.submit(self._page, feed, feed.fetched))
        futures = [f for _, f in self._inflight.values()]
        concurrent.futures.wait(futures, timeout=max(wait_s, SLOW_FEED_S), return_when=concurrent.futures.ALL_COMPLETED)
        got = False
        for i, feed in enumerate(self.feeds):
            after, future = self._inflight[i]
            if not future.done():
                continue
            del self._inflight[i]
            if after != feed.fetched:  # asked before a resume moved the position: not this position's page
                continue
            try:
                page = future.result()
            except FeedUnavailableError as exc:
                self.stats["unavailable"] += 1
                self._problem(feed, f"unavailable: {exc}")
                continue
            except ProtocolError as exc:
                self.stats["refused_pages"] += 1
                batch.counts.rejected_files += 1
                if isinstance(exc, OversizeError) and feed.limit > 1:
                    feed.limit = max(1, feed.limit // 2)
                    self._problem(feed, f"refused response ({exc.code}): {exc}; asking for {feed.limit} items")
                else:
                    self._problem(feed, f"refused response ({exc.code}): {exc}")
                continue
            if feed.last_problem is not None:
                log.info("validator %s: feed readable again", feed.url)
                feed.last_problem = None
            if page.items and page.domain != self.domain:  # a hint for the operator; items are checked anyway
                log.warning("validator %s serves domain %r, this run is %r", feed.url, page.domain, self.domain)
            for entry in page.items:
                self._admit(feed, entry, batch)
                feed.fetched = entry.seq
            feed.advance()
            got = got or bool(page.items)
        return got

    def _problem(self, feed: _Feed, what: str) -> None:
        # A validator that stays down must not fill the log once per poll: warn when the problem changes.
        (log.debug if what == feed.last_problem else log.warning)("validator %s: %s", feed.url, what)
        feed.last_problem = what

    def _page(self, feed: _Feed, after: int) -> _Page:
        data = self._get(feed.url + "/v1/feed", {"after": after, "limit": feed.limit})
        try:
            page = _Page.model_validate(parse_json(data))
        except ValidationError as exc:
            raise FeedError(f"malformed feed page: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
        if len(page.items) > feed.limit:
            raise FeedError(f"{len(page.items)} items, asked for at most {feed.limit}")
        seqs = [e.seq for e in page.items]
        if any(b <= a for a, b in zip([after, *seqs], seqs, strict=False)):
            raise FeedError(f"item seqs {seqs[:8]} not increasing after {after}")
        self._check_listing(feed, page, after)
        return page

    def _check_listing(self, feed: _Feed, page: _Page, after: int) -> None:
        """The page must be exactly what its validator signed for this request: the cursor moves to listed
        seqs, so an unsigned position (a forged entry, a proxy's edit, a page replayed for another `after`)
        would let whoever answers skip real work for good."""
        envelope = Envelope.from_bytes(page.listing.encode(), max_bytes=self.max_response_bytes)
        signer = feed.signer or feed.lister
        body = open_envelope(envelope, domain=self.domain, replay_guard=self._guard, expected_signer=signer,
                             body_types=[FeedPage], max_age_s=self.max_item_age_s)
        assert isinstance(body, FeedPage)
        if signer is None:
            if envelope.signer not in self.accepted:
                raise SignatureError(f"listing signed by {envelope.signer}, not an accepted validator")
            feed.lister = envelope.signer  # one URL, one validator's seq space
        if body.after != after:
            raise FeedError(f"listing signed for after={body.after}, asked after={after}")
        signed_at = (envelope.timestamp_ms, envelope.nonce)
        if envelope.timestamp_ms < feed.listed_at[0] or signed_at == feed.listed_at:
            raise FeedError(f"listing signed at {envelope.timestamp_ms} ms, not after the last one verified from "
                            f"this validator ({feed.listed_at[0]} ms): a replayed page")
        listed = [(e.seq, to_hex(e.work_key), to_hex(e.item_hash)) for e in body.entries]
        served = [(e.seq, e.work_key, to_hex(feed_item_hash(e.envelope.encode()))) for e in page.items]
        if listed != served:
            raise FeedError(f"the items served are not the signed listing ({len(served)} served, {len(listed)} "
                            "signed)")
        feed.listed_at = signed_at

    def _get(self, url: str, params: dict[str, int]) -> bytes:
        """The response body, refused unread past `max_response_bytes` or `request_timeout_s`."""
        limit, start = self.max_response_bytes, time.monotonic()
        try:
            # identity encoding: a compressed body could expand far past the limit inside one chunk
            with request_deadline(self.request_timeout_s), \
                    self._http.stream("GET", url, params=params, headers={"accept-encoding": "identity"}) as resp:
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
                    if time.monotonic() - start > self.request_timeout_s:
                        raise FeedUnavailableError(f"response slower than {self.request_timeout_s} s")
                return bytes(body)
        except httpx.HTTPError as exc:
            raise FeedUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    def _admit(self, feed: _Feed, entry: _Entry, batch: Batch) -> None:
        """Open one listed item; queue its groups, or record it as refused or duplicate (done)."""
        try:
            item = self._open(feed, entry)
            groups = feed_groups(item)
            for g in groups:
                for s in g:
                    s.validate(self.vocab_size)
        except ProtocolError as exc:  # SignatureError, DomainError, ExpiredError, RolloutError, FeedError, ...
            self.stats[f"refused_{exc.code}"] += 1
            batch.counts.rejected_files += 1
            log.warning("refused feed item %d from %s (%s): %s", entry.seq, feed.url, exc.code, exc)
            feed.items.append(_Item(entry.seq, 0))
            return
        key = entry.work_key
        owner = self._seen.get(key)
        if owner is not None and owner[:2] != (feed.url, entry.seq):
            self.stats["duplicates"] += 1
            log.debug("feed item %d from %s: work %s already taken from %s #%d", entry.seq, feed.url, key, *owner[:2])
            feed.items.append(_Item(entry.seq, 0))
            return
        self._seen[key] = (feed.url, entry.seq, item.policy_version)
        done = feed.skip.pop(entry.seq, 0)  # groups consumed before a resume
        record = _Item(entry.seq, len(groups), done)
        feed.items.append(record)
        self._buffer.extend(_Queued(feed, record, g, key) for g in groups[done:])
        self.stats["items"] += 1
        self.stats["groups"] += len(groups) - done

    def _open(self, feed: _Feed, entry: _Entry) -> FeedItem | EpisodeFeedItem:
        envelope = Envelope.from_bytes(entry.envelope.encode(), max_bytes=self.max_item_bytes)
        body = open_envelope(
            envelope,
            domain=self.domain,
            replay_guard=self._guard,
            expected_signer=feed.signer,
            body_types=[FeedItem, EpisodeFeedItem],
            max_age_s=self.max_item_age_s,
        )
        assert isinstance(body, FeedItem | EpisodeFeedItem)
        if feed.signer is None and envelope.signer not in self.accepted:
            raise SignatureError(f"signed by {envelope.signer}, not an accepted validator")
        if to_hex(body.work_key) != entry.work_key:
            raise FeedError(f"listed as work {entry.work_key[:80]!r}, the signed item is {to_hex(body.work_key)}")
        if self.run_id is not None and body.run_id != self.run_id:
            raise FeedError(f"item of run {body.run_id!r}, this is run {self.run_id!r}")
        return body

    def _forget_before(self, version: int) -> None:
        """Forget work keys whose policy version no step from now on can accept (a copy would be stale)."""
        for key in [k for k, (_, _, v) in self._seen.items() if v < version]:
            del self._seen[key]
        for fp in [f for f, v in self._groups.items() if v < version]:
            del self._groups[fp]


def group_fingerprint(group: Group) -> str:
    """SHA-256 of a group's token sequences (prompt and completion), sorted: equal for identical groups."""
    h = hashlib.sha256()
    for tokens in sorted(tuple(s.tokens) for s in group):
        h.update(len(tokens).to_bytes(4, "big"))
        h.update(b"".join(t.to_bytes(4, "big") for t in tokens))
    return h.hexdigest()
