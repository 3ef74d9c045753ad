"""What the devnet server's routes read: the layout, the latest snapshot and the audit (`View`).

Its own module so that the server (devnet/server.py) and its extensions (devnet/dashboard) both import it
and neither imports the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from devnet.network import Layout


class View:
    """What routes read: the layout, the latest snapshot (refreshed by `up`'s summary loop) and the audit."""

    def __init__(self, layout: Layout, snapshot: Callable[[], dict[str, Any]],
                 audit: Callable[[], dict[str, Any]]) -> None:
        self.layout = layout
        self._snapshot = snapshot
        self._audit = audit
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def refresh(self) -> dict[str, Any]:
        snap = self._snapshot()
        with self._lock:
            self._latest = snap
        return snap

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            latest = self._latest
        return latest if latest is not None else self.refresh()

    def audit(self) -> dict[str, Any]:
        return self._audit()
