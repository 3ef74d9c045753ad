"""The operator dashboard of `prime-devnet up`: `GET /` (the page) and `GET /api/dashboard` (its data).

devnet/dashboard/collector.py reads the roles' public endpoints and the chain; page.py renders one
self-contained HTML page (inline SVG, no script, no CDN: it works offline). `install` is in
devnet/server.py's EXTENSIONS.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from devnet.dashboard.collector import Collector
from devnet.dashboard.page import render
from devnet.view import View

log = logging.getLogger(__name__)


POLL_S = 5.0
"""How often the collector reads the network while nobody looks (SHARDCAST servers keep only the newest
few manifests: a version's signing time must be read while it is held)."""


def install(app: FastAPI, view: View) -> None:
    """Add the dashboard's routes to the devnet's app; the collector polls from a thread while it serves."""
    lock = threading.Lock()
    holder: dict[str, Collector] = {}
    stop = threading.Event()

    def collector() -> Collector:
        with lock:
            if "c" not in holder:
                holder["c"] = Collector(view.layout, view)
            return holder["c"]

    def poll() -> None:
        while not stop.wait(POLL_S):
            try:
                collector().collect()
            except Exception as exc:  # noqa: BLE001 - a failed poll is retried; the page shows what answers
                log.warning("dashboard: poll failed: %s", exc)

    @app.on_event("startup")
    def start() -> None:
        threading.Thread(target=poll, name="dashboard-poll", daemon=True).start()

    @app.get("/api/dashboard", summary="What the dashboard page shows, as JSON")
    def dashboard_data() -> dict[str, Any]:
        return collector().collect()

    @app.get("/", response_class=HTMLResponse, summary="The operator dashboard (HTML, inline SVG)")
    def dashboard_page() -> HTMLResponse:
        return HTMLResponse(render(collector().collect()))

    @app.on_event("shutdown")
    def close() -> None:
        stop.set()
        if "c" in holder:
            holder["c"].close()
