"""`prime-trainer eval`: score a model on a held-out seed range of an environment.

Task seed s is `env.sample(s, 1)[0]` (the same rule as SFT data, `trainer.sft_data.seed_range_tasks`),
so disjoint seed ranges are disjoint task draws. Each task's prompt is rendered as the node renders it
(`environments.render_prompt`), `samples_per_task` completions are generated with the `models/` engine
(greedy at temperature 0, else seeded Gumbel-max sampling with seeds derived from (seed, task seed, k)),
and graded with the environment's reward. The report: mean reward, pass rate (reward >= threshold),
mean completion length in tokens, the share that hit the length limit, and every sample's reward.
A sample the environment could not grade (`UngradableError`) is counted apart, never scored 0.

A multi-turn environment is played as the local mode plays it (`trainer.local.play_episodes`: turn by turn,
`max_new_tokens` per turn, the environment's replies appended as tokens), with the environment seed
`held_out_env_seed(s)`; the reward is the episode's score, the completion the whole interleaved sequence after
the prompt, its tokens the model's own, and `length` means the last model turn hit the limit.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from environments import ChatRenderer, Environment, MultiTurnEnvironment, UngradableError, render_prompt
from models import LoadedModel
from models.engine import Engine
from models.sampling import SamplingParams
from protocol.errors import ConfigError, TrainerError
from trainer.config import EvalConfig, EvalSettings, SFTConfig, TrainerConfig, eval_label
from trainer.distributed import DistInfo, barrier
from trainer.local import PlayedEpisode, derive_seed, play_episodes
from trainer.sft_data import held_out_env_seed, seed_range_tasks

if TYPE_CHECKING:
    from trainer.loop import TrainLoop

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
    turns: int = 1
    """Model turns (a multi-turn environment's episode; 1 otherwise)."""


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
        if isinstance(env, MultiTurnEnvironment):
            samples = _episodes(engine, env, loaded, jobs, params, max_new_tokens, batch_size, seed)
        else:
            samples = _completions(engine, env, loaded, jobs, params, max_new_tokens, batch_size, seed)
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


def _completions(engine: Engine, env: Environment, loaded: LoadedModel, jobs: list[tuple[int, int, Any, list[int]]],
                 params: SamplingParams, max_new_tokens: int, batch_size: int, seed: int) -> list[EvalSample]:
    """One completion per job of a single-turn environment, `batch_size` at a time, graded by its reward."""
    tok = loaded.tokenizer
    samples = []
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
    return samples


def _episodes(engine: Engine, env: MultiTurnEnvironment, loaded: LoadedModel, jobs: list[tuple[int, int, Any, list[int]]],
              params: SamplingParams, max_new_tokens: int, batch_size: int, seed: int) -> list[EvalSample]:
    """The held-out episodes of `jobs`, `batch_size` at a time (see the module docstring)."""
    renderer = ChatRenderer(loaded.tokenizer)  # refuses a template that rewrites earlier turns
    samples = []
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i : i + batch_size]
        playing = [PlayedEpisode(task, s, derive_seed("eval", seed, s, k), prompt,
                                 env.start(task, held_out_env_seed(s))) for s, k, task, prompt in chunk]
        play_episodes(engine, env, renderer, playing, params, max_new_tokens, loaded.max_context)
        for (s, k, task, _), e in zip(chunk, playing, strict=True):
            reward: float | None = None
            if e.ungradable is not None:
                log.warning("task seed %d sample %d: the environment could not answer a turn: %s", s, k, e.ungradable)
            else:
                try:
                    reward = env.score_state(task, e.state)
                except UngradableError as exc:
                    log.warning("task seed %d sample %d could not be graded: %s", s, k, exc)
            samples.append(EvalSample(s, k, task.question(), reward, len(e.generated), e.finish_reason,
                                      renderer.decode(e.ids[e.prompt_len:]), turns=len(e.spans)))
    return samples


# What goes into the metrics of a step with an evaluation, as `eval/<label>/<name>` (label: `greedy`, `t1`, ...).
EVAL_KEYS = ("mean_reward", "pass_rate", "mean_completion_tokens", "truncated_rate", "ungradable", "generation_s")


