"""What every training loop here shares (GRPO in `trainer.grpo`, SFT in `trainer.sft`).

The policy on its device (FSDP2-sharded under torchrun), AdamW, the step counter, the learning-rate
schedule, micro-batches of packed rows spread over ranks, and checkpoints: `save()` writes
`step-<n>/` (weights, optimizer, RNG, `trainer_state.json` with the data source's position) and hands
it to the publish hook; `resume()` loads the newest one. A subclass implements `train_step()`.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from protocol.errors import TrainerError
from trainer.checkpoint import list_checkpoints, load_checkpoint, rotate, save_checkpoint, set_rng_state
from trainer.config import CheckpointSettings, OptimSettings
from trainer.distributed import DistInfo, barrier, shard_model
from trainer.metrics import MetricsSink
from trainer.packing import PackedRows
from trainer.publish import PublishHook

log = logging.getLogger(__name__)


class Evaluator(Protocol):
    """The scheduled held-out evaluation (`trainer.evaluate.ScheduledEval`)."""

    def due(self, steps_done: int, max_steps: int) -> bool: ...

    def run(self, loop: TrainLoop) -> dict[str, float]: ...


class Positioned(Protocol):
    """A data source whose position goes into checkpoints (`trainer_state.json` under `source`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepResult:
    metrics: dict[str, Any]
    checkpoint: Path | None


def schedule_lr(optim: OptimSettings, step: int, max_steps: int) -> float:
    """Learning rate of `step`: linear warm-up, then constant or decayed to `lr * min_lr_ratio` at max_steps."""
    w = optim.warmup_steps
    if w and step < w:
        return optim.lr * (step + 1) / w
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, max_steps - w)
    progress = min(1.0, max(0.0, (step - w) / span))
    if optim.schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * factor)


