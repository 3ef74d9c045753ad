"""`prime-trainer sft`: supervised fine-tuning on (prompt, completion) pairs, the warm-up before RL.

Step n takes `examples_per_step` examples (`trainer.sft_data`: a JSONL/Parquet file or an environment's
reference answers, rendered through the chat template), packs them first-fit-decreasing into rows of
`seq_len` tokens (block-diagonal attention, positions restarting per example), and minimizes the mean
negative log-likelihood of the step's completion tokens (prompt tokens carry no loss). Checkpoints,
exact resume, publishing, metrics and FSDP are the RL loop's (`trainer.loop.TrainLoop`); the final
weights can also be exported to `output_dir`, a plain Hugging Face directory an RL run starts from.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import list_checkpoints
from trainer.config import SFTConfig
from trainer.distributed import DistInfo, all_reduce_sum, barrier
from trainer.loop import StepResult, TrainLoop
from trainer.loss import token_weights
from trainer.metrics import SFT_KEYS, MetricsSink, metrics_sink, sft_line
from trainer.packing import PackedRows, pack_examples, selected_logprobs, token_logprobs
from trainer.publish import PublishHook, copy_public
from trainer.sft_data import Example, SFTDataset, build_dataset

log = logging.getLogger(__name__)


def sft_loss(model: torch.nn.Module, mb: PackedRows, device: torch.device) -> tuple[torch.Tensor, float]:
    """sum(weight * -logprob) over the rows' loss tokens, and the same sum detached (for metrics)."""
    ids, pos, seg = mb.input_ids.to(device), mb.position_ids.to(device), mb.segment_ids.to(device)
    weights = mb.weights.to(device)
    select = weights > 0
    if not bool(select.any()):  # an idle rank's padding row: zero loss, still joined to the graph
        lp, _ = token_logprobs(model, ids, pos, seg)
        loss = (lp * weights).sum()
    else:
        loss = -(selected_logprobs(model, ids, pos, seg, select) * weights[select]).sum()
    return loss, float(loss.detach())


