"""Per-step metrics: JSON lines, Prometheus gauges, and a one-line progress display."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Gauge, start_http_server

# Metric names every step reports (see trainer/README.md for their meaning).
STEP_KEYS = (
    "step",
    "loss",
    "reward_mean",
    "reward_std",
    "advantage_abs_mean",
    "clip_low_frac",
    "clip_high_frac",
    "delta_capped_frac",
    "ratio_mean",
    "kl",
    "entropy",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "samples",
    "loss_tokens",
    "packing_efficiency",
    "stale_samples",
    "future_samples",
    "filtered_groups",
    "too_long_samples",
    "staleness_mean",
    "publish_failures",
)


# Metric names every SFT step reports (see trainer/README.md, "Supervised warm-up").
SFT_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "epoch",
    "examples",
    "loss_tokens",
    "tokens_per_s",
    "step_time_s",
    "packing_efficiency",
    "row_fill",
    "publish_failures",
)


def rl_line(m: dict[str, Any]) -> str:
    """The RL step's progress fields."""
    return (f"loss {m['loss']:+.4f} reward {m['reward_mean']:.3f} "
            f"clip {m['clip_low_frac']:.2f}/{m['clip_high_frac']:.2f} |g| {m['grad_norm']:.3f} "
            f"{m['tokens_per_s']:.0f} tok/s {m['step_time_s']:.2f} s/step stale {m['stale_samples']}")


def sft_line(m: dict[str, Any]) -> str:
    """The SFT step's progress fields."""
    return (f"loss {m['loss']:.4f} epoch {m['epoch']:.2f} |g| {m['grad_norm']:.3f} lr {m['lr']:.2e} "
            f"{m['tokens_per_s']:.0f} tok/s {m['step_time_s']:.2f} s/step")


class MetricsSink:
    """Writes each step's metrics to a JSON-lines file and Prometheus gauges; prints progress."""

    def __init__(
        self,
        path: Path | None = None,
        port: int | None = None,
        progress: bool = True,
        total_steps: int = 0,
        stream: TextIO | None = None,
        keys: Sequence[str] = STEP_KEYS,
        line: Callable[[dict[str, Any]], str] = rl_line,
        host: str = "127.0.0.1",
    ) -> None:
        self.path = Path(path) if path else None
        self.line = line
        self.progress = progress
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.registry = CollectorRegistry()
        self.gauges = {
            k: Gauge(f"prime_trainer_{k}", f"trainer {k} of the latest step", registry=self.registry)
            for k in keys
        }
        self._server: Any = None
        if port is not None:
            self._server = start_http_server(port, addr=host, registry=self.registry)
        self._t0 = time.monotonic()

    def record(self, metrics: dict[str, Any]) -> None:
        for k, g in self.gauges.items():
            v = metrics.get(k)
            if isinstance(v, int | float):
                g.set(float(v))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps(metrics, sort_keys=True) + "\n")
                fh.flush()
        if self.progress:
            done = metrics["step"] + 1
            elapsed = time.monotonic() - self._t0
            bar_w = 20
            frac = done / self.total_steps if self.total_steps else 1.0
            bar = "#" * int(bar_w * min(frac, 1.0))
            self.stream.write(f"[{bar:<{bar_w}}] step {done}/{self.total_steps} {self.line(metrics)} ({elapsed:.0f} s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            thread.join(5)
