"""Assemble a trainer from its config: device, model, rollout source, publisher, metrics."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from protocol.errors import ConfigError
from trainer.config import TrainerConfig, TrainLoopConfig
from trainer.distributed import DistInfo, RankZeroSource, init_distributed
from trainer.evaluate import build_scheduled_eval
from trainer.grpo import Trainer
from trainer.loop import TrainLoop
from trainer.metrics import metrics_sink
from trainer.publish import LocalDirectoryPublisher, PublishHook, ShardcastPublisher
from trainer.source import DirectorySource, RolloutSource

log = logging.getLogger(__name__)


def pick_device(cfg: TrainLoopConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def prepare_process(cfg: TrainLoopConfig) -> tuple[torch.device, DistInfo]:
    """Threads, device, process group (under torchrun) and seeds, for any training run."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call] # the trainer has its own progress line
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    device = pick_device(cfg)
    dist_info = init_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(dist_info.local_rank)
        device = torch.device("cuda", dist_info.local_rank)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    return device, dist_info


def build_publish_hook(cfg: TrainLoopConfig, dist_info: DistInfo) -> PublishHook | None:
    if cfg.publish.type == "local" and dist_info.is_main:
        return PublishHook(LocalDirectoryPublisher(cfg.publish.path))
    if cfg.publish.type == "shardcast" and dist_info.is_main:
        return PublishHook(ShardcastPublisher(cfg.publish))
    return None


def close_run(loop: TrainLoop, dist_info: DistInfo) -> None:
    """Finish publishing, stop metrics and the source, leave the process group."""
    if loop.publish_hook is not None:
        loop.publish_hook.close()
    if loop.metrics is not None:
        loop.metrics.close()
    close = getattr(loop.source, "close", None)
    if close is not None:
        close()
    if dist_info.enabled:
        import torch.distributed as dist

        dist.destroy_process_group()


def build_source(cfg: TrainerConfig, loaded: object, trainer_model: torch.nn.Module | None = None,
                 dist_info: DistInfo | None = None, device: torch.device | None = None) -> RolloutSource:
    vocab = int(loaded.model.config.vocab_size)  # type: ignore[attr-defined]
    if cfg.data.type == "directory":
        return DirectorySource(cfg.data.path, cfg.data.poll_interval_s, cfg.data.wait_timeout_s, vocab)
    if cfg.data.type == "validators":
        from trainer.validator_feed import ValidatorFeedSource

        dist_info = dist_info or DistInfo()
        inner = ValidatorFeedSource.from_config(cfg.data, vocab) if dist_info.is_main else None
        if not dist_info.enabled:
            assert inner is not None
            return inner
        # What a feed returns depends on timing: one rank reads, every rank trains on the same groups.
        return RankZeroSource(inner, device or torch.device("cpu"))
    from environments import get as get_env
    from trainer.local import LocalSource

    d = cfg.data
    return LocalSource(loaded, get_env(d.env, d.env_version), d.group_size, d.max_new_tokens,  # type: ignore[arg-type]
                       d.temperature, d.task_seed)


def build_trainer(cfg: TrainerConfig) -> tuple[Trainer, DistInfo]:
    from models import load

    device, dist_info = prepare_process(cfg)
    if cfg.data.type == "local" and dist_info.enabled:
        raise ConfigError("local mode generates with the whole model: run it as one process (no torchrun)")
    loaded = load(cfg.model, dtype="float32", device="cpu")
    source = build_source(cfg, loaded, dist_info=dist_info, device=device)
    hook = build_publish_hook(cfg, dist_info)
    evaluator = build_scheduled_eval(cfg, loaded, dist_info, device)  # before the trainer shards the model
    metrics = None
    if dist_info.is_main:
        metrics = metrics_sink(cfg)
    pad = loaded.tokenizer.pad_token_id
    trainer = Trainer(cfg, loaded.model, source, device, dist_info, hook, metrics,
                      pad_token_id=int(pad) if pad is not None else 0, tokenizer=loaded.tokenizer)
    trainer.evaluator = evaluator
    if hasattr(source, "attach"):
        source.attach(trainer.model)
    return trainer, dist_info


def publish_initial(trainer: Trainer) -> None:
    """Save the starting weights as checkpoint `step-0` and hand them to the publisher as version 0."""
    path = trainer.save()
    if path is not None and trainer.publish_hook is not None:
        log.info("publishing the starting weights as version 0")
        trainer.publish_hook.submit(0, path)


def republish_resumed(trainer: Trainer) -> None:
    """Hand the checkpoint a run resumed from to the publisher again: its publication runs on a thread after the
    save, so a trainer killed in between never published it, and nodes (which only work for a version on chain)
    would wait for it while the trainer waits for their rollouts of it (`bench.faults`, CI run 54). The publisher
    publishes only what is missing: a version already stored is recorded on chain as stored, one on chain is
    left alone."""
    from trainer.checkpoint import list_checkpoints

    checkpoints = list_checkpoints(trainer.ckpt_cfg.dir)
    if checkpoints and trainer.publish_hook is not None:
        step, path = checkpoints[-1]
        log.info("handing checkpoint %d (resumed from) to the publisher again", step)
        trainer.publish_hook.submit(step, path)


def run(cfg: TrainerConfig) -> None:
    trainer, dist_info = build_trainer(cfg)
    try:
        resumed = trainer.resume() if cfg.checkpoint.resume else False
        if resumed and trainer.publish_hook is not None:
            republish_resumed(trainer)
        if not resumed and trainer.step == 0 and cfg.publish.type == "shardcast" and cfg.publish.initial:
            publish_initial(trainer)
        if trainer.step >= cfg.max_steps:
            log.info("already at step %d >= max_steps %d: nothing to do", trainer.step, cfg.max_steps)
        trainer.run()
    finally:
        close_run(trainer, dist_info)
