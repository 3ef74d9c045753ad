"""Every benchmark program runs its `--smoke` mode (its whole code path on the smallest inputs) as a subprocess,
exits 0 and writes JSON with its expected keys, so a rename in a package breaks this test, not the next person
who runs the benchmark (issue 28: `bench/validator.py` once failed with an AttributeError nobody saw).

One parametrization per program, so a failure names the bench. The two that need a whole devnet for more than
a few seconds (`faults`, `learning`: a minute or more of start-up on 2 cores) are in the slow tier, and so are
the four heaviest of the rest (`attacks`, `load`, `node`, `validator`: ~110 of the ~190 CPU-seconds), which the
default tier's 15-minute CI budget could not hold once issue 23's tests came in. The others
cost mostly Python, torch and model start-up, so the selected ones start
together, two at a time (the CI box has 2 cores), and each test waits for its own. Behaviour only: no timing
is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench"

# bench/*.py with a __main__ that are not benchmarks: the processes and venvs benchmarks use, and tools that
# write test data (bench/README.md lists them).
HELPERS = {
    "validator_http": "the validator as a server process, for validator.py and load.py",
    "toploc_reference": "makes the reference toploc venv (bench/.venvs/toploc-ref)",
    "toploc_reference_worker": "runs inside the reference venv, for toploc.py",
    "toploc_reference_vectors": "writes the compatibility vectors in tests/data/toploc/",
    "toploc_reference_suite": "runs the reference's own test suite against our package",
}

Check = Callable[[dict[str, Any]], bool]


def _ran(*keys: str) -> Check:
    return lambda out: all(out.get(k) is not None for k in keys)


# program -> (top-level JSON keys, a check that the measured side ran, slow?)
PROGRAMS: dict[str, tuple[set[str], Check, bool]] = {
    "attacks": ({"bench", "attacks", "honest_rollouts", "false_positives", "on_chain", "smoke"},
                lambda o: all(r["trials"] == 1 for r in o["attacks"]) and o["honest_submissions"] == 1, True),
    "capacity": ({"smoke", "networks"}, lambda o: len(o["networks"]) == 1, False),
    # its smoke (the report's arithmetic) also runs in the default tier as tests/unit/bench/test_churn_bench.py
    "churn": ({"steady", "churn", "ratio"}, lambda o: set(o["ratio"]) >= {"steps_per_min", "reward_per_sample"},
              True),
    "discovery": ({"bench", "smoke", "reach", "rate", "machine"},
                  lambda o: o["reach"]["3"]["ours"]["p50_s"] > 0 and o["rate"]["ours"]["msgs_per_s"] > 0, False),
    "environments_bench": ({"n", "smoke", "rows"}, lambda o: len(o["rows"]) > 5, False),
    "gas": ({"bench", "anchor_gas", "rows", "smoke"}, lambda o: all(r["gas"] > 0 for r in o["rows"]), False),
    "generate": ({"info", "kernels", "results", "ratio_vs_hf"},
                 lambda o: {(r["dtype"], r["model"], r["batch"]) for r in o["results"]}
                 == {("float32", "tiny", 2), ("bfloat16", "tiny", 2)}, False),
    "learning_recipe": ({"rows", "ratios", "curves", "smoke"},
                        lambda o: [r["stage"] for r in o["rows"]] == ["base", "sft", "sft+rl", "rl"], False),
    "load": ({"info", "validator", "relay", "flood", "smoke"},
             lambda o: o["validator"]["unexpected_answers"] == {} and o["relay"]["completed"] == 6, True),
    "node": ({"info", "results", "smoke"}, lambda o: [r["model"] for r in o["results"]] == ["tiny"]
             and o["results"][0]["same_tokens"], True),
    "shardcast": ({"ours_s", "plain_http_s", "raw_copy_s", "ratios", "notes", "skipped", "smoke"},
                  lambda o: not o["notes"] and _ran("ours_s", "plain_http_s", "raw_copy_s")(o), False),
    "toploc": ({"machine", "settings", "proof_math", "smollm2", "smoke", "reference_ran"},
               lambda o: len(o["proof_math"]) == 3 and o["smollm2"]["validation_tok_s"] > 0, False),
    "toploc_margins": ({"thresholds", "rows", "smoke"}, lambda o: len(o["rows"]) > 5, False),
    "trainer": ({"train_tokens_per_s", "matmul_fraction", "packing_efficiency", "smoke"},
                lambda o: o["train_tokens_per_s"] > 0, False),
    "validator": ({"info", "models", "http_intake", "junk_flood", "validation_over_generation", "cheap_checks_per_s"},
                  lambda o: set(o["models"]) == {"tiny"} and o["models"]["tiny"]["check_breakdown_s"]
                  and o["junk_flood"]["requests"] > 0, True),
    "faults": ({"faults", "audit", "cadence", "smoke"},
               lambda o: [f["role"] for f in o["faults"]] == ["relay", "validator", "trainer", "node"]
               and o["audit"]["ok"], True),
    "learning": ({"rows", "audit", "smoke", "local_wall_s", "network_wall_s"}, lambda o: len(o["rows"]) == 1, True),
}


def _programs() -> set[str]:
    return {p.stem for p in BENCH.glob("*.py") if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)}


def test_every_program_has_a_smoke_run_here_and_helpers_are_named() -> None:
    assert _programs() - set(HELPERS) == set(PROGRAMS)
    assert set(HELPERS) <= _programs()


TIMEOUT_S = 600
Result = tuple[int, str, str]


class Smoke:
    """`bench/<name>.py --smoke --json <dir>/out.json` in a subprocess; `run()` returns (exit code, stdout, stderr)."""

    def __init__(self, name: str, work: Path) -> None:
        self.name, self.work, self.out = name, work, work / "out.json"
        self.proc: subprocess.Popen[str] | None = None
        self.stopped = threading.Event()

    def run(self) -> Result:
        if self.stopped.is_set():
            return -1, "", "not started: the session ended"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(BENCH / f"{self.name}.py"), "--smoke", "--json",
                                      str(self.out)], cwd=self.work, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            stderr += f"\nkilled after {TIMEOUT_S} s"
        return self.proc.returncode, stdout, stderr

    def stop(self) -> None:
        self.stopped.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Smoke, Future[Result]]]]:
    """The selected quick programs' smoke runs, started at once two at a time (name -> (run, future))."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_smoke_mode_runs_and_writes_its_json"]
    runs = {n: Smoke(n, tmp_path_factory.mktemp(n)) for n in selected if not PROGRAMS[n][2]}
    pool = ThreadPoolExecutor(2, thread_name_prefix="bench-smoke")
    futures = {n: (r, pool.submit(r.run)) for n, r in runs.items()}
    yield futures
    for r in runs.values():
        r.stop()
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if slow else n
                                  for n, (_, _, slow) in PROGRAMS.items()])
def test_smoke_mode_runs_and_writes_its_json(name: str, started: dict[str, tuple[Smoke, Future[Result]]],
                                             tmp_path: Path) -> None:
    keys, ran, _ = PROGRAMS[name]
    if name in started:
        smoke, future = started[name]
        code, stdout, stderr = future.result()
    else:  # slow (a devnet: never beside another), or not selected when the module started
        smoke = Smoke(name, tmp_path)
        code, stdout, stderr = smoke.run()
    out = smoke.out
    assert code == 0, f"bench/{name}.py --smoke exited {code}:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    result = json.loads(out.read_text())
    assert keys <= set(result), f"missing keys: {sorted(keys - set(result))}"
    assert result.get("smoke", result.get("info", {}).get("smoke")) is True, "the JSON says it was a smoke run"
    assert ran(result), json.dumps(result)[:3000]
    assert stdout.strip(), "a benchmark prints its table"
