"""Learning through the network vs local mode: the same GRPO recipe and sample budget, per sample.

    python bench/learning.py --quick --json out.json      # ~6 min on 2 CPU cores (15 steps each)
    python bench/learning.py --json out.json              # ~12 min (40 steps each)
    python bench/learning.py --smoke --json out.json      # 1 step each, the smallest devnet (1 node, 1 validator,
                                                          # 1 relay), 2 groups x 4 x 8 tokens: checks the bench

Anchor: `prime-trainer` in local mode (`data.type = "local"`: it generates its own on-policy rollouts,
staleness 0) with the tiny model on `lowercase`. Measured: `prime-devnet up` with the same model, task,
group size (8), generation length (12 tokens), groups per step (4), learning rate and step count, where
the samples come through the network instead: nodes generate with weights pulled over two SHARDCAST
relays, validators check them (TOPLOC, sampling replay, rewards), the trainer reads the validators'
feeds with async level 2 (samples up to two versions old). Both train on 4 x 8 = 32 samples per step,
so step n of each has seen the same number of samples. The table prints both reward curves (mean
reward of the samples each step trained on), their 3-step moving averages and the ratio network /
local per sample count, plus the network run's audit. The two runs go one after the other (never
side by side: they would share the 2 cores); wall times are recorded, not compared. Tasks differ between
the runs (local draws from its task seed, nodes from their assignments), so the curves agree within
noise, not bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = {"type": "tiny", "hidden_size": 128, "intermediate_size": 256, "seed": 0}  # devnet/network.py TINY
GROUP, TOKENS, GROUPS, LR = 8, 12, 4, 0.005


def _jsonl(path: Path) -> list[dict[str, Any]]:
    steps: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                m = json.loads(line)
                steps[int(m["step"])] = m
            except (ValueError, KeyError):
                continue
    return [steps[k] for k in sorted(steps)]


def local_run(work: Path, steps: int) -> tuple[list[dict[str, Any]], float]:
    """The anchor: `prime-trainer` in local mode with the recipe (GROUP, TOKENS, GROUPS, LR)."""
    metrics = work / "local.jsonl"
    flags = ["--model.type", "tiny"] + [f for k, v in MODEL.items() if k != "type" for f in (f"--model.{k.replace('_', '-')}", str(v))]
    cmd = [sys.executable, "-m", "trainer.cli", *flags, "--data.type", "local", "--data.env", "lowercase",
           "--data.group-size", str(GROUP), "--data.max-new-tokens", str(TOKENS), "--batch.groups-per-step",
           str(GROUPS), "--batch.seq-len", "256", "--batch.micro-batch-rows", "8", "--batch.async-level", "0",
           "--optim.lr", str(LR), "--max-steps", str(steps), "--torch-threads", "1", "--no-progress",
           "--checkpoint.dir", str(work / "local-ck"), "--checkpoint.interval", str(steps + 1),
           "--metrics-file", str(metrics)]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return _jsonl(metrics), time.monotonic() - t0


def devnet_run(work: Path, steps: int, nodes: int, validators: int = 2,
               relays: int = 2) -> tuple[list[dict[str, Any]], float, dict[str, Any], str]:
    state = work / "devnet"
    log = (work / "devnet.log").open("w")
    cmd = [sys.executable, "-m", "devnet.cli", "up", "--state-dir", str(state), "--nodes", str(nodes),
           "--validators", str(validators), "--relays", str(relays),
           "--dashboard-port", "0", "--trainer.max-steps", str(steps), "--trainer.groups-per-step", str(GROUPS),
           "--trainer.lr", str(LR), "--trainer.async-level", "2", "--run.samples-per-task", str(GROUP),
           "--run.max-new-tokens", str(TOKENS), "--summary-interval-s", "5"]
    t0 = time.monotonic()
    up = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    metrics = state / "trainer" / "metrics.jsonl"
    audit: dict[str, Any] = {}
    try:
        while len(_jsonl(metrics)) < steps:
            if up.poll() is not None:
                raise RuntimeError(f"prime-devnet up exited: {(work / 'devnet.log').read_text()[-2000:]}")
            time.sleep(2)
        wall = time.monotonic() - t0
        out = subprocess.run([sys.executable, "-m", "devnet.cli", "audit", "--state-dir", str(state), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        audit = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {"error": out.stderr[-500:]}
        table = subprocess.run([sys.executable, "-m", "devnet.cli", "audit", "--state-dir", str(state)],
                               cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
        log.close()
    return _jsonl(metrics), wall, audit, table


def smooth(xs: list[float], w: int = 3) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / len(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="15 steps")
    ap.add_argument("--steps", type=int, help="trainer steps of each run (default 40, 15 with --quick)")
    ap.add_argument("--nodes", type=int, default=2,
                    help="devnet nodes (default 2: with 4 groups per step each node makes one submission per "
                         "version; more nodes than that over-supply the trainer, whose backlog then makes every "
                         "step train on older work)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="1 step each on the smallest devnet (1 node, 1 validator, "
                    "1 relay) with 2 groups x 4 samples x 8 tokens: checks the bench, measures nothing")
    args = ap.parse_args()
    global GROUP, TOKENS, GROUPS
    if args.smoke:
        GROUP, TOKENS, GROUPS = 4, 8, 2
    steps = args.steps or (1 if args.smoke else 15 if args.quick else 40)
    nodes = 1 if args.smoke else args.nodes
    small = 1 if args.smoke else 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = Path(tmp)
        local, local_s = local_run(work, steps)
        net, net_s, audit, audit_table = devnet_run(work, steps, nodes, validators=small, relays=small)
    n = min(len(local), len(net), steps)
    lr_, nr_ = [m["reward_mean"] for m in local[:n]], [m["reward_mean"] for m in net[:n]]
    ls_, ns_ = smooth(lr_), smooth(nr_)
    per_step = GROUPS * GROUP
    rows = []
    print(f"{'step':>4} {'samples':>7} {'local':>7} {'network':>8} {'local~3':>8} {'net~3':>7} {'ratio~3':>7} "
          f"{'net staleness':>13}")
    for i in range(n):
        ratio = ns_[i] / ls_[i] if ls_[i] else None
        rows.append({"step": i, "samples": (i + 1) * per_step, "local_reward": lr_[i], "network_reward": nr_[i],
                     "local_smoothed": ls_[i], "network_smoothed": ns_[i], "ratio_smoothed": ratio,
                     "network_staleness_mean": net[i].get("staleness_mean"),
                     "network_stale_samples": net[i].get("stale_samples")})
        print(f"{i:>4} {(i + 1) * per_step:>7} {lr_[i]:>7.3f} {nr_[i]:>8.3f} {ls_[i]:>8.3f} {ns_[i]:>7.3f} "
              f"{ratio if ratio is not None else float('nan'):>7.2f} {net[i].get('staleness_mean', 0):>13.2f}")
    last = max(1, n // 3)
    tail_local, tail_net = sum(lr_[-last:]) / last, sum(nr_[-last:]) / last
    tail_ratio = tail_net / tail_local if tail_local else None
    print(f"\nlast {last} steps: local {tail_local:.3f}, network {tail_net:.3f}, ratio "
          f"{tail_ratio if tail_ratio is not None else float('nan'):.2f}; "
          f"wall: local {local_s:.0f} s, network {net_s:.0f} s (start-up included)")
    print(audit_table)
    result = {
        "bench": "learning", "quick": args.quick, "smoke": args.smoke, "steps": n, "samples_per_step": per_step,
        "nodes": nodes, "validators": small, "relays": small,
        "recipe": {"model": MODEL, "env": "lowercase", "group_size": GROUP, "max_new_tokens": TOKENS,
                   "groups_per_step": GROUPS, "lr": LR, "network_async_level": 2, "local_async_level": 0},
        "rows": rows, "tail_steps": last, "tail_local_reward": tail_local, "tail_network_reward": tail_net,
        "tail_ratio": tail_ratio,
        "local_wall_s": local_s, "network_wall_s": net_s, "audit": audit,
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch_threads_per_process": 1, "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
