"""The validator's HTTP API (FastAPI). Every route is a thin call into `Service`; OpenAPI at `/docs`."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol import info_proof, pool_notes
from protocol.config import ShardcastWeights
from protocol.envelope import seal
from protocol.errors import PrimeError, ProtocolError, SignatureError
from protocol.identity import checksum
from protocol.nonce import random_nonce
from protocol.rollout import FeedEntry, FeedPage, feed_item_hash
from validator.chainview import CATCHUP_S
from validator.gate import Gate, Lane, SlotPool
from validator.intake import row_status
from validator.peers import PROBE_PATH
from validator.poolview import StaleNotesError
from validator.ratelimit import KeyedBuckets
from validator.service import Service

if TYPE_CHECKING:
    from validator.announcer import Announcer

log = logging.getLogger(__name__)

_HEX32 = re.compile(r"^0x[0-9a-f]{64}$")
INFO_REFRESH_S = 0.5
"""How often the `/v1/info` snapshot is rebuilt (off the event loop)."""
METRICS_CACHE_S = 1.0
AUDIT_HOLD_PER_ADDRESS = 8
"""Refused full audits one address may have held at a time (answered after their wait, not at once): a closed loop
over one keep-alive connection then asks about once per token interval instead of as fast as 429s come back."""
AUDIT_HOLD_TOTAL = 256
"""Refused full audits held at a time from all addresses: far below `gate.max_connections`, so held requests never
take the connections honest nodes need; past either bound a refusal is answered at once."""
AUDIT_HOLD_MAX_S = 1.0
"""The longest a refused full audit is held (the wait for a token, at most this)."""


class _Metrics(Collector):
    def __init__(self, service: Service, announcer: Announcer | None) -> None:
        self.service = service
        self.announcer = announcer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = GaugeMetricFamily("prime_validator_events", "Counts since start, by event", labels=["event"])
        for name, n in sorted(self.service.core.stats.snapshot().items()):
            stats.add_metric([name], n)
        yield stats
        rows = GaugeMetricFamily("prime_validator_ledger_rows", "Ledger rows by state and outcome", labels=["kind"])
        for name, n in sorted(self.service.ledger.counts().items()):
            rows.add_metric([name], n)
        yield rows
        yield GaugeMetricFamily("prime_validator_reported", "Rows reported on chain since start",
                                value=self.service.reporter.reported)
        yield GaugeMetricFamily("prime_validator_chain_failures", "Failed chain transactions since start",
                                value=self.service.reporter.failures)
        stuck = GaugeMetricFamily("prime_validator_unreportable", "Verdicts given up since start because the chain "
                                  "refuses them for good, by revert reason", labels=["reason"])
        for name, n in sorted(self.service.reporter.unreportable.items()):
            stuck.add_metric([name], n)
        yield stuck
        yield GaugeMetricFamily("prime_validator_report_deferred", "Verdicts whose transaction reverted for a reason "
                                "that may pass, set aside to retry later, since start",
                                value=self.service.reporter.deferred)
        yield GaugeMetricFamily("prime_validator_feed_items", "Accepted submissions in the trainer feed",
                                value=self.service.ledger.feed_size())
        current = self.service.chain.current_version()
        yield GaugeMetricFamily("prime_validator_policy_version", "Newest policy version on chain",
                                value=-1 if current is None else current)
        if self.announcer is not None:
            gossip = GaugeMetricFamily("prime_validator_discovery", "Announcements admitted or dropped since start",
                                       labels=["event"])
            for name, n in sorted(self.announcer.discovery.stats().items()):
                gossip.add_metric([name], n)
            yield gossip


def _key(value: str) -> str:
    value = value.lower()
    if not _HEX32.match(value):
        raise HTTPException(400, "expected a 0x-prefixed 32-byte hex string")
    return value


def build_app(service: Service) -> FastAPI:
    cfg = service.cfg
    announcer: Announcer | None = None
    if cfg.discovery.active:  # libp2p is imported only when discovery is on
        from validator.announcer import Announcer

        announcer = Announcer(service)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if announcer is not None:
            await asyncio.to_thread(announcer.start)
        info_snapshot.append(await asyncio.to_thread(info_bytes))
        refresher = asyncio.create_task(refresh_info())
        try:
            yield
        finally:
            refresher.cancel()
            if announcer is not None:
                await asyncio.to_thread(announcer.stop)

    app = FastAPI(title="prime-validator", version="1", lifespan=lifespan, description=(
        "Checks nodes' signed rollouts (TOPLOC, sampling replay, rewards), records verdicts, slashes bad work "
        "on chain and serves accepted rollouts to trainers."))
    registry = CollectorRegistry()
    registry.register(_Metrics(service, announcer))

    @dataclass
    class Admission:
        """The gate and its lanes (built on first use: building the app reads only `service.cfg`, so the docs'
        OpenAPI page can be made from a stand-in)."""

        gate: Gate
        staked: SlotPool
        submissions: Lane
        probe: Lane
        notes: Lane
        appeals: Lane
        intake_threads: anyio.CapacityLimiter
        """Threads of their own: a flood of audits or status reads never takes the threads intake needs, and
        intake never more than its slots."""
        appeal_threads: anyio.CapacityLimiter

    @functools.cache
    def admission() -> Admission:
        gate = Gate(cfg.gate, domain=service.domain, validator=service.identity.address, stats=service.core.stats)
        staked = SlotPool(cfg.flood.max_concurrent, cfg.gate.slots_per_node)
        run_validators = {checksum(a) for a in service.core.assignment.validators()}

        def catchup_retry_s() -> float:
            return service.chain.retry_after_s(CATCHUP_S)

        return Admission(
            gate, staked,
            submissions=Lane(path="/v1/submissions", pool=staked, max_bytes=cfg.max_submission_bytes, anonymous=True,
                             standing=service.chain.node_active,
                             slow_standing=lambda signer, at: service.chain.node_active_fresh(signer, CATCHUP_S, at),
                             retry_after_s=catchup_retry_s),
            # A peer's probe takes a slot of the same pool a staked node's submission would: a validator whose
            # intake is full answers it 503 and counts as down for its peers (`validator.peers`).
            probe=Lane(path=PROBE_PATH, pool=staked, max_bytes=1024, standing=run_validators.__contains__,
                       what="intake probes"),
            # a peer's pushed notes: one upload per peer at a time, read only once its header proves a run validator
            notes=Lane(path=pool_notes.PATH, pool=SlotPool(max(1, len(run_validators)), 1),
                       max_bytes=pool_notes.MAX_NOTES_BYTES, standing=run_validators.__contains__, what="pool notes"),
            appeals=Lane(path="/v1/appeals", pool=SlotPool(cfg.appeals.max_concurrent, 1),
                         max_bytes=cfg.appeals.max_appeal_bytes, standing=service.chain.known_or_operator, what="appeals",
                         slow_standing=lambda s, at: service.chain.fresh(service.chain.known_or_operator, s, CATCHUP_S,
                                                                         at),
                         retry_after_s=catchup_retry_s),
            intake_threads=anyio.CapacityLimiter(cfg.flood.max_concurrent + cfg.gate.anonymous_slots),
            appeal_threads=anyio.CapacityLimiter(cfg.appeals.max_concurrent))

    @app.post("/v1/submissions", status_code=202, summary="Submit one signed Submission envelope (raw bytes), with "
                                                          "the signed upload header")
    async def submit(request: Request) -> Response:
        upload = await admission().gate.admit(request, admission().submissions)
        if isinstance(upload, Response):
            return upload
        try:
            service.core.stats.count("submissions_signed" if upload.signer else "submissions_anonymous")
            answer = await anyio.to_thread.run_sync(service.core.intake.receive, upload.body, limiter=admission().intake_threads)
        finally:
            upload.release()
        if answer.status == 202:
            service.wake()
        return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)

    @app.post(PROBE_PATH, summary="A peer validator asks whether intake would take a staked upload now (its signed "
                                  "upload header, an empty body): 200, or 503 when no slot or no backlog room is free")
    async def intake_probe(request: Request) -> Response:
        upload = await admission().gate.admit(request, admission().probe)
        if isinstance(upload, Response):
            return upload
        try:
            backlog = await anyio.to_thread.run_sync(service.ledger.backlog, limiter=admission().intake_threads)
        finally:
            upload.release()
        if backlog >= cfg.flood.max_backlog:
            return JSONResponse({"error": "overloaded", "detail": f"backlog {backlog} (limit {cfg.flood.max_backlog})"},
                                status_code=503, headers={"Retry-After": "1"})
        staked = admission().staked
        return JSONResponse({"validator": service.identity.address, "slots_in_use": staked.in_use,
                             "slots": staked.total})

    @app.post("/v1/appeals", summary="Appeal another validator's hard verdict (a signed Appeal envelope, raw bytes, "
                                     "with the appellant's signed upload header)")
    async def appeal(request: Request) -> Response:
        upload = await admission().gate.admit(request, admission().appeals)
        if isinstance(upload, Response):
            return upload
        try:
            answer = await anyio.to_thread.run_sync(service.appeals.handle, upload.body, limiter=admission().appeal_threads)
        finally:
            upload.release()
        return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)

    @app.get("/v1/appeals/{work_key}", summary="This validator's decision on the appeal of one work key")
    def appeal_status(work_key: str) -> dict[str, Any]:
        row = service.ledger.appeal(_key(work_key))
        if row is None:
            raise HTTPException(404, "no appeal decided here for this work key")
        return service.appeals.status(row)

    @app.get("/v1/submissions/{work_key}", summary="State, verdict, reason and raw measurements of one assignment")
    def submission(work_key: str) -> dict[str, Any]:
        row = service.ledger.get(_key(work_key))
        if row is None:
            raise HTTPException(404, "no submission with this work key")
        return row_status(row)

    @app.get("/v1/submissions", summary="Submissions received after a time (unix seconds), oldest first: "
                                        "node, version, received and decided times, outcome and reason")
    def submissions(after: float = 0.0, limit: int = 1000) -> dict[str, Any]:
        if not math.isfinite(after) or not 1 <= limit <= 10_000:
            raise HTTPException(400, "after must be finite and 1 <= limit <= 10000")
        items = service.ledger.timeline(after, limit)
        return {"items": items, "next": items[-1]["received_at"] if items else after}

    @app.get("/v1/nodes/{address}", summary="Verdict counts by outcome and reason for one node")
    def node(address: str) -> dict[str, Any]:
        try:
            address = checksum(address)
        except Exception as exc:  # noqa: BLE001 - any malformed address is the client's 400
            raise HTTPException(400, "not an address") from exc
        summary = service.ledger.node_summary(address)
        summary["active_on_chain"] = service.chain.node_active(address)
        return summary

    def info_now() -> dict[str, Any]:
        current = service.chain.current_version()
        low = None if current is None else max(0, current - cfg.run.async_level)
        return {
            "validator": service.identity.address, "run": cfg.run.model_dump(mode="json"),
            "domain": service.domain, "chain_id": service.deployment.chain_id, "pool": service.deployment.pool,
            "model": cfg.model.model_dump(mode="json"), "current_version": current,
            # versions checked with the base `model` (None: every version, the static source; -1: none, version 0
            # is a checkpoint pulled over the relays): a node that would generate otherwise refuses to start
            "base_version": cfg.weights.base_version if isinstance(cfg.weights, ShardcastWeights) else None,
            "checkable_versions": [] if current is None else [v for v in service.chain.versions() if v >= (low or 0)],
            "async_level": cfg.run.async_level, "checks": cfg.checks.model_dump(mode="json"),
            "thresholds_hash": service.core.checker.thresholds_hash,
            "checks_hash": cfg.checks.digest(),  # what a run pins in `run.checks_hash`
            "validators": service.core.assignment.validators(),
            "validator_urls": service.peers.urls(),
            "max_submission_bytes": cfg.max_submission_bytes,
            "discovery": None if announcer is None else {
                "peer_id": announcer.discovery.peer_id, "addrs": announcer.discovery.addrs, "url": announcer.url},
        }

    # the rendered body, swapped whole by `refresh_info`; the route reads it, no lock or thread
    info_snapshot: list[bytes] = []

    def info_bytes() -> bytes:
        return json.dumps(info_now(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def refresh_info() -> None:
        while True:
            try:
                info_snapshot[0] = await asyncio.to_thread(info_bytes)
            except Exception:  # noqa: BLE001 - the last snapshot stays; the next round tries again
                log.exception("refreshing /v1/info failed")
            await asyncio.sleep(INFO_REFRESH_S)

    @app.get("/v1/info", summary="Run, versions this validator can check, thresholds, async level (a snapshot at most "
                                 f"{INFO_REFRESH_S} s old); with `?challenge=0x<64 hex>`, the header "
                                 f"`{info_proof.HEADER}` signs the challenge and the body's SHA-256")
    async def info(challenge: str | None = Query(None, max_length=66)) -> Response:
        if not info_snapshot:
            return JSONResponse({"error": "starting", "detail": "no snapshot yet"}, status_code=503,
                                headers={"Retry-After": "1"})
        body = info_snapshot[0]
        try:
            nonce = info_proof.parse_challenge(challenge)
        except ProtocolError as exc:
            return JSONResponse({"error": exc.code, "detail": str(exc)}, status_code=400)
        # one signature in the event loop (~0.25 ms), no thread or lock: the caller's fresh challenge proves this
        # answer is ours now (docs/protocol/wire-format.md, "Info proof")
        headers = {} if nonce is None else {
            info_proof.HEADER: info_proof.prove_info(service.identity, nonce, body, domain=service.domain)}
        return Response(body, media_type="application/json", headers=headers)

    notes_threads = anyio.CapacityLimiter(1)  # one build at a time, on a thread of its own; the rest wait for it

    @app.get(pool_notes.PATH, summary="This validator's signed PoolNotes for its peers: per node, hard verdicts not on "
                                      "chain yet, skipped assignments, near-tie account (rebuilt at most every "
                                      "`pool_notes.cache_s`)")
    async def peer_notes() -> Response:
        data = service.notes.cached() or await anyio.to_thread.run_sync(service.notes.sealed, limiter=notes_threads)
        return Response(data, media_type="application/json")

    @app.post(pool_notes.PATH, summary="A peer validator pushes its signed PoolNotes (raw bytes, with its signed upload "
                                       "header) when a hard verdict is pending there: taken as a fetched copy would be")
    async def take_peer_notes(request: Request) -> Response:
        view = service.pool_view
        if view is None:  # before the body is read
            return JSONResponse({"error": "not_taking_notes", "detail": "this validator has no peers, or "
                                 "pool_notes.enabled is off"}, status_code=404)
        upload = await admission().gate.admit(request, admission().notes)
        if isinstance(upload, Response):
            return upload
        try:
            assert upload.signer is not None  # the lane takes signed uploads only
            try:
                taken = await anyio.to_thread.run_sync(view.take, upload.signer, upload.body, limiter=notes_threads)
            except PrimeError as exc:
                service.core.stats.count(f"pool_notes_refused_{exc.code}")
                status = 401 if isinstance(exc, SignatureError) else 409 if isinstance(exc, StaleNotesError) else 400
                return JSONResponse({"error": exc.code, "detail": str(exc)[:300]}, status_code=status)
        finally:
            upload.release()
        if taken:
            service.core.stats.count("pool_notes_push_taken")
        return JSONResponse({"taken": taken})

    @app.get("/v1/announcements", summary="The signed discovery announcements this validator believes (a JSON list)")
    def announcements() -> Response:
        if announcer is None:
            raise HTTPException(404, "discovery is off on this validator")
        return Response(announcer.discovery.board.to_json(), media_type="application/json")

    @app.get("/v1/evidence/{evidence_hash}", summary="The stored evidence of a hard verdict (its hash is on chain)")
    def evidence(evidence_hash: str) -> Response:
        data = service.ledger.evidence(_key(evidence_hash))
        if data is None:
            raise HTTPException(404, "no evidence with this hash")
        return Response(data, media_type="application/json")

    @app.get("/v1/envelopes/{submission_hash}", summary="A submission envelope as received, by its SHA-256 (hard "
                                                        "evidence names the submission by this hash)")
    def envelope(submission_hash: str) -> Response:
        row = service.ledger.by_hash(_key(submission_hash))
        if row is None or not row.envelope:
            raise HTTPException(404, "no submission with this hash (or pruned: its invalidation window passed)")
        return Response(row.envelope, media_type="application/json")

    @app.get("/v1/feed", summary="Accepted (and appeal-restored) submissions after a cursor, each a validator-signed "
                                 "FeedItem envelope, and the signed FeedPage listing of their positions")
    def feed(after: int = Query(0, ge=0, lt=2**63), limit: int = Query(64, ge=1, le=1024)) -> dict[str, Any]:
        items = service.ledger.feed(after, limit)
        # The listing is signed too (`FeedPage`): the positions are what a trainer's cursor moves to.
        page = FeedPage(after=after, entries=tuple(
            FeedEntry(seq=seq, work_key=bytes.fromhex(key[2:]), item_hash=feed_item_hash(item))
            for seq, key, item in items))
        listing = seal(service.identity, page, domain=service.domain, nonce=random_nonce()).to_bytes().decode()
        return {"validator": service.identity.address, "domain": service.domain,
                "items": [{"seq": seq, "work_key": key, "envelope": item.decode()} for seq, key, item in items],
                "next": items[-1][0] if items else after, "listing": listing}

    audit_cache: dict[str, Any] = {"at": -math.inf, "body": None}
    audit_threads = anyio.CapacityLimiter(1)  # one scan at a time, on a thread of its own
    audit_senders = KeyedBuckets(cfg.audit_rate_per_address, cfg.audit_burst_per_address)  # the event loop's only
    audit_held: Counter[str] = Counter()  # refused full audits held per address (the event loop's only)
    token = os.environ.get(cfg.audit_token_env) if cfg.audit_token_env else None
    if cfg.audit_token_env and not token:
        log.warning("audit_token_env names %s, which is not set: no audit request counts as the operator's",
                    cfg.audit_token_env)

    def operator(request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return bool(token) and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def full_report() -> bytes:
        """A scan of the ledger, JSON-encoded once (on the scan's thread): a cached report is served as these
        bytes, never encoded again per request."""
        report = service.ledger.audit()
        report["counter_holes"] = service.ledger.counter_holes()  # per node: assignments skipped (never sent)
        return json.dumps(report, separators=(",", ":")).encode()

    async def scanned(fresh: bool) -> tuple[bytes, float]:
        """The full report's JSON and its age: a new scan when `fresh` or the cached one is `audit_cache_s` old,
        else the cached one. Requests that queue behind a scan take its result."""
        asked = time.monotonic()
        async with audit_threads:
            if audit_cache["body"] is None or audit_cache["at"] < asked - (0.0 if fresh else cfg.audit_cache_s):
                body = await asyncio.to_thread(full_report)
                audit_cache.update(body=body, at=time.monotonic())
                return body, 0.0  # scanned for this request
            return audit_cache["body"], time.monotonic() - audit_cache["at"]

    def with_header(report: bytes, age: float) -> bytes:
        """`report` (a JSON object) with who answered, how much it reported on chain and the report's age in
        front: the cached bytes are spliced, not parsed."""
        head = json.dumps({"validator": service.identity.address, "reported_on_chain": service.reporter.reported,
                           "age_s": round(age, 3)}, separators=(",", ":")).encode()
        return head if report == b"{}" else head[:-1] + b"," + report[1:]

    @app.get("/v1/audit", summary="Ledger counts and the work keys by outcome (accepted with units and feed seq, "
                                  "hard with evidence, restored by an appeal with feed seq), for reconciliation "
                                  "with the chain and the trainer; rows=false: the counts only. With rows, a report "
                                  "at most `audit_cache_s` old unless the operator's token is sent, and at most "
                                  "`audit_rate_per_address` a second from one address (429 + Retry-After)",
             response_class=JSONResponse)
    async def audit(request: Request, rows: bool = True) -> Response:
        if not rows:  # running tallies: a dashboard polling this never scans the ledger
            counts = await anyio.to_thread.run_sync(
                lambda: {"counts": service.ledger.audit_counts(), "feed_size": service.ledger.feed_size(),
                         "counter_holes": service.ledger.counter_holes()})
            return Response(with_header(json.dumps(counts).encode(), 0.0), media_type="application/json")
        fresh = operator(request)
        if not fresh:
            source = request.client.host if request.client else "unknown"
            wait = audit_senders.take(source)
            if wait:
                service.core.stats.count("audit_rate_limited")
                if audit_held[source] < AUDIT_HOLD_PER_ADDRESS and audit_held.total() < AUDIT_HOLD_TOTAL:
                    audit_held[source] += 1  # a tarpit, bounded: see AUDIT_HOLD_PER_ADDRESS
                    service.core.stats.count("audit_held")
                    try:
                        await asyncio.sleep(min(wait, AUDIT_HOLD_MAX_S))
                    finally:
                        audit_held[source] -= 1
                        if audit_held[source] <= 0:
                            del audit_held[source]
                return JSONResponse({"error": "rate_limited", "detail": f"{source} is over "
                                     f"{cfg.audit_rate_per_address} full audits/s (the counts: ?rows=false)"},
                                    status_code=429, headers={"Retry-After": str(max(1, math.ceil(wait)))})
        body, age = await scanned(fresh=fresh)
        return Response(with_header(body, age), media_type="application/json")

    @app.get("/health", summary="The process is up (answered in the event loop: no thread, no lock)")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Chain readable and the current version's weights loaded")
    def ready() -> Response:
        ok, why = service.ready()
        return JSONResponse({"ready": ok, "detail": why}, status_code=200 if ok else 503)

    metrics_cache: dict[str, Any] = {"at": -math.inf, "text": b""}
    metrics_threads = anyio.CapacityLimiter(1)

    @app.get("/metrics", summary=f"Prometheus metrics (collected at most every {METRICS_CACHE_S} s)")
    async def metrics() -> Response:
        asked = time.monotonic()
        async with metrics_threads:  # one collection at a time; the ones queued behind it take its result
            if metrics_cache["at"] < asked - METRICS_CACHE_S:
                text = await asyncio.to_thread(generate_latest, registry)
                metrics_cache.update(text=text, at=time.monotonic())
        return Response(metrics_cache["text"], media_type="text/plain; version=0.0.4")

    return app