class SFTTrainer(TrainLoop):
    """Supervised steps over an `SFTDataset`; see the module docstring."""

    def __init__(
        self,
        cfg: SFTConfig,
        model: torch.nn.Module,
        data: SFTDataset,
        device: torch.device,
        dist_info: DistInfo | None = None,
        publish_hook: PublishHook | None = None,
        metrics: MetricsSink | None = None,
        pad_token_id: int = 0,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(
            model, data, device, optim=cfg.optim, checkpoint=cfg.checkpoint, dtype=cfg.dtype,
            micro_batch_rows=cfg.batch.micro_batch_rows, max_steps=cfg.max_steps, dist_info=dist_info,
            publish_hook=publish_hook, metrics=metrics, pad_token_id=pad_token_id, tokenizer=tokenizer,
        )
        self.cfg = cfg
        self.data = data

    def pack(self, examples: list[Example]) -> PackedRows:
        """The step's rows; every completion token weighs 1 / (completion tokens in the step)."""
        weights = token_weights([ex.n_loss_tokens for ex in examples], "token")
        return pack_examples([ex.tokens for ex in examples], [ex.loss_mask for ex in examples], weights,
                             self.cfg.batch.seq_len, self.pad_token_id)

    def train_step(self) -> StepResult:
        cfg = self.cfg
        t0 = time.monotonic()
        step = self.step
        examples = self.data.batch(step, cfg.batch.examples_per_step)
        lr = self.set_lr(step)
        packed = self.pack(examples)
        loss_sum = 0.0
        processed = 0
        for mb in self._micro_batches(packed):
            processed += mb.processed_tokens
            with self.autocast():
                loss, value = sft_loss(self.model, mb, self.device)
            # FSDP averages gradients over ranks; the weights already normalize over the whole step.
            (loss * self.dist.world).backward()  # type: ignore[no-untyped-call]
            loss_sum += value
        grad_norm = self.optimizer_step(cfg.optim.max_grad_norm)
        if self.dist.enabled:
            loss_sum, processed_f = all_reduce_sum([loss_sum, float(processed)], self.device)
            processed = int(processed_f)
        self.step += 1
        dt = time.monotonic() - t0
        useful = packed.useful_tokens
        n_rows = packed.input_ids.shape[0]
        metrics: dict[str, Any] = {
            "step": step,
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": lr,
            "epoch": self.data.epoch(step, cfg.batch.examples_per_step),
            "examples": len(examples),
            "loss_tokens": sum(ex.n_loss_tokens for ex in examples),
            "tokens_per_s": useful / dt if dt > 0 else 0.0,
            "examples_per_s": len(examples) / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            "useful_tokens": useful,
            "processed_tokens": processed,
            "packing_efficiency": useful / processed if processed else 0.0,
            "row_fill": useful / (n_rows * cfg.batch.seq_len) if n_rows else 0.0,
            "publish_failures": self.publish_hook.failures if self.publish_hook else 0,
        }
        return self.finish_step(metrics)


def build_sft(cfg: SFTConfig) -> tuple[SFTTrainer, DistInfo]:
    from models import load
    from trainer.evaluate import build_scheduled_eval
    from trainer.runner import build_publish_hook, prepare_process

    device, dist_info = prepare_process(cfg)
    loaded = load(cfg.model, dtype="float32", device="cpu")
    data = build_dataset(cfg.data, loaded.tokenizer, loaded.eos_token_ids, cfg.batch.seq_len, cfg.seed)
    vocab = loaded.vocab_size
    if any(t >= vocab for ex in data.examples for t in ex.tokens):
        from protocol.errors import TrainerError

        raise TrainerError(f"the tokenizer produced ids outside the model's vocabulary of {vocab}")
    log.info("SFT: %d steps x %d examples = %.2f epochs of %d examples", cfg.max_steps,
             cfg.batch.examples_per_step, cfg.max_steps * cfg.batch.examples_per_step / len(data), len(data))
    evaluator = build_scheduled_eval(cfg, loaded, dist_info, device)  # before the trainer shards the model
    metrics = None
    if dist_info.is_main:
        metrics = metrics_sink(cfg, keys=SFT_KEYS, line=sft_line)
    pad = loaded.tokenizer.pad_token_id
    trainer = SFTTrainer(cfg, loaded.model, data, device, dist_info, build_publish_hook(cfg, dist_info), metrics,
                         pad_token_id=int(pad) if pad is not None else 0, tokenizer=loaded.tokenizer)
    trainer.evaluator = evaluator
    return trainer, dist_info


def export_final(trainer: SFTTrainer, dest: Path) -> Path | None:
    """Copy the checkpoint of the trainer's step (weights, config, tokenizer) to `dest`, saving it if missing."""
    done = dict(list_checkpoints(trainer.ckpt_cfg.dir))
    path = done[trainer.step] if trainer.step in done else trainer.save()
    out = None
    if trainer.dist.is_main and path is not None:
        out = copy_public(path, dest)
        log.info("SFT model (step %d) exported to %s", trainer.step, out)
    barrier()
    return out


def run_sft(cfg: SFTConfig) -> SFTTrainer:
    """Train (resuming when a checkpoint exists), export to `output_dir`; returns the finished trainer."""
    from trainer.runner import close_run

    trainer, dist_info = build_sft(cfg)
    try:
        if cfg.checkpoint.resume:
            trainer.resume()
        if trainer.step >= cfg.max_steps:
            log.info("already at step %d >= max_steps %d: nothing to do", trainer.step, cfg.max_steps)
        trainer.run()
        if cfg.output_dir is not None:
            export_final(trainer, cfg.output_dir)
    finally:
        close_run(trainer, dist_info)
    return trainer
