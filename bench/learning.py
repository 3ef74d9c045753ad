"""Learning through the network vs local mode: the same GRPO recipe and sample budget, per sample.

    python -m bench.learning --quick --json out.json      # tiny model on lowercase, ~6 min on 2 CPU cores (15 steps each)
    python -m bench.learning --json out.json              # tiny model, ~12 min (40 steps each)
    python -m bench.learning --smoke --json out.json      # tiny, 1 step each on the smallest devnet, with a held-out
                                                          # evaluation of 2 tasks: checks the bench, measures nothing
    python -m bench.learning --model smollm2 --init runs/reverse-text-smollm2-sft/checkpoints/step-80 --json out.json
    python -m bench.learning --model smollm2 --sft-steps 120 --work runs/learning-smollm2 --json out.json

Anchor: `prime-trainer` in local mode (`data.type = "local"`: it generates its own on-policy rollouts, staleness
0). Measured: `prime-devnet up` with the same model, starting weights, environment, group size, groups per step,
generation length, sampling temperature, learning rate (and warm-up), advantage normalization and step count,
where the samples come through the network instead: nodes generate with weights pulled over SHARDCAST relays,
validators check them (TOPLOC, sampling replay, rewards), the trainer reads the validators' feeds with async level
2 (samples up to two versions old). Both runs train on the same number of samples per step, so step n of each has
seen about the same number of samples (a network step that waited `--trainer.fill-timeout-s` may train on fewer;
the curves are against samples seen). The two runs go one after the other (never side by side: they would share
the cores); wall times are recorded, not compared as a speed claim. Tasks differ between the runs (local draws
from its task seed, nodes from their assignments), so the curves agree within noise, not bit for bit.

Models:
- `tiny` (default): the seeded tiny model on `lowercase` (group 8, 12 tokens, 4 groups per step, lr 0.005), 2
  nodes, 2 validators, 2 relays; no held-out evaluation unless `--eval-every`.
- `smollm2`: SmolLM2-135M on reverse-text, both runs from the same SFT checkpoint (`--init DIR`, or made first by
  `prime-trainer sft --config configs/trainer/reverse-text-smollm2-sft.toml --max-steps N` with `--sft-steps N`).
  The RL recipe is configs/trainer/reverse-text-smollm2-sft-rl.toml (`--recipe`), whose values the flags override
  (`--lr`, `--std-normalize/--no-std-normalize`, `--steps`, `--groups`, `--group-size`, `--max-new-tokens`,
  `--temperature`): local mode runs `prime-trainer --config <recipe>` with them, the devnet gets the same values
  (`--trainer.lr`, `--trainer.std-normalize`, `--trainer.warmup-steps`, `--run.temperature`, ...); a recipe setting
  the devnet cannot pass on (another clip range, KL, ...) is refused before anything runs. 3 nodes, 2 validators,
  2 relays. Held-out evaluation (`eval.every`, greedy and sampled at temperature 1, task seeds from 1000000:
  disjoint from SFT's [0, 8192) and from RL's hashed seeds) in both runs, and the starting checkpoint scored once
  with the same settings (`prime-trainer eval`): the table shows the pass rate at step 0 and the gain.

The tables: the reward per sample curve of both runs (mean reward of each step's training samples) with 3-step
moving averages and their ratio; the held-out pass rate (greedy, sampled) and mean reward at each evaluation
point; wall time per step and, for the network, where the time goes (trainer waiting for data vs training vs
evaluating vs checkpointing, node generation, validation latency, publication and its chain share, propagation
from a signed manifest to a node's first batch at that version) from the roles' own metrics; the devnet's audit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import harness

REPO = harness.ROOT

SFT_TOML = REPO / "configs/trainer/reverse-text-smollm2-sft.toml"
RL_TOML = REPO / "configs/trainer/reverse-text-smollm2-sft-rl.toml"
TINY = {"type": "tiny", "hidden_size": 128, "intermediate_size": 256, "seed": 0}  # devnet/network.py TINY
SEQ_LEN = {"tiny": 256, "smollm2": 512}  # the devnet trainer's batch.seq_len per model (devnet/network.py)
PY = sys.executable
TASKS_PER_BATCH = 2  # the devnet's run.tasks_per_batch (its default): groups per submission


@dataclass
class Recipe:
    """What both runs share: the model and starting weights, the task stream's environment, the RL settings,
    the step count and the held-out evaluation."""

    model: str
    env: str
    group_size: int
    groups_per_step: int
    lr: float
    max_new_tokens: int
    temperature: float = 1.0
    std_normalize: bool = False
    warmup_steps: int = 0
    steps: int = 40
    init: str | None = None
    eval_every: int = 0
    eval_tasks: int = 64
    eval_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    eval_seed_start: int = 1_000_000
    eval_samples: int = 1
    local_task_seed: int = 0
    local_threads: int = 1
    train_dtype: str = "auto"
    """Both trainers' compute dtype (`dtype`: auto = float32 on CPU; bfloat16 = autocast)."""
    recipe_file: str | None = None
    fill_timeout_s: float = 20.0
    """The network trainer's `batch.fill_timeout_s`: a step that waited this long trains on the groups it has."""

    def eval_flags(self, prefix: str) -> list[str]:
        if not self.eval_every:
            return []
        return [f"--{prefix}every", str(self.eval_every), f"--{prefix}num-tasks", str(self.eval_tasks),
                f"--{prefix}temperatures", ",".join(f"{t:g}" for t in self.eval_temperatures),
                f"--{prefix}seed-start", str(self.eval_seed_start), f"--{prefix}samples-per-task",
                str(self.eval_samples), f"--{prefix}max-new-tokens", str(self.max_new_tokens)]


