"""Per-step metrics: JSON lines, Prometheus gauges, TensorBoard, Weights & Biases, one progress line per step.

Every destination gets the same numbers: the step's metrics dict (held-out evaluation results included,
as `eval/<label>/<name>`). TensorBoard (tensorboardX) and W&B (the optional `wandb` extra) are imported
only when configured, so a run without them loads neither.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from protocol.errors import ConfigError, TrainerError

if TYPE_CHECKING:
    from trainer.config import TrainLoopConfig, WandbSettings

log = logging.getLogger(__name__)

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
    "samples_per_s",
    "step_time_s",
    "batch_wait_s",
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
    "examples_per_s",
    "step_time_s",
    "packing_efficiency",
    "row_fill",
    "publish_failures",
)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def rl_line(m: dict[str, Any]) -> str:
    """The RL step's progress fields: reward, samples, staleness, throughput, step time, then the loss."""
    return (f"reward {m['reward_mean']:.3f} ±{m['reward_std']:.3f} samples {m['samples']} "
            f"stale {m['stale_samples']} staleness {m['staleness_mean']:.2f} | "
            f"{m['samples_per_s']:.2f} samples/s {m['tokens_per_s']:.0f} tok/s "
            f"step {m['step_time_s']:.2f} s wait {m['batch_wait_s']:.2f} s | "
            f"loss {m['loss']:+.4f} |g| {m['grad_norm']:.3f} clip {m['clip_low_frac']:.2f}/{m['clip_high_frac']:.2f}")


def sft_line(m: dict[str, Any]) -> str:
    """The SFT step's progress fields."""
    return (f"loss {m['loss']:.4f} |g| {m['grad_norm']:.3f} lr {m['lr']:.2e} epoch {m['epoch']:.2f} "
            f"examples {m['examples']} | {m['examples_per_s']:.2f} examples/s {m['tokens_per_s']:.0f} tok/s "
            f"step {m['step_time_s']:.2f} s")


def eval_line(m: dict[str, Any]) -> str:
    """` | eval greedy pass 0.781 reward 0.955` for each evaluation in the step's metrics, else ''."""
    parts = []
    for key in m:
        if key.startswith("eval/") and key.endswith("/pass_rate"):
            label = key[len("eval/"):-len("/pass_rate")]
            reward = m.get(f"eval/{label}/mean_reward", float("nan"))
            parts.append(f"{label} pass {m[key]:.3f} reward {reward:.3f}")
    return f" | eval {' '.join(parts)}" if parts else ""


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The step's numbers (everything but `step` itself), as floats."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, int | float)}


