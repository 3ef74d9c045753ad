"""Handing finished checkpoints to a publisher without blocking the next training step.

`PublishHook.submit()` only enqueues; a background thread calls the publisher. The training loop
never waits on a broadcast (DESIGN: the trainer must not block on one). Failures are logged and
counted in `failures`, and the checkpoint being published is protected from rotation until done.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from abc import ABC, abstractmethod
from pathlib import Path

log = logging.getLogger(__name__)


class Publisher(ABC):
    """Makes checkpoint `step` (a directory) available to the network."""

    @abstractmethod
    def publish(self, step: int, path: Path) -> None:
        """Publish; may take long (it runs off the training thread)."""


class LocalDirectoryPublisher(Publisher):
    """Copies each checkpoint's weights and config to `<root>/step-<n>/` atomically, then points `latest` at it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def publish(self, step: int, path: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".step-{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        # Weights and config only: optimizer and RNG state are the trainer's private business.
        shutil.copytree(path, tmp, ignore=shutil.ignore_patterns("optimizer.pt", "rng.pt", "trainer_state.json"))
        final = self.root / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = self.root / "latest.tmp"
        latest_tmp.write_text(f"{step}\n")
        os.replace(latest_tmp, self.root / "latest")


class PublishHook:
    """A single background worker that publishes checkpoints in order."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.failures = 0
        self.published: list[int] = []
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._in_flight: set[Path] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-publisher", daemon=True)
        self._thread.start()

    def submit(self, step: int, path: Path) -> None:
        """Enqueue and return at once."""
        with self._lock:
            self._in_flight.add(Path(path).resolve())
        self._queue.put((step, Path(path)))

    def in_flight(self) -> set[Path]:
        with self._lock:
            return set(self._in_flight)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, path = item
            try:
                self.publisher.publish(step, path)
                self.published.append(step)
                log.info("published checkpoint %d", step)
            except Exception:  # noqa: BLE001 - a failed broadcast must not kill training; it is counted
                self.failures += 1
                log.exception("publishing checkpoint %d failed", step)
            finally:
                with self._lock:
                    self._in_flight.discard(path.resolve())

    def close(self, timeout: float | None = None) -> None:
        """Finish queued publications, then stop the worker."""
        self._queue.put(None)
        self._thread.join(timeout)