# ------------------------------------------------------------------------------------- the recipe
CARRIED = {("optim", "lr"), ("optim", "warmup_steps"), ("loss", "std_normalize"), ("loss", "temperature")}
"""Recipe settings the devnet's trainer takes (devnet/config.py); every other [loss] and [optim] value of the
recipe must be the trainer's default, which is what the devnet's trainer runs with."""


def devnet_gaps(recipe: dict[str, Any]) -> list[str]:
    """Settings of the recipe TOML the devnet cannot give its trainer (they differ from the trainer's defaults)."""
    from trainer.config import LossSettings, OptimSettings

    gaps = []
    for section, defaults in (("loss", LossSettings()), ("optim", OptimSettings())):
        for key, value in recipe.get(section, {}).items():
            if (section, key) not in CARRIED and getattr(defaults, key, object()) != value:
                gaps.append(f"{section}.{key} = {value!r} (the devnet's trainer runs with {getattr(defaults, key, '?')!r})")
    data = recipe.get("data", {})
    if data.get("temperature", 1.0) != recipe.get("loss", {}).get("temperature", 1.0):
        gaps.append("data.temperature differs from loss.temperature (the devnet uses one for both)")
    if recipe.get("batch", {}).get("seq_len", SEQ_LEN["smollm2"]) != SEQ_LEN["smollm2"]:
        gaps.append(f"batch.seq_len = {recipe['batch']['seq_len']} (the devnet's smollm2 trainer packs {SEQ_LEN['smollm2']})")
    return gaps


def smollm2_recipe(args: argparse.Namespace, init: str | None) -> Recipe:
    with Path(args.recipe).open("rb") as fh:
        toml = tomllib.load(fh)
    gaps = devnet_gaps(toml)
    if gaps:
        raise SystemExit(f"{args.recipe}: the devnet cannot run this recipe as local mode does: {'; '.join(gaps)} "
                         f"(add the setting to devnet/config.py's trainer section)")
    loss, optim, batch, data = (toml.get(k, {}) for k in ("loss", "optim", "batch", "data"))
    return Recipe(
        model="smollm2", env=data.get("env", "reverse-text"), init=init, recipe_file=str(args.recipe),
        group_size=pick(args.group_size, data.get("group_size", 8)),
        groups_per_step=pick(args.groups, batch.get("groups_per_step", 8)),
        lr=pick(args.lr, optim.get("lr", 1e-5)), max_new_tokens=pick(args.max_new_tokens, data.get("max_new_tokens", 32)),
        temperature=pick(args.temperature, data.get("temperature", 1.0)),
        std_normalize=pick(args.std_normalize, loss.get("std_normalize", False)),
        warmup_steps=optim.get("warmup_steps", 0), steps=pick(args.steps, toml.get("max_steps", 40)),
        eval_every=pick(args.eval_every, 5), eval_tasks=args.eval_tasks, eval_samples=args.eval_samples,
        local_task_seed=data.get("task_seed", 0), local_threads=pick(args.threads, toml.get("torch_threads", 1)),
        fill_timeout_s=pick(args.fill_timeout_s, 600.0), train_dtype=pick(args.train_dtype, toml.get("dtype", "auto")),
    )


def pick(flag: Any, value: Any) -> Any:
    """A flag given on the command line, else the recipe's value."""
    return value if flag is None else flag


def tiny_recipe(args: argparse.Namespace) -> Recipe:
    smoke = args.smoke
    return Recipe(
        model="tiny", env="lowercase", group_size=pick(args.group_size, 4 if smoke else 8),
        groups_per_step=pick(args.groups, 2 if smoke else 4), lr=pick(args.lr, 0.005),
        max_new_tokens=pick(args.max_new_tokens, 8 if smoke else 12), temperature=pick(args.temperature, 1.0),
        std_normalize=bool(args.std_normalize), steps=pick(args.steps, 1 if smoke else 15 if args.quick else 40),
        eval_every=pick(args.eval_every, 1 if smoke else 0), eval_tasks=2 if smoke else args.eval_tasks,
        eval_samples=args.eval_samples, local_threads=pick(args.threads, 1), fill_timeout_s=pick(args.fill_timeout_s, 20.0),
        train_dtype=pick(args.train_dtype, "auto"),
    )


def model_flags(r: Recipe) -> list[str]:
    """The trainer's `--model.*` flags: the starting weights of both runs."""
    if r.init:
        return ["--model.type", "hf", "--model.name-or-path", r.init]
    if r.model == "smollm2":
        return ["--model.type", "smollm2"]
    return ["--model.type", "tiny"] + [f for k, v in TINY.items() if k != "type"
                                       for f in (f"--model.{k.replace('_', '-')}", str(v))]


# ------------------------------------------------------------------------------------- processes
def _jsonl(path: Path) -> list[dict[str, Any]]:
    from devnet.observer import read_metrics

    return read_metrics(path)


