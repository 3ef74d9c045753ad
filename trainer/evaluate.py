"""`prime-trainer eval`: score a model on a held-out seed range of an environment.

Task seed s is `env.sample(s, 1)[0]` (the same rule as SFT data, `trainer.sft_data.seed_range_tasks`),
so disjoint seed ranges are disjoint task draws. Each task's prompt is rendered as the node renders it
(`environments.render_prompt`), `samples_per_task` completions are generated with the `models/` engine
(greedy at temperature 0, else seeded Gumbel-max sampling with seeds derived from (seed, task seed, k)),
and graded with the environment's reward. The report: mean reward, pass rate (reward >= threshold),
mean completion length in tokens, the share that hit the length limit, and every sample's reward.
A sample the environment could not grade (`UngradableError`) is counted apart, never scored 0.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from environments import Environment, UngradableError, render_prompt
from models import LoadedModel
from models.engine import Engine
from models.sampling import SamplingParams
from trainer.config import EvalConfig
from trainer.local import derive_seed
from trainer.sft_data import seed_range_tasks

log = logging.getLogger(__name__)


@dataclass
class EvalSample:
    seed: int
    """The task seed."""
    k: int
    """Which of the task's samples."""
    question: str
    reward: float | None
    """None when the environment could not grade it."""
    completion_tokens: int
    finish_reason: str
    completion: str


@dataclass
class EvalReport:
    env: str
    env_version: str
    seed_start: int
    num_tasks: int
    samples_per_task: int
    temperature: float
    max_new_tokens: int
    pass_threshold: float
    mean_reward: float
    pass_rate: float
    mean_completion_tokens: float
    truncated_rate: float
    """Share of completions that hit `max_new_tokens` without an end-of-turn token."""
    ungradable: int
    generation_s: float
    samples: list[EvalSample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-sample list."""
        out = asdict(self)
        out.pop("samples")
        return out


def evaluate(
    loaded: LoadedModel,
    env: Environment,
    seed_start: int,
    num_tasks: int,
    *,
    samples_per_task: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    pass_threshold: float = 1.0,
    batch_size: int = 32,
    seed: int = 0,
    model: torch.nn.Module | None = None,
) -> EvalReport:
    """Score `loaded` (or `model`, a live policy sharing its tokenizer) on tasks seed_start .. + num_tasks - 1."""
    tok = loaded.tokenizer
    policy = model if model is not None else loaded.model
    view = LoadedModel(policy, tok, loaded.spec, loaded.eos_token_ids, loaded.max_context)  # type: ignore[arg-type]
    tasks = seed_range_tasks(env, seed_start, num_tasks)
    jobs: list[tuple[int, int, Any, list[int]]] = []
    for s, task in enumerate(tasks, seed_start):
        ids = render_prompt(tok, task, tokenize=True)
        prompt = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
        jobs.extend((s, k, task, prompt) for k in range(samples_per_task))
    params = SamplingParams(temperature=temperature)
    was_training = policy.training
    policy.eval()
    t0 = time.monotonic()
    samples: list[EvalSample] = []
    try:
        engine = Engine(view)
        for i in range(0, len(jobs), batch_size):
            chunk = jobs[i : i + batch_size]
            gens = engine.generate([j[3] for j in chunk], params,
                                   [derive_seed("eval", seed, s, k) for s, k, _, _ in chunk], max_new_tokens)
            for (s, k, task, _), gen in zip(chunk, gens, strict=True):
                text = str(tok.decode(gen.tokens, skip_special_tokens=True))
                try:
                    reward: float | None = env.reward(task, text, completion_tokens=len(gen.tokens))
                except UngradableError as exc:
                    log.warning("task seed %d sample %d could not be graded: %s", s, k, exc)
                    reward = None
                samples.append(EvalSample(s, k, task.question(), reward, len(gen.tokens), gen.finish_reason, text))
    finally:
        policy.train(was_training)
    graded = [x.reward for x in samples if x.reward is not None]
    n = len(samples)
    return EvalReport(
        env=env.name, env_version=env.version, seed_start=seed_start, num_tasks=num_tasks,
        samples_per_task=samples_per_task, temperature=temperature, max_new_tokens=max_new_tokens,
        pass_threshold=pass_threshold,
        mean_reward=sum(graded) / len(graded) if graded else 0.0,
        pass_rate=sum(r >= pass_threshold for r in graded) / len(graded) if graded else 0.0,
        mean_completion_tokens=sum(x.completion_tokens for x in samples) / n if n else 0.0,
        truncated_rate=sum(x.finish_reason == "length" for x in samples) / n if n else 0.0,
        ungradable=n - len(graded), generation_s=time.monotonic() - t0, samples=samples,
    )


def write_report(report: EvalReport, path: Path) -> None:
    """The report as JSON, written to a temporary file and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(report), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def run_eval(cfg: EvalConfig) -> EvalReport:
    from transformers.utils import logging as hf_logging

    from environments import get as get_env
    from models import load

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    loaded = load(cfg.model, dtype=cfg.dtype, device=device)
    env = get_env(cfg.env, cfg.env_version)
    report = evaluate(loaded, env, cfg.seed_start, cfg.num_tasks, samples_per_task=cfg.samples_per_task,
                      temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                      pass_threshold=cfg.pass_threshold, batch_size=cfg.batch_size, seed=cfg.seed)
    for x in report.samples[: cfg.show]:
        print(f"seed {x.seed}: {x.question[:60]!r} -> {x.completion[:100]!r} (reward {x.reward})")
    print(json.dumps(report.summary(), indent=1, sort_keys=True))
    if cfg.output is not None:
        write_report(report, cfg.output)
    return report