class TrainLoop:
    """Owns the policy, its optimizer and the step counter; the data source and hooks are handed in."""

    def __init__(
        self,
        model: torch.nn.Module,
        source: Positioned,
        device: torch.device,
        *,
        optim: OptimSettings,
        checkpoint: CheckpointSettings,
        dtype: str,
        micro_batch_rows: int,
        max_steps: int,
        dist_info: DistInfo | None = None,
        publish_hook: PublishHook | None = None,
        metrics: MetricsSink | None = None,
        pad_token_id: int = 0,
        tokenizer: Any = None,
        keep_reference: bool = False,
    ) -> None:
        self.optim_cfg = optim
        self.ckpt_cfg = checkpoint
        self.dtype = dtype
        self.micro_batch_rows = micro_batch_rows
        self.max_steps = max_steps
        self.tokenizer = tokenizer
        self.device = device
        self.dist = dist_info or DistInfo()
        self.source = source
        self.publish_hook = publish_hook
        self.metrics = metrics
        self.pad_token_id = pad_token_id
        # Parameters stay fp32 (the optimizer's master copy); GPUs compute the forward in bf16 via autocast.
        model = model.to(device=device, dtype=torch.float32).requires_grad_(True)
        self.ref_model: torch.nn.Module | None = None
        if keep_reference:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.dist.enabled:
            model = shard_model(model, device)
            if self.ref_model is not None:
                self.ref_model = shard_model(self.ref_model, device)
        self.model = model
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            weight_decay=optim.weight_decay,
            foreach=False,  # identical update order on every run: exact resume compares bit for bit
        )
        self.step = 0
        self.autocast_dtype = self._autocast_dtype()
        self.evaluator: Evaluator | None = None

    def _autocast_dtype(self) -> torch.dtype | None:
        if self.dtype == "bfloat16" or (self.dtype == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def autocast(self) -> Any:
        """The forward pass's autocast context (a no-op in fp32)."""
        if self.autocast_dtype is None:
            return _nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ----------------------------------------------------------------- state
    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (a collective under FSDP: every rank calls it; rank 0 gets them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)  # type: ignore[return-value]

    def _full_optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=opts)

    def save(self) -> Path | None:
        model_state = self.full_model_state()
        optim_state = self._full_optim_state()
        path: Path | None = None
        if self.dist.is_main:
            state = {"step": self.step, "source": self.source.state_dict(), "world": self.dist.world}
            inner = getattr(self.model, "module", self.model)
            path = save_checkpoint(self.ckpt_cfg.dir, self.step, inner, model_state, optim_state, state,
                                   self.tokenizer)
            protected = self.publish_hook.in_flight() if self.publish_hook else set()
            rotate(self.ckpt_cfg.dir, self.ckpt_cfg.keep, protected)
        barrier()
        return path

    def resume(self) -> bool:
        """Load the newest complete checkpoint if there is one; returns whether it did."""
        ckpts = list_checkpoints(self.ckpt_cfg.dir)
        if not ckpts:
            return False
        step, path = ckpts[-1]
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model_state, optim_state, trainer_state, rng = load_checkpoint(path)
        try:
            source_state, step_done = trainer_state["source"], int(trainer_state["step"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TrainerError(f"{path}: corrupt trainer_state.json (no valid source/step): {exc!r}") from exc
        opts = StateDictOptions(full_state_dict=True, strict=False)
        tied = {"lm_head.weight"} if getattr(getattr(self.model, "config", None), "tie_word_embeddings", False) else set()
        # Compare names ourselves: set_model_state_dict's missing_keys comes back empty for a model
        # with more layers than the checkpoint (transformers' loading hooks), leaving them random.
        expected = set(self.model.state_dict())  # FQNs; cheap under FSDP2 (no gather)
        missing, unexpected = expected - set(model_state) - tied, set(model_state) - expected
        if missing or unexpected:
            raise TrainerError(f"{path}: checkpoint does not match the model (missing {sorted(missing)[:3]}, "
                               f"unexpected {sorted(unexpected)[:3]})")
        try:
            set_model_state_dict(self.model, model_state, options=opts)  # type: ignore[arg-type]
            set_optimizer_state_dict(self.model, self.optimizer, optim_state,
                                     options=StateDictOptions(full_state_dict=True))
        except (RuntimeError, KeyError, ValueError) as exc:  # shape mismatches, optimizer state of another model
            raise TrainerError(f"{path}: checkpoint does not match the model: {exc}") from exc
        try:
            self.source.load_state_dict(source_state)
            set_rng_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise TrainerError(f"{path}: corrupt trainer_state.json or rng.pt: {exc!r}") from exc
        self.step = step_done
        log.info("resumed from %s (step %d)", path, step)
        return True

    # ------------------------------------------------------------------ step
    def _lr(self, step: int) -> float:
        return schedule_lr(self.optim_cfg, step, self.max_steps)

    def set_lr(self, step: int) -> float:
        lr = self._lr(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _micro_batches(self, packed: PackedRows) -> list[PackedRows]:
        """This rank's rows in micro-batches; every rank runs the same number (FSDP collectives)."""
        n_rows = packed.input_ids.shape[0]
        mine = list(range(self.dist.rank, n_rows, self.dist.world))
        per_rank = math.ceil(n_rows / self.dist.world)
        mb = self.micro_batch_rows
        n_micro = max(1, math.ceil(per_rank / mb))
        out = []
        for k in range(n_micro):
            rows = mine[k * mb : (k + 1) * mb]
            if rows:
                out.append(packed.select(rows))
            else:  # an idle rank still joins the collectives, with a zero-weight padding row
                L = packed.input_ids.shape[1]
                z = torch.zeros(1, L)
                out.append(PackedRows(
                    torch.full((1, L), self.pad_token_id, dtype=torch.long), torch.arange(L)[None],
                    torch.zeros(1, L, dtype=torch.long), z, z.clone(), z.clone(),
                ))
        return out

    def optimizer_step(self, max_grad_norm: float) -> float:
        """Clip, step, zero the gradients; returns the gradient norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def finish_step(self, metrics: dict[str, Any]) -> StepResult:
        """Evaluate when due (`eval.every`), record the step's metrics, then checkpoint (every `interval` steps
        and at the end) and publish."""
        # Before the checkpoint, so the saved RNG state is the one after the evaluation: a resumed run
        # goes on exactly as the uninterrupted one (which evaluated at the same steps).
        if self.evaluator is not None and self.evaluator.due(self.step, self.max_steps):
            metrics.update(self.evaluator.run(self))
        # Metrics before the checkpoint: a crash in between re-runs the step and logs it again (with
        # identical values, resume being exact) instead of leaving a hole in the metrics.
        if self.metrics is not None and self.dist.is_main:
            self.metrics.record(metrics)
        ckpt = None
        if self.step % self.ckpt_cfg.interval == 0 or self.step >= self.max_steps:
            ckpt = self.save()
            if ckpt is not None and self.publish_hook is not None:
                self.publish_hook.submit(self.step, ckpt)
        return StepResult(metrics, ckpt)

    def train_step(self) -> StepResult:
        raise NotImplementedError

    def run(self) -> list[dict[str, Any]]:
        """Train until `max_steps`; returns this run's per-step metrics."""
        history = []
        while self.step < self.max_steps:
            history.append(self.train_step().metrics)
        return history


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