class TensorBoardWriter:
    """Event files under `logdir` (tensorboardX's SummaryWriter), one scalar per metric per step."""

    def __init__(self, logdir: Path) -> None:
        try:  # typed as Any whether or not the package ships types (mypy passes with and without it)
            tensorboardx: Any = importlib.import_module("tensorboardX")
        except ImportError as exc:  # a core dependency: only a broken install gets here
            raise ConfigError(f"tensorboard_dir is set but tensorboardX cannot be imported ({exc}): "
                              "reinstall prime-network (`make setup`, or `pip install tensorboardX`)") from exc
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = tensorboardx.SummaryWriter(str(logdir))

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step is minutes of work: the operator sees it at once

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A Weights & Biases run; `mode = "offline"` (or WANDB_MODE=offline) writes it to disk with no network."""

    def __init__(self, settings: WandbSettings, run_config: dict[str, Any]) -> None:
        try:
            wandb: Any = importlib.import_module("wandb")
        except ImportError as exc:
            raise ConfigError("wandb.project is set but wandb is not installed: "
                              "pip install -e '.[wandb]' (or pip install wandb)") from exc
        if settings.dir is not None:
            settings.dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        try:
            self.run = wandb.init(
                project=settings.project, entity=settings.entity, name=settings.name, id=settings.id,
                group=settings.group, tags=settings.tags or None,
                # W&B reads WANDB_MODE once per process (its setup singleton): read it here for each run.
                mode=settings.mode or os.environ.get("WANDB_MODE") or None,
                dir=str(settings.dir) if settings.dir is not None else None, config=run_config,
                resume="allow" if settings.id else None,
                # The trainer's stderr is the operator's log: W&B neither captures it nor prints its summary.
                settings=wandb.Settings(console="off", quiet=True),
            )
        except Exception as exc:  # wandb raises its own error types (CommError, UsageError, ...)
            raise TrainerError(f"W&B could not start a run ({type(exc).__name__}: {exc}); with no network, "
                               "set wandb.mode = \"offline\" (or WANDB_MODE=offline)") from exc
        log.info("W&B run %s, %s mode (%s)", self.run.id, self.run.settings.mode, self.run.settings.sync_dir)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() returns once W&B's service took the run's exit, before that service flushed the offline run
        # file (seen holding only its 7-byte header just after, on a busy box: CI run 49); its teardown waits for
        # the flush, so the run's files are complete when the sink closes (a later run starts a new service).
        self._wandb.teardown()


def _gauge_name(key: str) -> str:
    return "prime_trainer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class MetricsSink:
    """Writes each step's metrics to every configured destination and prints the progress line."""

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
        tensorboard_dir: Path | None = None,
        wandb: WandbSettings | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.line = line
        self.progress = progress
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.registry = CollectorRegistry()
        self.gauges = {k: self._gauge(k) for k in keys}
        self.writers: list[TensorBoardWriter | WandbWriter] = []
        self._server: Any = None
        try:
            if tensorboard_dir is not None:
                self.writers.append(TensorBoardWriter(Path(tensorboard_dir)))
            if wandb is not None and wandb.project is not None:
                self.writers.append(WandbWriter(wandb, run_config or {}))
            if port is not None:
                self._server = start_http_server(port, addr=host, registry=self.registry)
        except BaseException:
            self.close()
            raise
        self._t0 = time.monotonic()
        self._recorded = 0

    def _gauge(self, key: str) -> Gauge:
        return Gauge(_gauge_name(key), f"trainer {key} of the latest step", registry=self.registry)

    def record(self, metrics: dict[str, Any]) -> None:
        values = scalars(metrics)
        for k, v in values.items():
            if k not in self.gauges and k.startswith("eval/"):  # evaluation keys follow the configured temperatures
                self.gauges[k] = self._gauge(k)
            if k in self.gauges:
                self.gauges[k].set(v)
        if "step" in self.gauges:
            self.gauges["step"].set(float(metrics["step"]))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps(metrics, sort_keys=True) + "\n")
                fh.flush()
        for writer in self.writers:
            try:
                writer.write(int(metrics["step"]), values)
            except Exception as exc:  # a dashboard's trouble (disk full, W&B's process gone) never stops training
                log.warning("%s: step %s not written: %s: %s", type(writer).__name__, metrics["step"],
                            type(exc).__name__, exc)
        self._recorded += 1
        if self.progress:
            self.stream.write(self.progress_line(metrics) + "\n")
            self.stream.flush()

    def progress_line(self, metrics: dict[str, Any]) -> str:
        """`step 6/20 <fields> | 12 s, eta 29 s[ | eval ...]`, behind a bar when the stream is a terminal."""
        done = int(metrics["step"]) + 1
        elapsed = time.monotonic() - self._t0
        left = max(0, self.total_steps - done)
        eta = f", eta {_duration(elapsed / self._recorded * left)}" if self._recorded and left else ""
        text = f"step {done}/{self.total_steps} {self.line(metrics)} | {_duration(elapsed)}{eta}{eval_line(metrics)}"
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            frac = min(1.0, done / self.total_steps) if self.total_steps else 1.0
            text = f"[{'#' * int(20 * frac):<20}] {text}"
        return text

    def close(self) -> None:
        for writer in self.writers:
            try:
                writer.close()
            except Exception as exc:  # closing one destination must not lose the others
                log.warning("closing %s failed: %s", type(writer).__name__, exc)
        self.writers = []
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            thread.join(5)
            self._server = None


def metrics_sink(cfg: TrainLoopConfig, keys: Sequence[str] = STEP_KEYS,
                 line: Callable[[dict[str, Any]], str] = rl_line) -> MetricsSink:
    """The sink a training run's config describes (JSONL, Prometheus, TensorBoard, W&B, progress)."""
    return MetricsSink(cfg.metrics_file, cfg.metrics_port, cfg.progress, cfg.max_steps, keys=keys, line=line,
                       host=cfg.metrics_host, tensorboard_dir=cfg.tensorboard_dir, wandb=cfg.wandb,
                       run_config=cfg.model_dump(mode="json"))
