"""The GRPO training loop: batch -> advantages -> filter -> pack -> clipped loss -> AdamW -> checkpoint.

Step n trains policy version n on samples inside the async window and produces version n + 1, saved
as checkpoint `step-<n+1>` and handed to the publish hook without waiting for the broadcast.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from protocol.work_ledger import WorkLedger
from trainer.config import TrainerConfig
from trainer.distributed import DistInfo, all_reduce_sum
from trainer.loop import StepResult, TrainLoop
from trainer.loss import LossConfig, group_advantages, grpo_token_loss, token_weights, zero_advantage_groups
from trainer.metrics import MetricsSink
from trainer.packing import PackedRows, pack, token_logprobs
from trainer.publish import PublishHook, publish_timing
from trainer.source import ExpectedGroups, RolloutSource

log = logging.getLogger(__name__)


class Trainer(TrainLoop):
    """GRPO over a rollout source; the policy, optimizer, checkpoints and publishing are `TrainLoop`'s."""

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
        super().__init__(
            model, source, device, optim=cfg.optim, checkpoint=cfg.checkpoint, dtype=cfg.dtype,
            micro_batch_rows=cfg.batch.micro_batch_rows, max_steps=cfg.max_steps, dist_info=dist_info,
            publish_hook=publish_hook, metrics=metrics, pad_token_id=pad_token_id, tokenizer=tokenizer,
            keep_reference=cfg.loss.kl_coef > 0,
        )
        self.cfg = cfg
        self.source: RolloutSource = source
        self.work_ledger = WorkLedger(cfg.work_ledger) if cfg.work_ledger is not None else None
        self.expected = ExpectedGroups()
        """How many groups the next step takes at once (after a step cut short: a dead node is not waited for again)."""
        self.loss_cfg = LossConfig(
            epsilon_low=cfg.loss.epsilon_low,
            epsilon_high=cfg.loss.epsilon_high,
            delta=cfg.loss.delta,
            kl_coef=cfg.loss.kl_coef,
            entropy_coef=cfg.loss.entropy_coef,
        )

    def train_step(self) -> StepResult:
        cfg = self.cfg
        t0 = time.monotonic()
        step = self.step
        batch = self.source.next_batch(step, cfg.batch.groups_per_step, cfg.batch.async_level,
                                       min_groups=cfg.batch.min_groups_per_step,
                                       fill_timeout_s=cfg.batch.fill_timeout_s, expected=self.expected.value)
        t_batch = time.monotonic()
        if cfg.batch.fill_timeout_s is not None:  # a run that allows short steps (the local source never waits)
            self.expected.update(len(batch.groups), cfg.batch.groups_per_step)
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

        lr = self.set_lr(step)
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
            grad_norm_f = self.optimizer_step(cfg.optim.max_grad_norm)
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
            "samples_per_s": len(samples) / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            "batch_wait_s": t_batch - t0,
            "groups": len(batch.groups),
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
            **publish_timing(self.publish_hook),
        }
        if self.work_ledger is not None and self.dist.is_main:
            self.work_ledger.record(step, batch.work, self.source)
        return self.finish_step(metrics)

    def _forward_backward(self, mb: PackedRows) -> Any:
        dev = self.device
        ids, pos, seg = mb.input_ids.to(dev), mb.position_ids.to(dev), mb.segment_ids.to(dev)
        with self.autocast():
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