class StepClock:
    """When each step's metrics line appeared (the trainer writes it at the end of the step, evaluation
    included): wall time per step as the operator sees it, checkpointing and everything else included."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.time()
        self.seen: dict[int, float] = {}

    def poll(self) -> list[dict[str, Any]]:
        rows = _jsonl(self.path)
        now = time.time()
        for m in rows:
            self.seen.setdefault(int(m["step"]), now)
        return rows

    def per_step(self) -> dict[str, Any]:
        steps = sorted(self.seen)
        times = [self.seen[s] for s in steps]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return {"first_step_s": round(times[0] - self.t0, 1) if times else None,
                "per_step_s": [round(g, 2) for g in gaps],
                "mean_step_s": round(sum(gaps) / len(gaps), 2) if gaps else None}


def _wait(proc: subprocess.Popen[Any], clock: StepClock, steps: int, log: Path, what: str,
          each: Any = None) -> list[dict[str, Any]]:
    while True:
        rows = clock.poll()
        if each is not None:
            each(rows)
        if len(rows) >= steps:
            return rows
        if proc.poll() is not None:
            rows = clock.poll()
            if len(rows) >= steps:
                return rows
            raise RuntimeError(f"{what} exited with {proc.returncode} after {len(rows)} steps; {log} ends:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.5)


def fresh(*paths: Path) -> None:
    """Remove what an earlier run in the same `--work` left at these paths."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def make_sft(work: Path, steps: int, threads: int) -> tuple[str, float]:
    """`prime-trainer sft` with the shipped SFT config for `steps` steps; returns (its model directory, seconds)."""
    out = work / "sft"
    fresh(out)  # a --work reused: the SFT run must not resume the previous one
    cmd = [PY, "-m", "trainer.cli", "sft", "--config", str(SFT_TOML), "--max-steps", str(steps),
           "--output-dir", str(out / "model"), "--checkpoint.dir", str(out / "checkpoints"),
           "--checkpoint.interval", str(steps + 1), "--metrics-file", str(out / "metrics.jsonl"), "--no-progress",
           "--torch-threads", str(threads)]
    t0 = time.monotonic()
    with (work / "sft.log").open("w") as log:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT, env=_env())
    return str(out / "model"), time.monotonic() - t0


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def score_init(r: Recipe) -> dict[str, Any]:
    """The starting weights on the held-out tasks with the runs' `eval` settings (`trainer.evaluate.evaluate`, what
    the trainer's `eval.every` runs, here on the loaded checkpoint): the row of step 0."""
    import torch
    from transformers.utils import logging as hf_logging

    import environments
    from models import load
    from protocol.model_spec import parse_model_spec
    from trainer.evaluate import evaluate

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.set_num_threads(r.local_threads)
    spec = {"type": "hf", "name_or_path": r.init} if r.init else ({"type": "smollm2"} if r.model == "smollm2" else TINY)
    t0 = time.monotonic()
    loaded = load(parse_model_spec(spec))
    env = environments.get(r.env)
    out: dict[str, Any] = {}
    for t in r.eval_temperatures:
        report = evaluate(loaded, env, r.eval_seed_start, r.eval_tasks, samples_per_task=r.eval_samples,
                          temperature=t, max_new_tokens=r.max_new_tokens, seed=0)
        label = "greedy" if t == 0 else f"t{t:g}"
        out[f"eval/{label}/pass_rate"] = report.pass_rate
        out[f"eval/{label}/mean_reward"] = report.mean_reward
    out["eval/time_s"] = time.monotonic() - t0
    del loaded
    return out


def local_cmd(work: Path, r: Recipe) -> list[str]:
    """`prime-trainer` in local mode with the recipe (metrics to `work/local.jsonl`)."""
    metrics = work / "local.jsonl"
    common = ["--max-steps", str(r.steps), "--no-progress", "--metrics-file", str(metrics),
              "--checkpoint.dir", str(work / "local-ck"), "--checkpoint.interval", str(r.steps + 1),
              "--torch-threads", str(r.local_threads), "--dtype", r.train_dtype, "--optim.lr", str(r.lr),
              "--optim.warmup-steps", str(r.warmup_steps),
              "--loss.std-normalize" if r.std_normalize else "--no-loss.std-normalize",
              "--loss.temperature", str(r.temperature), "--data.temperature", str(r.temperature),
              "--data.group-size", str(r.group_size), "--data.max-new-tokens", str(r.max_new_tokens),
              "--batch.groups-per-step", str(r.groups_per_step), *r.eval_flags("eval.")]
    if r.recipe_file:
        # the recipe's own publisher stays (a union section cannot change its type over the TOML's keys): a local
        # directory in the work dir, written once, at the end (the checkpoint interval is past the last step)
        with Path(r.recipe_file).open("rb") as fh:
            publish = tomllib.load(fh).get("publish", {}).get("type", "none")
        if publish not in ("none", "local"):
            raise SystemExit(f"{r.recipe_file}: publish.type {publish!r}: local mode here needs none or local")
        cmd = [PY, "-m", "trainer.cli", "--config", r.recipe_file, *model_flags(r), "--data.type", "local",
               "--data.env", r.env, "--data.task-seed", str(r.local_task_seed), *common,
               *(["--publish.path", str(work / "local-published")] if publish == "local" else [])]
    else:
        cmd = [PY, "-m", "trainer.cli", *model_flags(r), "--data.type", "local", "--data.env", r.env,
               "--batch.seq-len", str(SEQ_LEN[r.model]), "--batch.micro-batch-rows", "8", "--batch.async-level", "0",
               *common]
    return cmd


def local_run(work: Path, r: Recipe) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    """The anchor: `prime-trainer` in local mode with the recipe."""
    metrics = work / "local.jsonl"
    fresh(metrics, work / "local-ck", work / "local-published")  # a --work reused: no resume, no old metrics
    cmd = local_cmd(work, r)
    log = work / "local.log"
    clock = StepClock(metrics)
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=_env())
        try:
            rows = _wait(proc, clock, r.steps, log, "the local trainer")
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    return rows, time.monotonic() - t0, clock.per_step()


