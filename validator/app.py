"""The validator's HTTP API (FastAPI). Every route is a thin call into `Service`; OpenAPI at `/docs`."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from protocol.config import ShardcastWeights
from protocol.envelope import seal
from protocol.identity import checksum
from protocol.nonce import random_nonce
from protocol.rollout import FeedEntry, FeedPage, feed_item_hash
from validator.intake import row_status
from validator.service import Service

if TYPE_CHECKING:
    from validator.announcer import Announcer

_HEX32 = re.compile(r"^0x[0-9a-f]{64}$")


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
        try:
            yield
        finally:
            if announcer is not None:
                await asyncio.to_thread(announcer.stop)

    app = FastAPI(title="prime-validator", version="1", lifespan=lifespan, description=(
        "Checks nodes' signed rollouts (TOPLOC, sampling replay, rewards), records verdicts, slashes bad work "
        "on chain and serves accepted rollouts to trainers."))
    registry = CollectorRegistry()
    registry.register(_Metrics(service, announcer))

    busy = [0]  # submission requests being read or checked (the event loop's thread alone changes it)

    @app.post("/v1/submissions", status_code=202, summary="Submit one signed Submission envelope (raw bytes)")
    async def submit(request: Request) -> Response:
        if busy[0] >= cfg.flood.max_concurrent:  # refused at once: a queue would hold their bodies in memory
            service.core.stats.count("refused_busy")
            return JSONResponse({"error": "overloaded", "detail": f"{busy[0]} submissions are being taken in "
                                 f"(limit {cfg.flood.max_concurrent})"}, status_code=503,
                                headers={"Retry-After": "1", "Connection": "close"})
        busy[0] += 1
        try:
            return await _submit(request)
        finally:
            busy[0] -= 1

    async def _submit(request: Request) -> Response:
        limit = cfg.max_submission_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isascii() or not declared.isdigit() or int(declared) > limit):
            service.core.stats.count("refused_oversize")
            # Connection: close, so the server does not keep the socket to drain a body it will never use
            return JSONResponse({"error": "oversize", "detail": f"Content-Length {declared[:32]!r}, limit {limit}"},
                                status_code=413, headers={"Connection": "close"})
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked uploads are capped while they are read
            size += len(chunk)
            if size > limit:
                service.core.stats.count("refused_oversize")
                return JSONResponse({"error": "oversize", "detail": f"body over {limit} bytes"}, status_code=413,
                                    headers={"Connection": "close"})
            chunks.append(chunk)
        answer = await run_in_threadpool(service.core.intake.receive, b"".join(chunks))
        if answer.status == 202:
            service.wake()
        return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)

    @app.post("/v1/appeals", summary="Appeal another validator's hard verdict (a signed Appeal envelope, raw bytes)")
    async def appeal(request: Request) -> Response:
        limit = cfg.appeals.max_appeal_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isascii() or not declared.isdigit() or int(declared) > limit):
            return JSONResponse({"error": "oversize", "detail": f"Content-Length {declared[:32]!r}, limit {limit}"},
                                status_code=413, headers={"Connection": "close"})
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return JSONResponse({"error": "oversize", "detail": f"body over {limit} bytes"}, status_code=413,
                                    headers={"Connection": "close"})
            chunks.append(chunk)
        answer = await run_in_threadpool(service.appeals.handle, b"".join(chunks))
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

    @app.get("/v1/info", summary="Run, versions this validator can check, thresholds, async level")
    def info() -> dict[str, Any]:
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

    audit_cache: dict[str, Any] = {"at": -math.inf, "report": None}
    audit_lock = threading.Lock()

    @app.get("/v1/audit", summary="Ledger counts and the work keys by outcome (accepted with units and feed seq, "
                                  "hard with evidence, restored by an appeal with feed seq), for reconciliation "
                                  "with the chain and the trainer; rows=false: the counts only")
    def audit(rows: bool = True) -> dict[str, Any]:
        if not rows:  # running tallies: a dashboard polling this never scans the ledger
            report: dict[str, Any] = {"counts": service.ledger.audit_counts(), "feed_size": service.ledger.feed_size()}
        else:
            with audit_lock:  # one scan per `audit_cache_s`, however many ask
                now = time.monotonic()
                if audit_cache["report"] is None or now - audit_cache["at"] >= cfg.audit_cache_s:
                    audit_cache.update(report=service.ledger.audit(), at=now)
                report = dict(audit_cache["report"])
        report["validator"] = service.identity.address
        report["reported_on_chain"] = service.reporter.reported
        report["counter_holes"] = service.ledger.counter_holes()  # per node: assignments skipped (never sent)
        return report

    @app.get("/health", summary="The process is up")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Chain readable and the current version's weights loaded")
    def ready() -> Response:
        ok, why = service.ready()
        return JSONResponse({"ready": ok, "detail": why}, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app
