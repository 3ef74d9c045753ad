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

Bounds (`trainer/feed_wire.py` reads): a response is read up to `max_response_bytes` (Content-Length checked
first, then counted while reading, uncompressed bytes only) and within `request_timeout_s` from connect to last byte (a
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

On chain (with `chain`, a `trainer.recorded_work.RecordedWork`): a signature says a validator accepted the
work; only the pool's `WorkRecorded` says the acceptance stands. An item is trained only when the chain shows
its work key recorded by the validator that signed it and not invalidated since. One recorded by another
validator, or invalidated, is refused, counted (`rejected_files`, `refused_other_validator`,
`refused_invalidated`) and logged once. One not recorded yet is held (validators record in batches): not
trained, not refused, re-checked at every poll, until the chain shows it (then trained or refused) or its
policy version leaves the async window (then dropped as stale, like any late group). The chain is read once per
poll that has something to decide (one incremental event read, not one per item); a chain that does not answer
holds every undecided item, is logged when its problem changes, and is asked again at the next poll.

Position (exact resume): groups are consumed first-in first-out, so per validator the consumed part
is a prefix of its feed except for held items, which later items overtake: `cursor` (every item with
seq <= cursor is done: trained, dropped by the window, refused or a duplicate), `partial` (how many leading
groups of the next item are done), and past a held item `finished` (seqs done) and `started` (seq -> groups
done). A held item is not done: the cursor stops before it. Fetched but unconsumed items are not part of
the position; a resumed run fetches them again. Only a returned batch moves the position: a step that fails
for lack of data puts its groups back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from protocol.canonical import parse_json, to_hex
from protocol.deadline import deadline_client
from protocol.envelope import Envelope, open_envelope
from protocol.episodes import EpisodeFeedItem
from protocol.errors import ChainError, ConfigError, OversizeError, ProtocolError, SignatureError
from protocol.identity import checksum
from protocol.rollout import FeedItem, FeedPage, feed_item_hash
from protocol.rollout_files import feed_groups
from trainer.config import ValidatorsData
from trainer.feed_wire import (
    AcceptAnyNonce,
    FeedError,
    FeedUnavailableError,
    ListedItem,
    ListingPage,
    read_capped,
)
from trainer.recorded_work import OnChain, RecordedWork
from trainer.source import Batch, DataStarvedError, Fill, Group, RolloutSource, window_verdict

log = logging.getLogger(__name__)

STATE_VERSION = 1
SLOW_FEED_S = 1.0
"""How long one poll waits for every validator's answer; a slower one's page is taken at a later poll."""


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
    finished: set[int] = field(default_factory=set)  # after a resume: seqs past a held item that were done
    items: deque[_Item] = field(default_factory=deque)  # fetched, seq > cursor, in seq order
    last_problem: str | None = None

    def advance(self) -> None:
        while self.items and self.items[0].done >= self.items[0].total:
            self.cursor = self.items.popleft().seq


@dataclass
class _Held:
    """A fetched item whose work key the chain does not show recorded yet (or a chain that did not answer)."""

    feed: _Feed
    item: _Item
    work_key: str
    signer: str
    policy_version: int
    groups: list[Group]


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
        chain: RecordedWork | None = None,
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
        self.chain = chain
        """The pool's record of accepted work; None trusts every signed item (no chain configured)."""
        if chain is None:
            log.warning("data.chain is not set: feed items are trained on a validator's signature alone, "
                        "without checking that the chain shows the work accepted by it")
        self.stats: Counter[str] = Counter()
        """Running totals: items, groups, duplicates (items), duplicate_groups, refused_<code> (items),
        refused_pages, unavailable, held (items that waited for the chain), chain_unavailable (failed reads)."""
        self._held: list[_Held] = []
        self._chain_problem: str | None = None
        self._seen: dict[str, tuple[str, int, int]] = {}  # work key -> (url, seq, policy version)
        self._groups: dict[str, int] = {}  # fingerprint of a trained group -> its policy version
        self._buffer: deque[_Queued] = deque()
        self._guard = AcceptAnyNonce()
        # a validator that trickles its status line and headers is given up at request_timeout_s too
        self._http = deadline_client(request_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.feeds), thread_name_prefix="feed")
        self._inflight: dict[int, tuple[int, concurrent.futures.Future[ListingPage]]] = {}
        """Feed index -> (the `after` asked, the request): at most one request in flight per validator."""

    @classmethod
    def from_config(cls, cfg: ValidatorsData, vocab_size: int | None = None) -> ValidatorFeedSource:
        chain = None
        if cfg.chain is not None:
            from contracts.deployment import Deployment
            from contracts.pool import PoolClient
            from contracts.transactor import Transactor, connect
            from protocol.identity import Identity

            deployment = Deployment.load(cfg.chain.deployment)
            if cfg.pool is not None and checksum(cfg.pool) != checksum(deployment.pool) or \
                    cfg.chain_id is not None and cfg.chain_id != deployment.chain_id:
                raise ConfigError(f"data.chain.deployment is pool {deployment.pool} on chain {deployment.chain_id}, "
                                  f"data names pool {cfg.pool} on chain {cfg.chain_id}")
            w3 = connect(cfg.chain.rpc_url, timeout=cfg.request_timeout_s)
            reader = Identity.create()  # reads only: it never signs a transaction
            pool = PoolClient(w3, deployment.pool, reader, Transactor(w3, reader, retries=0))
            chain = RecordedWork(pool, deployment.start_block)
        return cls(
            cfg.urls, cfg.envelope_domain(), addresses=cfg.addresses, accepted=cfg.accepted, run_id=cfg.run_id,
            poll_interval_s=cfg.poll_interval_s, wait_timeout_s=cfg.wait_timeout_s,
            request_timeout_s=cfg.request_timeout_s, page_items=cfg.page_items,
            max_response_bytes=cfg.max_response_bytes, max_item_bytes=cfg.max_item_bytes,
            max_item_age_s=cfg.max_item_age_s, vocab_size=vocab_size, chain=chain,
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
                if not self._poll(batch, wait, step - async_level):
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
        feeds: dict[str, dict[str, Any]] = {}
        for f in self.feeds:
            head = f.items[0] if f.items else None
            partial = [head.seq, head.done] if head is not None and head.done > 0 else None
            # past a held item, later items may be done already: a resumed run must not take them again
            finished = [i.seq for i in f.items if i.done >= i.total]
            started = {str(i.seq): i.done for i in f.items if 0 < i.done < i.total and i is not head}
            feeds[f.url] = {"cursor": f.cursor, "partial": partial}
            if finished:
                feeds[f.url]["finished"] = finished
            if started:
                feeds[f.url]["started"] = started
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
        self._held.clear()
        for f in self.feeds:
            pos = saved.get(f.url, {"cursor": 0, "partial": None})
            f.cursor = f.fetched = int(pos["cursor"])
            f.items.clear()
            f.skip = {}
            if pos.get("partial") is not None:
                seq, done = (int(x) for x in pos["partial"])
                f.skip[seq] = done
            f.skip.update({int(s): int(d) for s, d in pos.get("started", {}).items()})  # absent before issue 35
            f.finished = {int(s) for s in pos.get("finished", [])}
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

    def held(self) -> list[str]:
        """Work keys fetched and waiting for the chain to show them recorded by their signer, in fetch order."""
        return [h.work_key for h in self._held]

    # -- fetching ---------------------------------------------------------------------------------

    def _poll(self, batch: Batch, wait_s: float = 0.0, floor: int = 0) -> bool:
        """A page from every validator that answers within `wait_s` (at least SLOW_FEED_S: healthy validators
        are then read in their configured order, which decides who a duplicate is taken from); True if any
        had new items (then poll again at once).

        Each validator's request runs on its own thread, at most one in flight per validator: one that hangs
        (accepts and never answers, or a byte a minute) keeps its request pending, up to `request_timeout_s`,
        while the others are read at every poll; its page, when it comes, is taken at a later poll.

        Held items are decided after the pages are read, with one chain read for all of them and the new items;
        `floor` is the oldest policy version the step can take (an item still held below it is dropped as stale).
        """
        for i, feed in enumerate(self.feeds):
            if i not in self._inflight:
                self._inflight[i] = (feed.fetched, self._pool.submit(self._page, feed, feed.fetched))
        futures = [f for _, f in self._inflight.values()]
        concurrent.futures.wait(futures, timeout=max(wait_s, SLOW_FEED_S), return_when=concurrent.futures.ALL_COMPLETED)
        got = False
        pages: list[tuple[_Feed, ListingPage]] = []
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
            pages.append((feed, page))
        fresh = self._read_chain() if self._held or any(p.items for _, p in pages) else False
        if self._held:
            got = self._decide_held(batch, fresh, floor)
        for feed, page in pages:
            for entry in page.items:
                self._admit(feed, entry, batch, fresh)
                feed.fetched = entry.seq
            got = got or bool(page.items)
        for feed in self.feeds:
            feed.advance()
        return got

    def _read_chain(self) -> bool:
        """One incremental read of the pool's work events; False (logged when the problem changes) if the chain
        did not answer: then nothing is decided on it at this poll."""
        if self.chain is None:
            return True
        try:
            self.chain.refresh()
        except ChainError as exc:
            self.stats["chain_unavailable"] += 1
            what = f"{exc.code}: {exc}"
            (log.debug if what == self._chain_problem else log.warning)(
                "chain unreadable, feed items wait for it (%d held): %s", len(self._held), what)
            self._chain_problem = what
            return False
        if self._chain_problem is not None:
            log.info("chain readable again (block %d)", self.chain.block)
            self._chain_problem = None
        return True

    def _decide_held(self, batch: Batch, fresh: bool, floor: int) -> bool:
        """Release the held items the chain now shows (queued or refused) and those the window has left (queued:
        the step drops them as stale); True if any was released."""
        keep: list[_Held] = []
        for h in self._held:
            status = OnChain.UNKNOWN
            if fresh and self.chain is not None:
                status = self.chain.status(bytes.fromhex(h.work_key[2:]), h.signer)
            if status is OnChain.ACCEPTED or (status is OnChain.UNKNOWN and h.policy_version < floor):
                self._take(h.feed, h.item, h.work_key, h.policy_version, h.groups)
            elif status is not OnChain.UNKNOWN:
                self._refuse_on_chain(h.feed, h.item, h.work_key, h.signer, status, batch)
            else:
                keep.append(h)
        released = len(keep) < len(self._held)
        self._held = keep
        return released

    def _problem(self, feed: _Feed, what: str) -> None:
        # A validator that stays down must not fill the log once per poll: warn when the problem changes.
        (log.debug if what == feed.last_problem else log.warning)("validator %s: %s", feed.url, what)
        feed.last_problem = what

    def _page(self, feed: _Feed, after: int) -> ListingPage:
        data = read_capped(self._http, feed.url + "/v1/feed", {"after": after, "limit": feed.limit},
                           self.max_response_bytes, self.request_timeout_s)
        try:
            page = ListingPage.model_validate(parse_json(data))
        except ValidationError as exc:
            raise FeedError(f"malformed feed page: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
        if len(page.items) > feed.limit:
            raise FeedError(f"{len(page.items)} items, asked for at most {feed.limit}")
        seqs = [e.seq for e in page.items]
        if any(b <= a for a, b in zip([after, *seqs], seqs, strict=False)):
            raise FeedError(f"item seqs {seqs[:8]} not increasing after {after}")
        self._check_listing(feed, page, after)
        return page

    def _check_listing(self, feed: _Feed, page: ListingPage, after: int) -> None:
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

    def _admit(self, feed: _Feed, entry: ListedItem, batch: Batch, fresh: bool = True) -> None:
        """Open one listed item; queue its groups, hold it for the chain, or record it as refused or duplicate
        (done). `fresh`: the chain was read at this poll (else the item is held)."""
        if entry.seq in feed.finished:  # done before a resume (past an item that was held then)
            feed.finished.discard(entry.seq)
            feed.items.append(_Item(entry.seq, 0))
            return
        try:
            item, signer = self._open(feed, entry)
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
        record = _Item(entry.seq, len(groups), feed.skip.pop(entry.seq, 0))  # groups consumed before a resume
        feed.items.append(record)
        if self.chain is not None:
            status = self.chain.status(bytes.fromhex(key[2:]), signer) if fresh else OnChain.UNKNOWN
            if status is OnChain.UNKNOWN:
                self.stats["held"] += 1
                log.info("feed item %d from %s: work %s is not recorded on chain by %s yet; held",
                         entry.seq, feed.url, key, signer)
                self._held.append(_Held(feed, record, key, signer, item.policy_version, groups))
                return
            if status is not OnChain.ACCEPTED:
                self._refuse_on_chain(feed, record, key, signer, status, batch)
                return
        self._take(feed, record, key, item.policy_version, groups)

    def _take(self, feed: _Feed, record: _Item, key: str, version: int, groups: list[Group]) -> None:
        """Queue an admitted item's groups not consumed yet, or mark it done as a duplicate of work already taken."""
        owner = self._seen.get(key)
        if owner is not None and owner[:2] != (feed.url, record.seq):
            self.stats["duplicates"] += 1
            log.debug("feed item %d from %s: work %s already taken from %s #%d", record.seq, feed.url, key, *owner[:2])
            record.total = 0
            return
        self._seen[key] = (feed.url, record.seq, version)
        self._buffer.extend(_Queued(feed, record, g, key) for g in groups[record.done:])
        self.stats["items"] += 1
        self.stats["groups"] += len(groups) - record.done

    def _refuse_on_chain(self, feed: _Feed, record: _Item, key: str, signer: str, status: OnChain,
                         batch: Batch) -> None:
        """An item whose signer the chain does not back (recorded by another validator, or invalidated): done,
        never trained, counted and logged once."""
        record.total = 0
        owner = self._seen.get(key)
        if owner is not None and owner[:2] != (feed.url, record.seq):  # taken from the validator that recorded it
            self.stats["duplicates"] += 1
            return
        self.stats[f"refused_{status.value}"] += 1
        batch.counts.rejected_files += 1
        log.warning("refused feed item %d from %s: work %s signed by %s is %s on chain", record.seq, feed.url, key,
                    signer, "recorded by another validator" if status is OnChain.OTHER_VALIDATOR else "invalidated")

    def _open(self, feed: _Feed, entry: ListedItem) -> tuple[FeedItem | EpisodeFeedItem, str]:
        """The signed item and its signer."""
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
        return body, checksum(envelope.signer)

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