def devnet_cmd(work: Path, r: Recipe, nodes: int, validators: int, relays: int) -> list[str]:
    cmd = [PY, "-m", "devnet.cli", "up", "--state-dir", str(work / "devnet"), "--model", r.model,
           "--nodes", str(nodes), "--validators", str(validators), "--relays", str(relays), "--dashboard-port", "0",
           "--trainer.max-steps", str(r.steps), "--trainer.groups-per-step", str(r.groups_per_step),
           "--trainer.lr", str(r.lr), "--trainer.warmup-steps", str(r.warmup_steps), "--trainer.async-level", "2",
           "--trainer.dtype", r.train_dtype,
           "--trainer.std-normalize" if r.std_normalize else "--no-trainer.std-normalize",
           "--run.env", r.env, "--run.samples-per-task", str(r.group_size), "--run.max-new-tokens",
           str(r.max_new_tokens), "--run.temperature", str(r.temperature), "--summary-interval-s", "10",
           "--start-timeout-s", "900", "--trainer.fill-timeout-s", f"{r.fill_timeout_s:g}", *r.eval_flags("trainer.eval.")]
    return cmd + (["--init", r.init] if r.init else [])


class Propagation:
    """The signing time (`created_at_ms`) of every version the origin holds, read while the run goes on (the origin
    keeps only the newest few), to set beside each node's first batch at that version."""

    def __init__(self) -> None:
        self.created: dict[int, float] = {}
        self.next_at = 0.0

    def poll(self, origin: str) -> None:
        import httpx

        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + 3.0
        try:
            for v in httpx.get(origin + "/versions", timeout=5).json().get("versions", []):
                version = int(v["version"])
                if version not in self.created:
                    doc = httpx.get(f"{origin}/v/{version}/manifest", timeout=5).json()
                    self.created[version] = int(doc["manifest"]["created_at_ms"]) / 1000.0
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass


def v0_check(layout: Any, init: str) -> dict[str, Any]:
    """Version 0 of the run is the init checkpoint: the chain's v0 hash is the manifest the relays serve, and the
    weights node-0 and validator-0 pulled as v0 hold the checkpoint's tensors."""
    import httpx
    import torch
    from safetensors.torch import load_file

    from contracts.deployment import Deployment
    from contracts.devchain import dev_identity
    from contracts.policy import PolicyHistory
    from contracts.pool import PoolClient
    from contracts.transactor import connect
    from shardcast.manifest import SignedManifest

    dep = Deployment.load(Path(layout.deployment))
    pool = PoolClient(connect(layout.rpc_url), dep.pool, dev_identity(0))  # reads only (DEV ONLY key)
    history = PolicyHistory(pool, dep.start_block)
    history.refresh()
    signed = SignedManifest.parse(httpx.get(f"{layout.relays[0]}/v/0/manifest", timeout=10).content)
    chain_hash = history.manifest_hash(0)
    ckpt = load_file(str(Path(init) / "model.safetensors"))
    pulled = {}
    for name in (layout.nodes[0]["name"], layout.validators[0]["name"]):
        got = load_file(str(Path(layout.state_dir) / name / "weights" / "v0" / "model.safetensors"))
        pulled[name] = (set(got) <= set(ckpt) and set(ckpt) - set(got) <= {"lm_head.weight"}
                        and all(torch.equal(got[k], ckpt[k]) for k in got))
    return {"chain_hash": "0x" + chain_hash.hex() if chain_hash else None,
            "manifest_hash": "0x" + signed.manifest.content_hash().hex(),
            "signer": signed.signer, "on_chain": chain_hash == signed.manifest.content_hash(),
            "weights_are_init": pulled, "ok": chain_hash == signed.manifest.content_hash() and all(pulled.values())}


