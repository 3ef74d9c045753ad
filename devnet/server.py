"""The devnet's HTTP server on 127.0.0.1, and on the devnet's address on the bridge with `--hosts netns` (FastAPI in a thread of `prime-devnet up`).

Routes: `GET /api/snapshot` (the latest snapshot, devnet/observer.py: trainer steps and rewards, nodes,
validators' counts, chain events, processes), `GET /api/layout` (devnet.json), `GET /api/audit` (the
reconciliation, devnet/audit.py, computed on request), `GET /health`.

Extending it (the operator dashboard): write a function `install(app: FastAPI, view: View) -> None`
that adds routes (pages, static files) reading `view.snapshot()` / `view.layout` / `view.audit()`, and
add it to `EXTENSIONS` below. `/` lists the routes until a page claims it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from devnet.view import View

log = logging.getLogger(__name__)


Extension = Callable[[FastAPI, View], None]


def _dashboard(app: FastAPI, view: View) -> None:
    from devnet.dashboard import install  # imported when the server is built: it pulls in the page renderers

    install(app, view)


EXTENSIONS: list[Extension] = [_dashboard]
"""Installed into every devnet app, in order (see the module docstring)."""


def build_app(view: View, extensions: list[Extension] | None = None) -> FastAPI:
    app = FastAPI(title="prime-devnet", version="1",
                  description="The local network's state: trainer, nodes, validators, chain, processes.")

    @app.get("/api/snapshot", summary="Latest snapshot of the network")
    def snapshot() -> dict[str, Any]:
        return view.snapshot()

    @app.get("/api/layout", summary="Where every role is (devnet.json)")
    def layout() -> dict[str, Any]:
        return dict(view.layout.__dict__)

    @app.get("/api/audit", summary="Reconciliation of the validators' ledgers, the trainer's work ledger, "
                                   "the nodes' records and the chain")
    def audit() -> dict[str, Any]:
        return view.audit()

    @app.get("/health", summary="The devnet supervisor is up")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    for install in (EXTENSIONS if extensions is None else extensions):
        install(app, view)

    if not any(getattr(r, "path", None) == "/" for r in app.routes):
        @app.get("/", response_class=PlainTextResponse, include_in_schema=False)
        def index() -> str:
            return "prime-devnet\n\n" + "\n".join(
                f"GET {getattr(r, 'path', '')}" for r in app.routes if getattr(r, "path", "").startswith("/api"))
    return app


class Server:
    """uvicorn serving `app` on `hosts` (127.0.0.1 first), all on one `port`, from a daemon thread (port 0: a
    free one, chosen on the first host)."""

    def __init__(self, app: FastAPI, port: int, hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        import socket

        import uvicorn

        self.socks: list[socket.socket] = []
        for host in hosts:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            port = int(sock.getsockname()[1])
            self.socks.append(sock)
        self.port = port
        self.url = f"http://{hosts[0]}:{self.port}"
        self.urls = [f"http://{h}:{self.port}" for h in hosts]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.socks}, daemon=True,
                                       name="devnet-http")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        for sock in self.socks:
            sock.close()
