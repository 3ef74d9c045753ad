"""The GRPO training loop: batch -> advantages -> filter -> pack -> clipped loss -> AdamW -> checkpoint.

Step n trains policy version n on samples inside the async window and produces version n + 1, saved
as checkpoint `step-<n+1>` and handed to the publish hook without waiting for the broadcast.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol.errors import TrainerError
from trainer.checkpoint import list_checkpoints, load_checkpoint, rotate, save_checkpoint, set_rng_state
from trainer.config import TrainerConfig
from trainer.distributed import DistInfo, all_reduce_sum, barrier, shard_model
from trainer.loss import LossConfig, group_advantages, grpo_token_loss, token_weights, zero_advantage_groups
from trainer.metrics import MetricsSink
from trainer.packing import PackedRows, pack, token_logprobs
from trainer.publish import PublishHook
from trainer.source import RolloutSource

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    metrics: dict[str, Any]
    checkpoint: Path | None


class Trainer:
    """Owns the policy, its optimizer and the step counter; everything else is handed in."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model: torch.nn.Module,
        source: RolloutSource,
        device: torch.device,
        dist_info: DistInfo | None = None,
        publish_hook: PublishHook | None = None,
        metrics: MetricsSink | None = None,
        pad_token_id: int = 0,
        tokenizer: Any = None,
    ) -> None:
        self.cfg = cfg
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
        if cfg.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.dist.enabled:
            model = shard_model(model, device)
            if self.ref_model is not None:
                self.ref_model = shard_model(self.ref_model, device)
        self.model = model
        self.model.train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            weight_decay=o.weight_decay,
            foreach=False,  # identical update order on every run: exact resume compares bit for bit
        )
        self.loss_cfg = LossConfig(
            epsilon_low=cfg.loss.epsilon_low,
            epsilon_high=cfg.loss.epsilon_high,
            delta=cfg.loss.delta,
            kl_coef=cfg.loss.kl_coef,
            entropy_coef=cfg.loss.entropy_coef,
        )
        self.step = 0
        self.autocast_dtype = self._autocast_dtype()

    def _autocast_dtype(self) -> torch.dtype | None:
        want = self.cfg.dtype
        if want == "bfloat16" or (want == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    # ----------------------------------------------------------------- state
    def _full_model_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)  # type: ignore[return-value]

    def _full_optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=opts)

    def save(self) -> Path | None:
        model_state = self._full_model_state()
        optim_state = self._full_optim_state()
        path: Path | None = None
        if self.dist.is_main:
            state = {"step": self.step, "source": self.source.state_dict(), "world": self.dist.world}
            inner = getattr(self.model, "module", self.model)
            path = save_checkpoint(self.cfg.checkpoint.dir, self.step, inner, model_state, optim_state, state,
                                   self.tokenizer)
            protected = self.publish_hook.in_flight() if self.publish_hook else set()
            rotate(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep, protected)
        barrier()
        return path

    def resume(self) -> bool:
        """Load the newest complete checkpoint if there is one; returns whether it did."""
        ckpts = list_checkpoints(self.cfg.checkpoint.dir)
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
        w = self.cfg.optim.warmup_steps
        return self.cfg.optim.lr * (min(1.0, (step + 1) / w) if w else 1.0)

    def _micro_batches(self, packed: PackedRows) -> list[PackedRows]:
        """This rank's rows in micro-batches; every rank runs the same number (FSDP collectives)."""
        n_rows = packed.input_ids.shape[0]
        mine = list(range(self.dist.rank, n_rows, self.dist.world))
        per_rank = math.ceil(n_rows / self.dist.world)
        mb = self.cfg.batch.micro_batch_rows
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

    def train_step(self) -> StepResult:
        cfg = self.cfg
        t0 = time.monotonic()
        step = self.step
        batch = self.source.next_batch(step, cfg.batch.groups_per_step, cfg.batch.async_level)
        t_batch = time.monotonic()
        samples = batch.samples
        rewards = [s.reward for s in samples]
        gids = [s.group_id for s in samples]
        adv = group_advantages(rewards, gids, cfg.loss.std_normalize)
        dropped = zero_advantage_groups(adv, gids) if cfg.loss.filter_zero_advantage else set()
        keep = [i for i, s in enumerate(samples) if s.group_id not in dropped]
        too_long = [i for i in keep if len(samples[i].tokens) > cfg.batch.seq_len]
        keep = [i for i in keep if len(samples[i].tokens) <= cfg.batch.seq_len]
        train = [samples[i] for i in keep]
        train_adv = [adv[i] for i in keep]
        weights = token_weights([s.n_loss_tokens for s in train], cfg.loss.normalization)

        lr = self._lr(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        sums = [0.0] * 8  # loss, policy, kl, entropy, clip_low, clip_high, capped, ratio
        useful = processed = n_rows = 0
        if train:
            packed = pack(train, train_adv, weights, cfg.batch.seq_len, self.pad_token_id)
            useful = packed.useful_tokens
            n_rows = packed.input_ids.shape[0]
            for mb in self._micro_batches(packed):
                processed += mb.processed_tokens
                terms = self._forward_backward(mb)
                for j, v in enumerate((float(terms.loss.detach()), terms.policy_sum, terms.kl_sum,
                                       terms.entropy_sum, terms.clipped_low_sum, terms.clipped_high_sum,
                                       terms.capped_sum, terms.ratio_sum)):
                    sums[j] += v
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm_f = float(grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            grad_norm_f = 0.0
            log.warning("step %d: no trainable samples (all groups filtered); weights unchanged", step)
        if self.dist.enabled:  # each rank computed its rows' share of the weighted sums
            *sums, processed_f = all_reduce_sum([*sums, float(processed)], self.device)
            processed = int(processed_f)
        self.step += 1
        t_end = time.monotonic()
        dt, train_dt = t_end - t0, t_end - t_batch
        n_loss_tokens = sum(s.n_loss_tokens for s in train)
        metrics: dict[str, Any] = {
            "step": step,
            "loss": sums[0],
            "policy_loss": sums[1],
            "kl": sums[2],
            "entropy": sums[3],
            "clip_low_frac": sums[4],
            "clip_high_frac": sums[5],
            "delta_capped_frac": sums[6],
            "ratio_mean": sums[7],
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_std": float(torch.tensor(rewards, dtype=torch.float64).std(unbiased=False)) if rewards else 0.0,
            "advantage_abs_mean": sum(abs(a) for a in adv) / len(adv) if adv else 0.0,
            "grad_norm": grad_norm_f,
            "lr": lr,
            "samples": len(train),
            "loss_tokens": n_loss_tokens,
            "tokens_per_s": useful / train_dt if train_dt > 0 else 0.0,
            "step_time_s": dt,
            "batch_wait_s": t_batch - t0,
            "train_time_s": train_dt,
            "useful_tokens": useful,
            "processed_tokens": processed,
            "packing_efficiency": useful / processed if processed else 0.0,
            "row_fill": useful / (n_rows * cfg.batch.seq_len) if n_rows else 0.0,
            "stale_samples": batch.counts.stale,
            "future_samples": batch.counts.future,
            "rejected_files": batch.counts.rejected_files,
            "ungradable_samples": batch.counts.ungradable,
            "filtered_groups": len(dropped),
            "too_long_samples": len(too_long),
            "staleness_mean": sum(step - s.policy_version for s in samples) / len(samples) if samples else 0.0,
            "publish_failures": self.publish_hook.failures if self.publish_hook else 0,
        }
        # Metrics before the checkpoint: a crash in between re-runs the step and logs it again (with
        # identical values, resume being exact) instead of leaving a hole in the metrics.
        if self.metrics is not None and self.dist.is_main:
            self.metrics.record(metrics)
        ckpt = None
        if self.step % cfg.checkpoint.interval == 0 or self.step >= cfg.max_steps:
            ckpt = self.save()
            if ckpt is not None and self.publish_hook is not None:
                self.publish_hook.submit(self.step, ckpt)
        return StepResult(metrics, ckpt)

    def _forward_backward(self, mb: PackedRows) -> Any:
        dev = self.device
        ids, pos, seg = mb.input_ids.to(dev), mb.position_ids.to(dev), mb.segment_ids.to(dev)
        ac = torch.autocast(dev.type, dtype=self.autocast_dtype) if self.autocast_dtype else _nullcontext()
        with ac:
            # Entropy is always reported; it carries gradient only when the bonus is on.
            lp, ent = token_logprobs(self.model, ids, pos, seg, self.cfg.loss.temperature, with_entropy=True,
                                     entropy_grad=self.loss_cfg.entropy_coef != 0.0)
            ref_lp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_lp, _ = token_logprobs(self.ref_model, ids, pos, seg, self.cfg.loss.temperature)
        terms = grpo_token_loss(
            lp, mb.sampling_logprobs.to(dev), mb.advantages.to(dev), mb.weights.to(dev), self.loss_cfg, ref_lp, ent
        )
        # FSDP averages gradients over ranks; the weights already normalize over the whole step.
        (terms.loss * self.dist.world).backward()  # type: ignore[no-untyped-call]
        return terms

    def run(self) -> list[dict[str, Any]]:
        """Train until `max_steps`; returns this run's per-step metrics."""
        history = []
        while self.step < self.cfg.max_steps:
            history.append(self.train_step().metrics)
        return history


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