def step_parts(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The trainer's mean seconds per step waiting for (local mode: generating) data, training and evaluating, over
    the steps after the first (as the wall time per step, which the first step's start-up would distort)."""
    rows = rows[1:] if len(rows) > 1 else rows
    n = len(rows)
    return {"batch_wait_s": sum(m["batch_wait_s"] for m in rows) / n if n else None,
            "train_s": sum(m.get("train_time_s", 0.0) for m in rows) / n if n else None,
            "eval_s": sum(m.get("eval/time_s", 0.0) for m in rows) / n if n else None}


def _patient_get(url: str, params: dict[str, Any] | None = None, tries: int = 3) -> Any:
    """GET a role's page, asked again on a timeout or a refused connection: on a busy box (CI beside other
    work) a role's answer can take longer than 10 s, which once left a smoke with no validation numbers
    at all. The last failure is raised."""
    import httpx

    for attempt in range(tries):
        try:
            return httpx.get(url, params=params, timeout=30)
        except httpx.HTTPError:
            if attempt == tries - 1:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")  # pragma: no cover


def network_time(layout: Any, rows: list[dict[str, Any]], prop: Propagation) -> dict[str, Any]:
    """Where the network run's time went, from the roles' own numbers: the trainer's metrics (waiting for data,
    training, evaluating; publication and its `publishPolicy` share), each node's `/metrics` (generation seconds,
    batches, tokens, its first batch at each version), each validator's ledger (`GET /v1/submissions`: received
    to decided)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from devnet.dashboard.collector import parse_started, percentile

    out: dict[str, Any] = {}
    last = rows[-1] if rows else {}
    out["trainer"] = {**step_parts(rows),
        "published_versions": last.get("published_versions"),
        "publish_s_per_version": (last["publish_seconds"] / last["published_versions"]
                                  if last.get("published_versions") else None),
        "publish_chain_s_per_version": (last["publish_chain_seconds"] / last["published_versions"]
                                        if last.get("published_versions") else None),
    }
    nodes, delays = [], []
    for node in layout.nodes:
        try:
            text = _patient_get(node["url"] + "/metrics").text
        except httpx.HTTPError:
            nodes.append({"name": node["name"], "up": False})
            continue
        vals: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in ("prime_node_generation_seconds_total", "prime_node_batches_total",
                              "prime_node_tokens_total"):
                    vals[s.name] = s.value
        started = parse_started(text)
        mine = [at - prop.created[v] for v, at in started.items() if v > 0 and v in prop.created]
        delays += mine
        batches = vals.get("prime_node_batches_total", 0.0)
        nodes.append({"name": node["name"], "batches": int(batches),
                      "tokens": int(vals.get("prime_node_tokens_total", 0)),
                      "generation_s": round(vals.get("prime_node_generation_seconds_total", 0.0), 1),
                      "generation_s_per_batch": (round(vals.get("prime_node_generation_seconds_total", 0.0) / batches, 2)
                                                 if batches else None),
                      "propagation_p50_s": percentile(mine, 50)})
    out["nodes"] = nodes
    out["propagation"] = {"versions": len(delays), "p50_s": percentile(delays, 50), "p99_s": percentile(delays, 99)}
    latencies: list[float] = []
    outcomes: dict[str, int] = {}
    for v in layout.validators:
        try:
            items = _patient_get(v["url"] + "/v1/submissions", params={"limit": 10000}).json()["items"]
        except (httpx.HTTPError, ValueError, KeyError):
            continue
        for i in items:
            outcomes[str(i.get("outcome"))] = outcomes.get(str(i.get("outcome")), 0) + 1
            if isinstance(i.get("decided_at"), int | float):
                latencies.append(i["decided_at"] - i["received_at"])
    out["validation"] = {"submissions": outcomes, "decided": len(latencies),
                         "received_to_decided_mean_s": sum(latencies) / len(latencies) if latencies else None,
                         "received_to_decided_p50_s": percentile(latencies, 50),
                         "received_to_decided_p99_s": percentile(latencies, 99)}
    return out


def published_after(origin: Path, versions: int, up: subprocess.Popen[bytes], wait_s: float = 180.0) -> list[dict[str, Any]]:
    """The origin's versions (`devnet.published`: kind, bytes, full bytes, dtype) once it holds `versions` (the
    trainer publishes after a step, in the background), or what it holds after `wait_s`."""
    from devnet.published import published_versions

    deadline = time.monotonic() + wait_s
    rows = published_versions(origin)
    while len(rows) < versions and up.poll() is None and time.monotonic() < deadline:
        time.sleep(1.0)
        rows = published_versions(origin)
    return rows


def devnet_run(work: Path, r: Recipe, nodes: int, validators: int = 2,
               relays: int = 2) -> tuple[list[dict[str, Any]], float, dict[str, Any], str, dict[str, Any]]:
    """`prime-devnet up` with the recipe until its trainer has logged `r.steps` steps; then the audit and the time
    breakdown, read while the network is still up. Returns (metrics, wall s, audit, audit table, extra)."""
    from devnet.network import Layout

    state = work / "devnet"
    log = work / "devnet.log"
    metrics = state / "trainer" / "metrics.jsonl"
    extra: dict[str, Any] = {"command": devnet_cmd(work, r, nodes, validators, relays)}
    prop = Propagation()
    layout: list[Any] = []

    def each(rows: list[dict[str, Any]]) -> None:
        # `up` keeps the other roles serving when the trainer dies (a real network would): no step comes after that
        dead = [line for line in log.read_text(errors="replace").splitlines()
                if line.startswith("prime-devnet: trainer exited with")] if log.exists() else []
        if dead and len(rows) < r.steps:
            raise RuntimeError(f"{dead[-1]} after {len(rows)} steps (an OOM kill shows in `dmesg`)")
        if not layout and (state / "devnet.json").exists():
            try:
                layout.append(Layout.load(state))
            except (ValueError, TypeError, OSError):
                return
        if layout:
            prop.poll(layout[0].origin)
            if rows and r.init and "v0" not in extra:  # while node-0 still holds v0 (it keeps a few versions)
                try:
                    extra["v0"] = v0_check(layout[0], r.init)
                except Exception as exc:  # noqa: BLE001 - reported in the JSON, the bench goes on
                    extra["v0"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    # a --work reused: not the last run's steps or layout (`up` then wipes the rest; it refuses a devnet still running)
    fresh(metrics, state / "devnet.json")
    clock = StepClock(metrics)
    audit: dict[str, Any] = {}
    table = ""
    t0 = time.monotonic()
    with log.open("w") as fh:
        up = subprocess.Popen(extra["command"], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=_env())
        try:
            rows = _wait(up, clock, r.steps, log, "prime-devnet up", each)
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 120  # `up` saves the layout once every node is healthy: on a busy box
            while not layout and up.poll() is None and time.monotonic() < deadline:  # the trainer can be first
                each(rows)
                time.sleep(0.5)
            if layout:
                extra["time"] = network_time(layout[0], rows, prop)
            out = subprocess.run([PY, "-m", "devnet.cli", "audit", "--state-dir", str(state), "--json"],
                                 cwd=REPO, capture_output=True, text=True, timeout=300, env=_env())
            audit = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {"error": out.stderr[-500:]}
            table = subprocess.run([PY, "-m", "devnet.cli", "audit", "--state-dir", str(state)],
                                   cwd=REPO, capture_output=True, text=True, timeout=300, env=_env()).stdout
            extra["published"] = published_after(state / "origin", 2, up)
        finally:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=180)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    extra["clock"] = clock.per_step()
    return rows, wall, audit, table, extra


# ------------------------------------------------------------------------------------- tables
def smooth(xs: list[float], w: int = 3) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / len(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def seen(rows: list[dict[str, Any]], group: int) -> list[int]:
    """Samples seen after each step: trained ones, plus those of groups filtered for no signal or too long."""
    total, out = 0, []
    for m in rows:
        total += int(m["samples"]) + int(m.get("filtered_groups", 0)) * group + int(m.get("too_long_samples", 0))
        out.append(total)
    return out


def eval_rows(run: str, rows: list[dict[str, Any]], samples: list[int], labels: list[str]) -> list[dict[str, Any]]:
    out = []
    for m, s in zip(rows, samples, strict=False):
        if any(f"eval/{lb}/pass_rate" in m for lb in labels):
            out.append({"run": run, "after_steps": int(m["step"]) + 1, "samples": s,
                        **{f"{lb}_pass_rate": m.get(f"eval/{lb}/pass_rate") for lb in labels},
                        **{f"{lb}_mean_reward": m.get(f"eval/{lb}/mean_reward") for lb in labels}})
    return out


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_evals(init: dict[str, Any], evals: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    print(f"\nheld-out evaluation ({', '.join(labels)}): pass rate (reward >= 1) and mean reward")
    head = " ".join(f"{lb + ' pass':>11} {lb + ' reward':>13}" for lb in labels)
    print(f"{'run':>8} {'after':>5} {'samples':>7} {head}")
    rows = [{"run": "init", "after_steps": 0, "samples": 0,
             **{f"{lb}_pass_rate": init.get(f"eval/{lb}/pass_rate") for lb in labels},
             **{f"{lb}_mean_reward": init.get(f"eval/{lb}/mean_reward") for lb in labels}}] + evals
    for e in rows:
        cells = " ".join(f"{_f(e[f'{lb}_pass_rate']):>11} {_f(e[f'{lb}_mean_reward']):>13}" for lb in labels)
        print(f"{e['run']:>8} {e['after_steps']:>5} {e['samples']:>7} {cells}")
    gains: dict[str, Any] = {}
    for run in ("local", "network"):
        mine = [e for e in evals if e["run"] == run]
        if mine and init:
            gains[run] = {f"{lb}_pass_rate_gain": (mine[-1][f"{lb}_pass_rate"] - init[f"eval/{lb}/pass_rate"]
                                                   if mine[-1][f"{lb}_pass_rate"] is not None else None)
                          for lb in labels}
            print(f"gain {run} (last eval - init): " + ", ".join(
                f"{lb} pass {_f(v, '+.3f')}" for lb, v in zip(labels, gains[run].values(), strict=True)))
    return {"rows": rows, "gains": gains}


def print_time(local_rows: list[dict[str, Any]], local_clock: dict[str, Any], net_clock: dict[str, Any],
               t: dict[str, Any]) -> None:
    lp = step_parts(local_rows)
    loc = {"gen": lp["batch_wait_s"], "train": lp["train_s"], "eval": lp["eval_s"]}
    tr = t.get("trainer", {})
    print("\nwall time per step (seconds; between two steps' metrics lines; the first step excluded, here and in the "
          "parts below it)")
    print(f"{'':40} {'local':>8} {'network':>8}")
    print(f"{'wall per step':40} {_f(local_clock.get('mean_step_s'), '.1f'):>8} {_f(net_clock.get('mean_step_s'), '.1f'):>8}")
    print(f"{'start-up + first step':40} {_f(local_clock.get('first_step_s'), '.0f'):>8} "
          f"{_f(net_clock.get('first_step_s'), '.0f'):>8}")
    print(f"{'trainer: generating / waiting for data':40} {_f(loc['gen'], '.1f'):>8} {_f(tr.get('batch_wait_s'), '.1f'):>8}")
    print(f"{'trainer: training':40} {_f(loc['train'], '.1f'):>8} {_f(tr.get('train_s'), '.1f'):>8}")
    print(f"{'trainer: held-out eval (per step)':40} {_f(loc['eval'], '.1f'):>8} {_f(tr.get('eval_s'), '.1f'):>8}")
    rest: list[float | None] = []
    for clock, parts in ((local_clock, (loc["gen"], loc["train"], loc["eval"])),
                         (net_clock, (tr.get("batch_wait_s"), tr.get("train_s"), tr.get("eval_s")))):
        known = [float(p) for p in parts if p is not None]
        wall = clock.get("mean_step_s")
        rest.append(wall - sum(known) if wall is not None and len(known) == len(parts) else None)
    print(f"{'trainer: checkpoint and the rest':40} {_f(rest[0], '.1f'):>8} {_f(rest[1], '.1f'):>8}")
    print(f"{'publish per version (shardcast+chain)':40} {'-':>8} {_f(tr.get('publish_s_per_version'), '.1f'):>8}")
    print(f"{'  of which publishPolicy (chain)':40} {'-':>8} {_f(tr.get('publish_chain_s_per_version'), '.2f'):>8}")
    p = t.get("propagation", {})
    print(f"{'manifest signed -> node batch p50/p99':40} {'-':>8} {_f(p.get('p50_s'), '.1f'):>8} / {_f(p.get('p99_s'), '.1f')}")
    v = t.get("validation", {})
    print(f"{'validator received -> decided p50/p99':40} {'-':>8} {_f(v.get('received_to_decided_p50_s'), '.1f'):>8} / "
          f"{_f(v.get('received_to_decided_p99_s'), '.1f')}")
    for node in t.get("nodes", []):
        print(f"{node['name'] + ': generation s per batch':40} {'-':>8} {_f(node.get('generation_s_per_batch'), '.1f'):>8} "
              f"({node.get('batches')} batches, {node.get('generation_s')} s generating)")


def parser() -> argparse.ArgumentParser:
    ap = harness.parser(__doc__, smoke="tiny, 1 step each on the smallest devnet (1 node, 1 validator, 1 relay) with 2 "
                        "groups x 4 samples x 8 tokens and a 2-task evaluation: checks the bench",
                        quick="tiny: 15 steps")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="tiny (default) or smollm2")
    ap.add_argument("--init", type=Path, help="smollm2: the SFT checkpoint both runs start from")
    ap.add_argument("--sft-steps", type=int, help="smollm2 without --init: make the checkpoint first with "
                    "`prime-trainer sft --config configs/trainer/reverse-text-smollm2-sft.toml` for this many steps")
    ap.add_argument("--recipe", type=Path, default=RL_TOML, help="smollm2: the RL recipe whose settings both runs use")
    ap.add_argument("--steps", type=int, help="trainer steps of each run (tiny: 40, 15 with --quick; smollm2: the "
                    "recipe's max_steps)")
    ap.add_argument("--lr", type=float, help="learning rate (default: the recipe's)")
    ap.add_argument("--std-normalize", action=argparse.BooleanOptionalAction, default=None,
                    help="divide advantages by the group's std (default: the recipe's)")
    ap.add_argument("--groups", type=int, help="groups per step (default: the recipe's)")
    ap.add_argument("--group-size", type=int, help="samples per group (default: the recipe's)")
    ap.add_argument("--max-new-tokens", type=int, help="generation limit, also of the evaluation (default: the recipe's)")
    ap.add_argument("--temperature", type=float, help="sampling temperature of the training rollouts (default: the "
                    "recipe's)")
    ap.add_argument("--eval-every", type=int, help="held-out evaluation every this many steps and after the last "
                    "(default: smollm2 5, tiny 0 = none, --smoke 1)")
    ap.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks (seeds 1000000 ..)")
    ap.add_argument("--eval-samples", type=int, default=1, help="completions per held-out task and temperature")
    ap.add_argument("--threads", type=int, help="torch threads of the local trainer, SFT and the step-0 evaluation "
                    "(default: the recipe's torch_threads; tiny 1); the devnet's roles use 1 each")
    ap.add_argument("--train-dtype", choices=["auto", "float32", "bfloat16"],
                    help="compute dtype of both trainers (default: the recipe's dtype, else auto = float32 on CPU); "
                    "bfloat16 autocast trains SmolLM2 about 1.5x faster on a CPU with native bf16, far slower on one "
                    "without")
    ap.add_argument("--nodes", type=int, help="devnet nodes (default: tiny 2, smollm2 3; more nodes than a step needs "
                    "over-supply the trainer, whose backlog then makes every step train on older work)")
    ap.add_argument("--validators", type=int, default=2, help="devnet validators (default 2)")
    ap.add_argument("--relays", type=int, default=2, help="devnet relays (default 2)")
    ap.add_argument("--fill-timeout-s", type=float, help="the network trainer trains on the groups it has after waiting "
                    "this long for a step's (default: tiny 20, the devnet's; smollm2 600, so that on a slow box every "
                    "step trains on the recipe's full batch, as local mode does)")
    ap.add_argument("--no-local", action="store_true", help="the network run only (the slow test's short version)")
    ap.add_argument("--work", type=Path, help="keep everything here (SFT model, logs, the devnet's state); default: "
                    "a temporary directory, removed at the end")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.model == "smollm2" and args.smoke:
        ap.error("--smoke runs the tiny model")
    if args.model == "tiny" and (args.init or args.sft_steps):
        ap.error("--init and --sft-steps are for --model smollm2")
    if args.model == "smollm2" and not args.init and not args.sft_steps:
        ap.error("--model smollm2 needs --init DIR (an SFT checkpoint) or --sft-steps N")
    load_before = os.getloadavg()
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="bench-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"] = {**harness.machine(args.threads), "load_average_before": load_before,
                         "load_average_after": os.getloadavg()}
    harness.write_json(args.json, result)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sft: dict[str, Any] | None = None
    init = str(args.init.resolve()) if args.init else None
    if args.model == "smollm2" and init is None:
        with Path(args.recipe).open("rb") as fh:
            threads = args.threads or tomllib.load(fh).get("torch_threads", 1)
        init, sft_s = make_sft(work, args.sft_steps, threads)
        sft = {"steps": args.sft_steps, "seconds": round(sft_s, 1), "model": init,
               "command": f"prime-trainer sft --config {SFT_TOML.relative_to(REPO)} --max-steps {args.sft_steps}"}
    r = smollm2_recipe(args, init) if args.model == "smollm2" else tiny_recipe(args)
    nodes = args.nodes or (1 if args.smoke else 3 if r.model == "smollm2" else 2)
    validators, relays = (1, 1) if args.smoke else (args.validators, args.relays)
    supply = nodes * math.ceil(math.ceil(r.groups_per_step / TASKS_PER_BATCH) / nodes) * TASKS_PER_BATCH
    if supply != r.groups_per_step:
        print(f"note: {nodes} nodes x {TASKS_PER_BATCH} tasks per submission bring {supply} groups per version for "
              f"{r.groups_per_step} per step: the surplus queues and later steps train on older work (staleness); "
              f"a multiple of {nodes * TASKS_PER_BATCH} groups per step avoids it", flush=True)
    labels = ["greedy" if t == 0 else f"t{t:g}" for t in r.eval_temperatures] if r.eval_every else []
    init_eval = score_init(r) if r.eval_every else {}
    local: list[dict[str, Any]] = []
    local_s, local_clock = 0.0, dict[str, Any]()
    if not args.no_local:
        local, local_s, local_clock = local_run(work, r)
    net, net_s, audit, audit_table, extra = devnet_run(work, r, nodes, validators, relays)

    group = r.group_size
    n = min(len(net), r.steps) if args.no_local else min(len(local), len(net), r.steps)
    ls_seen, ns_seen = seen(local, group), seen(net, group)
    lr_ = [m["reward_mean"] for m in local[:n]]
    nr_ = [m["reward_mean"] for m in net[:n]]
    ls_, ns_ = smooth(lr_), smooth(nr_)
    rows = []
    print(f"reward per sample: {r.model} on {r.env}, {r.groups_per_step} groups x {group} samples per step")
    print(f"{'step':>4} {'local n':>7} {'local':>7} {'net n':>7} {'network':>8} {'local~3':>8} {'net~3':>7} "
          f"{'ratio~3':>7} {'net staleness':>13}")
    for i in range(n):
        lv = lr_[i] if i < len(lr_) else None
        ratio = ns_[i] / ls_[i] if i < len(ls_) and ls_[i] else None
        rows.append({"step": i, "samples": (i + 1) * group * r.groups_per_step,
                     "local_samples_seen": ls_seen[i] if i < len(ls_seen) else None, "network_samples_seen": ns_seen[i],
                     "local_reward": lv, "network_reward": nr_[i], "local_smoothed": ls_[i] if i < len(ls_) else None,
                     "network_smoothed": ns_[i], "ratio_smoothed": ratio,
                     "network_staleness_mean": net[i].get("staleness_mean"),
                     "network_stale_samples": net[i].get("stale_samples")})
        print(f"{i:>4} {_f(ls_seen[i] if i < len(ls_seen) else None, 'd'):>7} {_f(lv):>7} {ns_seen[i]:>7} "
              f"{nr_[i]:>8.3f} {_f(ls_[i] if i < len(ls_) else None):>8} {ns_[i]:>7.3f} {_f(ratio, '.2f'):>7} "
              f"{net[i].get('staleness_mean', 0):>13.2f}")
    last = max(1, n // 3)
    tail_local = sum(lr_[-last:]) / last if lr_ else None
    tail_net = sum(nr_[-last:]) / last
    tail_ratio = tail_net / tail_local if tail_local else None
    full = r.groups_per_step * group
    net_step_seen = [b - a for a, b in zip([0, *ns_seen], ns_seen, strict=False)]
    short = [i for i in range(n) if net_step_seen[i] < full]
    if short:
        print(f"network steps with fewer than {full} samples (trained after --fill-timeout-s): {short}")
    print(f"\nlast {last} steps: local {_f(tail_local)}, network {tail_net:.3f}, ratio {_f(tail_ratio, '.2f')}; "
          f"wall: local {local_s:.0f} s, network {net_s:.0f} s (start-up included)")
    evals: dict[str, Any] = {}
    if labels:
        evals = print_evals(init_eval, eval_rows("local", local, ls_seen, labels)
                            + eval_rows("network", net, ns_seen, labels), labels)
    print_time(local, local_clock, extra.get("clock", {}), extra.get("time", {}))
    if "v0" in extra:
        print(f"\nversion 0 = the init checkpoint: {'yes' if extra['v0'].get('ok') else 'NO'} "
              f"(chain hash {extra['v0'].get('chain_hash')}, weights {extra['v0'].get('weights_are_init')})")
    if extra.get("published"):
        from devnet.published import published_lines

        print("\npublished through the origin:\n" + "\n".join(published_lines(extra["published"])))
    print(audit_table)
    return {
        "bench": "learning", "model": r.model, "quick": args.quick, "smoke": args.smoke, "steps": n,
        "samples_per_step": group * r.groups_per_step, "nodes": nodes, "validators": validators, "relays": relays,
        "recipe": {**asdict(r), "network_async_level": 2, "local_async_level": 0,
                   "network_torch_threads_per_role": 1},
        "sft": sft, "rows": rows, "tail_steps": last, "tail_local_reward": tail_local, "tail_network_reward": tail_net,
        "tail_ratio": tail_ratio, "init_eval": init_eval, "evals": evals, "groups_per_version": supply, "network_short_steps": short,
        "local_wall_s": local_s, "network_wall_s": net_s, "local_clock": local_clock,
        "network_clock": extra.get("clock"), "network_time": extra.get("time"), "v0": extra.get("v0"),
        "published": extra.get("published"),
        "network_command": " ".join(extra.get("command", [])), "audit": audit,
        "local_metrics": local, "network_metrics": net,
    }


if __name__ == "__main__":
    main()
