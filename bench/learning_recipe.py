"""Does the SFT warm-up make RL work? Base model vs SFT vs SFT+RL vs RL alone on the same held-out tasks.

    python -m bench.learning_recipe --quick --json bench/measured/learning_recipe_quick.json   # pipeline check
    python -m bench.learning_recipe --json bench/measured/learning_recipe.json                # the recipe
    python -m bench.learning_recipe --smoke --json out.json   # the tiny model, one step of each stage (seconds)

The shipped recipe (configs/trainer/reverse-text-smollm2-sft.toml, then
configs/trainer/reverse-text-smollm2-sft-rl.toml) with the step counts and directories replaced:

1. `base`: the model as loaded, scored by `trainer.evaluate` on reverse-text task seeds
   [seed_start, seed_start + eval_tasks) (greedy, the same tasks and sample count for every row);
2. `sft`: after `--sft-steps` supervised steps on task seeds [0, 8192) with reference answers;
3. `sft+rl`: after `--rl-steps` GRPO steps (local mode) starting from the SFT model;
4. `rl`: after the same GRPO steps, same rollout budget and task stream, starting from the base model.

The table gives mean reward, pass rate (exact reversal), mean completion length, training samples and
seconds; the ratios compare each row with `base` and `sft+rl` with `rl` measured in the same run. The
JSON also holds the SFT loss and RL reward curves, machine, threads and the load average (the box is
shared: seconds are what this run got, not what the code needs). `eval_in_sft_data` counts held-out
tasks whose question text also occurs in the SFT seed range (short strings repeat across seeds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads collapse on a shared box (NOTES.md)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import environments  # noqa: E402
from bench import harness  # noqa: E402
from bench.harness import ROOT  # noqa: E402
from models import load  # noqa: E402
from protocol.model_spec import HFModelSpec, SmolLM2Spec, TinyModelSpec  # noqa: E402
from trainer.checkpoint import list_checkpoints  # noqa: E402
from trainer.config import SFTConfig, TrainerConfig  # noqa: E402
from trainer.evaluate import EvalReport, evaluate  # noqa: E402
from trainer.runner import run as run_rl  # noqa: E402
from trainer.sft import run_sft  # noqa: E402

SFT_TOML = ROOT / "configs/trainer/reverse-text-smollm2-sft.toml"
RL_TOML = ROOT / "configs/trainer/reverse-text-smollm2-sft-rl.toml"
TINY = {"type": "tiny", "seed": 0, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2}


def _toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def score(spec: Any, args: argparse.Namespace) -> tuple[EvalReport, EvalReport | None, float]:
    """Greedy (one sample per task) and, with `--eval-samples`, sampled at temperature 1 on the same tasks."""
    t0 = time.monotonic()
    loaded = load(spec, device=args.device)
    env = environments.get(args.env)
    report = evaluate(loaded, env, args.seed_start, args.eval_tasks, samples_per_task=1, temperature=0.0,
                      max_new_tokens=args.max_new_tokens, batch_size=args.eval_batch)
    sampled = None
    if args.eval_samples:
        sampled = evaluate(loaded, env, args.seed_start, args.eval_tasks, samples_per_task=args.eval_samples,
                           temperature=1.0, max_new_tokens=args.max_new_tokens, batch_size=args.eval_batch)
    del loaded
    gc.collect()
    return report, sampled, time.monotonic() - t0


def sft_stage(args: argparse.Namespace, work: Path, model: dict[str, Any]) -> tuple[Path, float, list[dict[str, Any]]]:
    raw = _toml(SFT_TOML)
    raw.update(model=model, max_steps=args.sft_steps, torch_threads=args.threads, progress=not args.quiet,
               metrics_file=str(work / "sft.jsonl"), output_dir=str(work / "sft-model"), device=args.device,
               dtype=args.train_dtype)
    raw["data"]["env"] = args.env
    if args.sft_batch:
        raw["batch"]["examples_per_step"] = args.sft_batch
    if args.sft_lr:
        raw["optim"]["lr"] = args.sft_lr
    args.sft_batch, args.sft_lr = raw["batch"]["examples_per_step"], raw["optim"]["lr"]
    raw["optim"]["warmup_steps"] = min(raw["optim"]["warmup_steps"], max(1, args.sft_steps // 10))
    raw["checkpoint"].update(dir=str(work / "sft-ck"), interval=max(1, args.sft_steps))
    t0 = time.monotonic()
    run_sft(SFTConfig.model_validate(raw))
    gc.collect()
    return work / "sft-model", time.monotonic() - t0, _jsonl(work / "sft.jsonl")


def rl_stage(args: argparse.Namespace, work: Path, name: str, model: dict[str, Any]) -> tuple[Path, float, list[dict[str, Any]]]:
    raw = _toml(RL_TOML)
    raw.update(model=model, max_steps=args.rl_steps, torch_threads=args.threads, progress=not args.quiet,
               metrics_file=str(work / f"{name}.jsonl"), device=args.device, dtype=args.train_dtype)
    raw.pop("eval", None)  # this bench scores the checkpoints itself, on its own tasks
    if args.rl_lr:
        raw["optim"]["lr"] = args.rl_lr
    if args.std_normalize is not None:
        raw["loss"]["std_normalize"] = args.std_normalize
    args.rl_lr = raw["optim"]["lr"]
    raw["batch"]["groups_per_step"] = args.rl_groups
    raw["data"].update(group_size=args.rl_group_size, max_new_tokens=args.max_new_tokens, env=args.env)
    every = args.rl_eval_every or args.rl_steps
    raw["checkpoint"].update(dir=str(work / f"{name}-ck"), interval=max(1, every), keep=args.rl_steps // max(1, every) + 1)
    raw["publish"] = {"type": "none"}
    t0 = time.monotonic()
    run_rl(TrainerConfig.model_validate(raw))
    gc.collect()
    return work / f"{name}-ck" / f"step-{args.rl_steps}", time.monotonic() - t0, _jsonl(work / f"{name}.jsonl")


def row(name: str, scored: tuple[EvalReport, EvalReport | None, float], train_samples: int,
        train_s: float) -> dict[str, Any]:
    report, sampled, eval_s = scored
    extra = {} if sampled is None else {"sampled_pass_rate": sampled.pass_rate, "sampled_mean_reward": sampled.mean_reward,
                                        "sampled_samples_per_task": sampled.samples_per_task}
    print(f"scored {name}: pass {report.pass_rate:.3f} reward {report.mean_reward:.3f}"
          + ("" if sampled is None else f", sampled pass {sampled.pass_rate:.3f}")
          + f" ({train_samples} training samples, {train_s:.0f} s training, {eval_s:.0f} s scoring)", flush=True)
    return {"stage": name, **report.summary(), **extra, "eval_s": eval_s, "train_samples": train_samples,
            "train_s": train_s,
            "examples": [{"question": s.question, "completion": s.completion, "reward": s.reward}
                         for s in report.samples[:5]]}


def main() -> None:
    p = harness.parser(__doc__, smoke="the tiny model, 1 SFT step, 1 RL step, 2 eval tasks, 1 thread (seconds; checks "
                       "the bench, measures nothing)", quick="tiny budgets: checks the pipeline, not the recipe")
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    sft, rl = _toml(SFT_TOML), _toml(RL_TOML)
    p.add_argument("--sft-steps", type=int, default=sft["max_steps"])
    p.add_argument("--sft-batch", type=int, default=0, help="SFT examples per step (0: the SFT config's)")
    p.add_argument("--sft-lr", type=float, default=0.0, help="0: the SFT config's")
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-groups", type=int, default=rl["batch"]["groups_per_step"], help="prompts per RL step")
    p.add_argument("--rl-group-size", type=int, default=rl["data"]["group_size"], help="completions per prompt")
    p.add_argument("--rl-lr", type=float, default=0.0, help="0: the RL config's")
    p.add_argument("--eval-tasks", type=int, default=128)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--seed-start", type=int, default=1_000_000, help="first held-out task seed")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--skip-rl-alone", action="store_true", help="leave out the RL-from-base row")
    p.add_argument("--skip-base", action="store_true", help="leave out the base model's row")
    p.add_argument("--sft-dir", type=Path, help="start RL from this SFT model instead of training one")
    p.add_argument("--rl-eval-every", type=int, default=0, help="also score the RL checkpoints every N steps")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="also score K samples per task at temperature 1 (sampled pass rate)")
    p.add_argument("--env", default="reverse-text", help="the environment (SFT data needs reference answers)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--train-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the trainers' compute dtype (auto: fp32 on CPU, bf16 autocast on GPU; bfloat16 on a CPU "
                   "with fast bf16 matmul trains ~1.5x faster)")
    p.add_argument("--std-normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="divide RL advantages by the group's reward std (default: the RL config's)")
    p.add_argument("--work", type=Path, help="keep checkpoints here (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    args = p.parse_args()
    if args.quick:
        args.sft_steps, args.sft_batch, args.rl_steps, args.rl_groups, args.rl_group_size = 4, 8, 2, 2, 4
        args.eval_tasks, args.max_new_tokens = 16, 32
    if args.smoke:
        args.model, args.threads = "tiny", 1
        args.sft_steps, args.sft_batch, args.rl_steps, args.rl_groups, args.rl_group_size = 1, 2, 1, 1, 2
        args.eval_tasks, args.eval_batch, args.max_new_tokens = 2, 2, 8
    if args.model == "tiny":  # a random model: only the pipeline is being checked, with larger steps
        args.sft_lr, args.rl_lr = args.sft_lr or 3e-3, args.rl_lr or 1e-3
    torch.set_num_threads(args.threads)
    base_spec = SmolLM2Spec() if args.model == "smollm2" else TinyModelSpec(**{k: v for k, v in TINY.items()
                                                                                if k != "type"})
    base_model = {"type": "smollm2"} if args.model == "smollm2" else TINY
    load_before = os.getloadavg()
    work = args.work or Path(tempfile.mkdtemp(prefix="learning-recipe-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    t_start = time.monotonic()
    sft_samples = 0 if args.sft_dir else args.sft_steps * args.sft_batch
    try:
        if not args.skip_base:
            rows.append(row("base", score(base_spec, args), 0, 0.0))
        sft_curve: list[dict[str, Any]] = []
        if args.sft_dir:
            sft_dir, sft_s = args.sft_dir, 0.0
        else:
            sft_dir, sft_s, sft_curve = sft_stage(args, work, base_model)
        rows.append(row("sft", score(HFModelSpec(name_or_path=str(sft_dir)), args), sft_samples, sft_s))
        per_step = args.rl_groups * args.rl_group_size
        ck, rl_s, sftrl_curve = rl_stage(args, work, "sft-rl", {"type": "hf", "name_or_path": str(sft_dir)})
        for step, path in list_checkpoints(work / "sft-rl-ck"):
            name = "sft+rl" if step == args.rl_steps else f"sft+rl@{step}"
            rows.append(row(name, score(HFModelSpec(name_or_path=str(path)), args), sft_samples + step * per_step,
                            sft_s + rl_s * step / args.rl_steps))
        rl_curve: list[dict[str, Any]] = []
        if not args.skip_rl_alone:
            ck, rl_s, rl_curve = rl_stage(args, work, "rl", base_model)
            rows.append(row("rl", score(HFModelSpec(name_or_path=str(ck)), args), args.rl_steps * per_step, rl_s))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    env = environments.get(args.env)
    sft_questions = {env.sample(s, 1)[0].question() for s in range(0, 8192)}
    eval_questions = [env.sample(s, 1)[0].question() for s in range(args.seed_start, args.seed_start + args.eval_tasks)]
    by = {r["stage"]: r for r in rows}

    def ratio(a: str, b: str) -> float | None:
        if a not in by or b not in by or not by[b]["mean_reward"]:
            return None
        return float(by[a]["mean_reward"] / by[b]["mean_reward"])

    result = {
        "machine": harness.machine(),
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "model": args.model,
        "quick": args.quick,
        "smoke": args.smoke,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
        "eval_in_sft_data": sum(q in sft_questions for q in eval_questions),
        "rows": rows,
        "ratios": {"sft_over_base": ratio("sft", "base"), "sft_rl_over_base": ratio("sft+rl", "base"),
                   "sft_rl_over_rl": ratio("sft+rl", "rl"), "rl_over_base": ratio("rl", "base")},
        "curves": {"sft_loss": [m["loss"] for m in sft_curve],
                   "sft_rl_reward": [m["reward_mean"] for m in sftrl_curve],
                   "rl_reward": [m["reward_mean"] for m in rl_curve]},
        "total_s": time.monotonic() - t_start,
    }
    print(f"\n{'stage':<12}{'mean_reward':>12}{'pass_rate':>11}{'sampled':>9}{'compl_tok':>11}{'truncated':>11}"
          f"{'train_samples':>15}{'train_s':>9}")
    for r in rows:
        sampled = f"{r['sampled_pass_rate']:>9.3f}" if "sampled_pass_rate" in r else f"{'-':>9}"
        print(f"{r['stage']:<12}{r['mean_reward']:>12.3f}{r['pass_rate']:>11.3f}{sampled}"
              f"{r['mean_completion_tokens']:>11.1f}{r['truncated_rate']:>11.2f}{r['train_samples']:>15}"
              f"{r['train_s']:>9.0f}")
    print("ratios (mean reward): " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items() if v is not None))
    print(f"({args.model}, {args.eval_tasks} held-out tasks from seed {args.seed_start} (greedy, {args.max_new_tokens} "
          f"new tokens; {result['eval_in_sft_data']} also in the SFT range), SFT {args.sft_steps}x{args.sft_batch}, "
          f"RL {args.rl_steps}x{args.rl_groups}x{args.rl_group_size}, {result['threads']} threads, load "
          f"{load_before[0]:.1f} -> {result['load_average_after'][0]:.1f}, {result['total_s']:.0f} s)")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