class ScheduledEval:
    """`eval.every`: the held-out evaluation the training loop runs every N steps and after the last step.

    It scores the live policy (the weights after the step: checkpoint `step-<n+1>`, version n+1 for the
    row of step n) on the same seed range every time, once per configured temperature. Under torchrun
    the policy is sharded: every rank gathers the full weights (a collective), rank 0 loads them into
    its own copy of the model and evaluates while the others wait at a barrier.
    """

    def __init__(self, settings: EvalSettings, loaded: LoadedModel, env: Environment, max_new_tokens: int,
                 dist_info: DistInfo | None = None, device: torch.device | None = None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.env = env
        self.max_new_tokens = max_new_tokens
        self.dist = dist_info or DistInfo()
        self.copy: torch.nn.Module | None = None
        if self.dist.enabled and self.dist.is_main:  # before the trainer shards `loaded.model`
            model: torch.nn.Module = copy.deepcopy(loaded.model)
            self.copy = model.to(device or torch.device("cpu")).eval().requires_grad_(False)

    def due(self, steps_done: int, max_steps: int) -> bool:
        every = self.settings.every
        return every > 0 and (steps_done % every == 0 or steps_done >= max_steps)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """`eval/<label>/<name>` for every configured temperature, and `eval/time_s`."""
        s = self.settings
        out: dict[str, float] = {}
        t0 = time.monotonic()
        for temperature in s.temperatures:
            report = evaluate(self.loaded, self.env, s.seed_start, s.num_tasks, samples_per_task=s.samples_per_task,
                              temperature=temperature, max_new_tokens=self.max_new_tokens,
                              pass_threshold=s.pass_threshold, batch_size=s.batch_size, seed=s.seed, model=model)
            label = eval_label(temperature)
            out.update({f"eval/{label}/{k}": float(getattr(report, k)) for k in EVAL_KEYS})
        out["eval/time_s"] = time.monotonic() - t0
        return out

    def run(self, loop: TrainLoop) -> dict[str, float]:
        if not self.dist.enabled:
            out = self.evaluate(loop.model)
        else:
            state = loop.full_model_state()  # every rank takes part
            out = {}
            if self.copy is not None:
                missing, unexpected = self.copy.load_state_dict(state, strict=False)
                if unexpected or any(k != "lm_head.weight" for k in missing):  # a tied head has no entry of its own
                    raise TrainerError(f"scheduled eval: gathered weights do not fit the model "
                                       f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
                out = self.evaluate(self.copy)
            barrier()
        log.info("held-out eval after %d steps on %s seeds [%d, %d): %s", loop.step, self.env.name,
                 self.settings.seed_start, self.settings.seed_start + self.settings.num_tasks,
                 " ".join(f"{k[5:]} {v:.3f}" for k, v in out.items() if k.endswith(("pass_rate", "mean_reward"))))
        return out


def build_scheduled_eval(cfg: TrainerConfig | SFTConfig, loaded: LoadedModel, dist_info: DistInfo | None = None,
                         device: torch.device | None = None) -> ScheduledEval | None:
    """The run's `[eval]` schedule, None when `eval.every` is 0. The environment defaults to the training one
    (`data.env`, local mode and SFT environment data; the config refuses `every` without one), the length
    limit to `data.max_new_tokens` (local mode) or 64."""
    from environments import get as get_env

    settings = cfg.eval
    if not settings.every:
        return None
    env, env_version = settings.env, settings.env_version
    if env is None:
        env = getattr(cfg.data, "env", None)
        env_version = env_version or getattr(cfg.data, "env_version", None)
    if env is None:  # the config validators refuse this; kept for configs built without validation
        raise ConfigError("eval.env: name the environment to evaluate on")
    max_new_tokens = settings.max_new_tokens or getattr(cfg.data, "max_new_tokens", None) or 64
    return ScheduledEval(settings, loaded, get_env(env, env_version), max_new_tokens, dist_info, device)


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
