"""`make test-stress`: the default tier several times, each in a new random order, beside CPU-bound busy loops.

A test that leans on a wall-clock window, on a random key meeting its premise or on another test's
leftovers passes on an idle machine and fails on a loaded one or in another order. Here every run gets a
fresh `--random-order-seed` (printed before it starts) while two busy loops (by default) keep the cores
taken, and the first failing run stops the loop and prints the command that replays its order.

    python tests/stress.py --runs 3 [--busy 2] [--seed N] [-- PYTEST ARGS...]

PYTEST ARGS narrow the selection (a path, `-k ...`) or add options (`-x`); the tier itself (markers, timeout)
comes from pyproject's `addopts`, as in `make test`. Each pytest run is a child process; the busy loops are
killed by pid when the runs end, fail or are interrupted.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import subprocess
import sys
import time

BUSY_LOOP = "while True: pass"


def start_busy(n: int) -> list[subprocess.Popen[bytes]]:
    """`n` CPU-bound Python loops, each its own process (and session, so a Ctrl-C here reaches only us)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True) for _ in range(n)]


def stop_busy(loops: list[subprocess.Popen[bytes]]) -> None:
    for p in loops:  # by pid: only the loops this script started
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="how many runs of the tier (each a new order)")
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound busy loops beside the tests")
    parser.add_argument("--seed", type=int, default=None,
                        help="the first run's --random-order-seed (the next runs add 1 each); default: random")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after `--`: passed to pytest (a path, -k, -x ...)")
    args = parser.parse_args(argv)
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    first = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    loops = start_busy(args.busy)
    print(f"test-stress: {args.runs} run(s) beside {args.busy} busy loop(s) (pids "
          f"{' '.join(str(p.pid) for p in loops) or 'none'}); seeds from {first}", flush=True)
    try:
        for i in range(args.runs):
            seed = first + i
            cmd = [sys.executable, "-m", "pytest", "--random-order", f"--random-order-seed={seed}", *extra]
            print(f"\n=== test-stress run {i + 1}/{args.runs}: --random-order-seed={seed} ===", flush=True)
            started = time.monotonic()
            rc = subprocess.call(cmd)
            took = time.monotonic() - started
            if rc != 0:
                replay = shlex.join([".venv/bin/python", "-m", "pytest", f"--random-order-seed={seed}", *extra])
                print(f"\ntest-stress: run {i + 1}/{args.runs} FAILED (exit {rc}, {took:.0f} s) with "
                      f"--random-order-seed={seed}\n  replay its order: {replay}", flush=True)
                return rc
            print(f"test-stress: run {i + 1}/{args.runs} passed in {took:.0f} s (seed {seed})", flush=True)
    finally:
        stop_busy(loops)
    print(f"\ntest-stress: all {args.runs} run(s) passed (seeds {first}..{first + args.runs - 1})", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `make test` exports it
    sys.exit(main())
