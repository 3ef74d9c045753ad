"""Environment costs: task sampling and reward throughput per environment, and the code sandbox's
overhead against its anchor, a bare `python -I -S -c pass` subprocess (the least any
out-of-process grader pays). Math is measured on both paths: in-process (main thread, signal
timeouts) and through the worker subprocess (what a grader thread pool gets).

    python -m bench.environments_bench --json out.json     # ~1 minute
    python -m bench.environments_bench --quick             # ~15 s
    python -m bench.environments_bench --smoke --json out.json  # every row once, 2 items each (seconds)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import environments
from bench import harness
from environments import MultiTurnEnvironment
from environments.math_verifier import MathVerifier
from environments.mathematics import MathEnvironment
from environments.programming import CodeEnvironment
from environments.sandbox import SandboxLimits


def _rate(fn: Any, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - started)


def _correct(env: environments.Environment, task: environments.Task) -> str:
    if env.name == "code":
        return f"```python\n{task.answer}\n```"
    if env.name == "math":
        return f"\\boxed{{{task.answer}}}"
    return task.answer


def _reward_rate(env: environments.Environment, tasks: list[environments.Task]) -> float:
    completions = [_correct(env, t) for t in tasks]
    env.reward(tasks[0], completions[0])  # warm up: lazy imports (sympy) stay out of the timing
    started = time.perf_counter()
    for task, completion in zip(tasks, completions, strict=True):
        env.reward(task, completion)
    return len(tasks) / (time.perf_counter() - started)


def _episode_rate(env: MultiTurnEnvironment, tasks: list[environments.Task]) -> float:
    episodes = [(t, env.reference_episode(t, i)) for i, t in enumerate(tasks)]
    started = time.perf_counter()
    for i, (task, turns) in enumerate(episodes):
        env.episode_reward(task, i, turns)
    return len(tasks) / (time.perf_counter() - started)


def main() -> None:
    parser = harness.parser(__doc__, smoke="every row once on 2 items (seconds; checks the bench, measures nothing)",
                            quick="fewer repetitions (~15 s)")
    args = parser.parse_args()
    n = 2 if args.smoke else 20 if args.quick else 100
    rows: list[dict[str, Any]] = []

    anchor = _rate(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True), n)
    rows.append({"what": "anchor: bare python -I -S subprocess", "per_s": anchor, "ratio": 1.0})

    for name in environments.names():
        env = environments.get(name)
        sample_rate = _rate(lambda env=env: env.sample(7, 16), max(2, n // 10)) * 16
        rows.append({"what": f"{name}: sample", "per_s": sample_rate, "ratio": None})
        if isinstance(env, MultiTurnEnvironment):
            rate = _episode_rate(env, env.sample(8, n))
            rows.append({"what": f"{name}: episode replay + reward", "per_s": rate, "ratio": None})
            continue
        reward_rate = _reward_rate(env, env.sample(8, n))
        rows.append({"what": f"{name}: reward (correct answers)", "per_s": reward_rate,
                     "ratio": reward_rate / anchor if name == "code" else None})

    if os.geteuid() == 0:  # the fallback a root grader gets where namespaces are refused
        bare = CodeEnvironment(SandboxLimits(isolation="uid"))
        rate = _reward_rate(bare, bare.sample(8, n))
        rows.append({"what": "code: reward, isolation=uid (no namespaces)", "per_s": rate,
                     "ratio": rate / anchor})

    worker_env = MathEnvironment(MathVerifier())
    tasks = worker_env.sample(9, n)
    out: list[float] = []

    def threaded() -> None:
        worker_env.reward(tasks[0], "\\boxed{0}")  # start the worker (sympy import) outside the timing
        started = time.perf_counter()
        for t in tasks:
            worker_env.reward(t, f"\\boxed{{{t.answer}}}")
        out.append(n / (time.perf_counter() - started))

    thread = threading.Thread(target=threaded)
    thread.start()
    thread.join()
    worker_env.verifier.close()
    rows.append({"what": "math: reward via worker (off main thread)", "per_s": out[0], "ratio": None})

    machine = harness.machine()
    print(f"machine: {harness.describe(machine)}, n={n}")
    print(f"{'what':48s} {'per second':>12s} {'vs anchor':>10s}")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        print(f"{row['what']:48s} {row['per_s']:12.1f} {ratio:>10s}")
    harness.write_json(args.json, {"n": n, "smoke": args.smoke, "machine": machine, "rows": rows})


if __name__ == "__main__":
    main()
