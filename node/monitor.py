"""`/metrics` (Prometheus) and `/health` (JSON) of a running node, on a loopback port by default.

`/health` answers 200 while the work loop is alive (working, or waiting for a version, a validator
or a verdict) and 503 once it stopped or failed, with the reason; a supervisor restarts on 503.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node.worker import WAIT_REASONS, Tally

logger = logging.getLogger(__name__)


class _TallyCollector(Collector):
    def __init__(self, tally: Callable[[], Tally], pending: Callable[[], int]) -> None:
        self.tally, self.pending = tally, pending

    def collect(self) -> Iterator[Metric]:
        t = self.tally()
        yield CounterMetricFamily("prime_node_batches", "Assignments generated", value=t.batches)
        yield CounterMetricFamily("prime_node_tokens", "Completion tokens generated", value=t.tokens)
        yield CounterMetricFamily("prime_node_generation_seconds", "Time spent generating and proving",
                                  value=t.generation_s)
        yield CounterMetricFamily("prime_node_accepted", "Submissions accepted", value=t.accepted)
        rejected = CounterMetricFamily("prime_node_rejected", "Submissions rejected, by reason", labels=["reason"])
        for reason, n in sorted(t.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily("prime_node_submit_failures", "Validators that ran out of tries",
                                  value=t.submit_failures)
        yield CounterMetricFamily("prime_node_resent", "Submissions sent again (the same envelope) for want of a "
                                  "verdict by submit.verdict_deadline_s", value=t.resent)
        lies = CounterMetricFamily("prime_node_peer_errors", "Validator answers not believed or not understood "
                                   "(missing or forged receipts, unsigned or forged verdicts, odd statuses), by kind",
                                   labels=["kind"])
        for kind, n in sorted(t.peer_errors.items()):
            lies.add_metric([kind], n)
        yield lies
        yield GaugeMetricFamily("prime_node_pending", "Submissions awaiting a verdict", value=self.pending())
        yield GaugeMetricFamily("prime_node_policy_version", "Policy version of the last batch",
                                value=-1 if t.version is None else t.version)
        up = GaugeMetricFamily("prime_node_state", "1 for the loop's current state", labels=["state"])
        for state in ("starting", "working", "waiting", "stopped", "failed"):
            up.add_metric([state], 1.0 if t.state == state else 0.0)
        yield up
        waiting = GaugeMetricFamily("prime_node_waiting_seconds", "How long the loop has waited, by what it waits "
                                    "for (0 for the reasons it does not wait for now)", labels=["reason"])
        for reason in WAIT_REASONS:
            now = t.state == "waiting" and t.reason == reason and t.waiting_since is not None
            waiting.add_metric([reason], time.time() - t.waiting_since if now and t.waiting_since else 0.0)
        yield waiting
        started = GaugeMetricFamily("prime_node_version_started_timestamp_seconds",
                                    "Unix time the first batch of each policy version began", labels=["version"])
        for version, at in sorted(t.version_started_at.items()):
            started.add_metric([str(version)], at)
        yield started


def health(t: Tally, pending: int, records: dict[str, int] | None = None,
           node: str | None = None) -> tuple[int, dict[str, Any]]:
    """`records`: the slashing-protection record's counts by state (durable across restarts; the audit
    compares `submitted + decided` with the rows the validators hold for this node)."""
    alive = t.state not in ("stopped", "failed")
    return (200 if alive else 503), {"node": node, "records": records,
        "status": "ok" if alive else t.state, "state": t.state, "detail": t.detail,
        "waiting_for": t.reason if t.state == "waiting" else None,
        "waiting_s": None if t.waiting_since is None or t.state != "waiting" else round(time.time() - t.waiting_since, 1),
        "policy_version": t.version,
        "batches": t.batches, "accepted": t.accepted, "rejected": dict(t.rejected), "pending": pending,
        "last_batch_age_s": None if t.last_batch_at is None else round(time.time() - t.last_batch_at, 1),
    }


class Monitor:
    """Serves `/metrics` and `/health` from a thread until `stop()`."""

    def __init__(self, tally: Callable[[], Tally], pending: Callable[[], int], *, host: str, port: int,
                 records: Callable[[], dict[str, int]] | None = None, node: str | None = None) -> None:
        registry = CollectorRegistry()
        registry.register(_TallyCollector(tally, pending))

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a client that sends its request this slowly is dropped

            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
                elif path == "/health":
                    status, body = health(tally(), pending(), records() if records is not None else None, node)
                    self._send(status, json.dumps(body).encode(), "application/json")
                else:
                    self._send(404, b'{"error": "not_found"}', "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server API
                logger.debug("monitor: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("metrics at %s/metrics, health at %s/health", self.url, self.url)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
