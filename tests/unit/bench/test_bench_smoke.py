"""Every benchmark program runs its `--smoke` mode (its whole code path on the smallest inputs) as a subprocess
(`python -m bench.<name> --smoke --json out.json`),
exits 0 and writes JSON with its expected keys, so a rename in a package breaks this test, not the next person
who runs the benchmark (issue 28: `bench/validator.py` once failed with an AttributeError nobody saw).

One parametrization per program, so a failure names the bench; all of them are in the default tier. Together
they cost ~8 CPU-minutes (`faults` and `learning` start a whole devnet), so the selected ones start in the
background when collection ends and run niced beside the rest of the suite (tests/benchsmoke.py) and, whatever the random order, are the last tests run (tests/conftest.py); each test
here waits for its own program's result. Behaviour only: no timing is asserted."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchsmoke
import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench"

# bench/*.py with a __main__ that are not benchmarks: the processes and venvs benchmarks use, and tools that
# write test data (bench/README.md lists them). Modules without a __main__ (harness, loopback, adversaries) are
# what the programs share.
HELPERS = {
    "validator_http": "the validator as a server process, for validator.py and load.py",
    "toploc_reference": "makes the reference toploc venv (bench/.venvs/toploc-ref)",
    "toploc_reference_worker": "runs inside the reference venv, for toploc.py",
    "toploc_reference_vectors": "writes the compatibility vectors in tests/data/toploc/",
    "toploc_reference_suite": "runs the reference's own test suite against our package",
    "gpu_bundle": "builds .gpu-bundle/, what the GPU command of gpu.py carries (make gpu-bundle)",
}

Check = Callable[[dict[str, Any]], bool]


def _ran(*keys: str) -> Check:
    return lambda out: all(out.get(k) is not None for k in keys)


def _attacks_caught(o: dict[str, Any]) -> bool:
    """At smoke size (one trial of each attack, one honest submission of 4 rollouts): every attack is caught in its
    trial but those the tiny model cannot catch by design (`bench.attacks.UNDETECTABLE`: marked in the JSON, and
    then never a crash), and the honest work is accepted (no false positive)."""
    by_design = {r["attack"] for r in o["attacks"] if r["not_caught_by_design"]}
    missed = [r["attack"] for r in o["attacks"] if r["detected"] != r["trials"] and r["attack"] not in by_design]
    crashed = {r["attack"]: r["reasons"] for r in o["attacks"] if "error" in r["classes"]}  # reasons: the exception
    assert missed == [] and crashed == {}, f"not caught: {missed}; crashed: {crashed}"
    assert len(by_design) < len(o["attacks"]) // 4, f"most attacks must be caught, not by design: {sorted(by_design)}"
    assert o["honest_submissions"] == 1 and o["honest_rollouts"] == 4 and o["false_positives"] == 0, \
        o["false_positive_rows"]
    return all(r["trials"] == 1 for r in o["attacks"]) and o["on_chain"]["hard"] > 0


# program -> (top-level JSON keys, a check that the measured side ran)
PROGRAMS: dict[str, tuple[set[str], Check]] = {
    "attacks": ({"bench", "attacks", "honest_rollouts", "false_positives", "on_chain", "smoke"}, _attacks_caught),
    "capacity": ({"smoke", "networks"}, lambda o: len(o["networks"]) == 1),
    "churn": ({"steady", "churn", "ratio"}, lambda o: set(o["ratio"]) >= {"steps_per_min", "reward_per_sample"}),
    "discovery": ({"bench", "smoke", "reach", "rate", "machine"},
                  lambda o: o["reach"]["3"]["ours"]["p50_s"] > 0 and o["rate"]["ours"]["msgs_per_s"] > 0),
    "environments_bench": ({"n", "smoke", "rows"}, lambda o: len(o["rows"]) > 5),
    "gas": ({"bench", "anchor_gas", "rows", "smoke"}, lambda o: all(r["gas"] > 0 for r in o["rows"])),
    "gpu": ({"bench", "smoke", "rows", "device", "machine", "check"},
            lambda o: [(r["model"], r["dtype"]) for r in o["rows"]] == [("tiny", "bfloat16"), ("tiny", "float32")]
            and all(r["ratio_engine_over_hf"] > 0 and r["check_s"] > 0 for r in o["rows"]) and o["check"]["accepted"]),
    "generate": ({"info", "kernels", "results", "ratio_vs_hf"},
                 lambda o: {(r["dtype"], r["model"], r["batch"]) for r in o["results"]}
                 == {("float32", "tiny", 2), ("bfloat16", "tiny", 2)}),
    "learning_recipe": ({"rows", "ratios", "curves", "smoke"},
                        lambda o: [r["stage"] for r in o["rows"]] == ["base", "sft", "sft+rl", "rl"]),
    "load": ({"info", "validator", "relay", "flood", "hostile", "smoke"},
             lambda o: o["validator"]["unexpected_answers"] == {} and o["relay"]["completed"] == 6
             and o["hostile"]["honest_submitted"] > 0 and o["hostile"]["rss_mib_peak"] > 0),
    "node": ({"info", "results", "smoke"}, lambda o: [r["model"] for r in o["results"]] == ["tiny"]
             and o["results"][0]["same_tokens"]),
    "shardcast": ({"ours_s", "plain_http_s", "raw_copy_s", "ratios", "notes", "skipped", "smoke"},
                  lambda o: not o["notes"] and _ran("ours_s", "plain_http_s", "raw_copy_s")(o)),
    "toploc": ({"machine", "settings", "proof_math", "smollm2", "smoke", "reference_ran"},
               lambda o: len(o["proof_math"]) == 3 and o["smollm2"]["validation_tok_s"] > 0),
    "toploc_margins": ({"thresholds", "rows", "smoke"}, lambda o: len(o["rows"]) > 5),
    "near_ties": ({"bench", "rows", "proposed", "steering", "smoke"},
                  lambda o: {(r["node_dtype"], r["validator_dtype"]) for r in o["rows"]}
                  == {("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")}
                  and len(o["steering"][0]["rows"]) == 3),
    "trainer": ({"train_tokens_per_s", "matmul_fraction", "packing_efficiency", "smoke"},
                lambda o: o["train_tokens_per_s"] > 0),
    "validator": ({"info", "models", "http_intake", "junk_flood", "validation_over_generation", "cheap_checks_per_s"},
                  lambda o: set(o["models"]) == {"tiny"} and o["models"]["tiny"]["check_breakdown_s"]
                  and 0 < o["models"]["tiny"]["check_floor_at_peak"] < float("inf") and o["junk_flood"]["requests"] > 0),
    "faults": ({"faults", "audit", "cadence", "smoke"},
               lambda o: [f["role"] for f in o["faults"]] == ["relay", "validator", "trainer", "node"]
               and o["audit"]["ok"]),
    "learning": ({"rows", "audit", "smoke", "local_wall_s", "network_wall_s", "evals", "network_time"},
                 lambda o: len(o["rows"]) == 1 and [e["run"] for e in o["evals"]["rows"]] == ["init", "local", "network"]
                 and o["network_time"]["validation"]["decided"] >= 1 and o["audit"]["ok"]),
}


def _programs() -> set[str]:
    return {p.stem for p in BENCH.glob("*.py") if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)}


def test_every_program_has_a_smoke_run_here_and_helpers_are_named() -> None:
    assert _programs() - set(HELPERS) == set(PROGRAMS)
    assert set(HELPERS) <= _programs()


def test_programs_run_as_modules_of_the_bench_package() -> None:
    """`python -m bench.<name>`: no program puts a folder on sys.path (bench/validator.py and its namesakes are
    `bench.validator` etc., so `import validator` finds the package), and none imports from tests/."""
    assert (BENCH / "__init__.py").exists()
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"sys\.path(\[|\.insert|\.append)", text), f"{path.name} edits sys.path"
        assert not re.search(r"^\s*(from|import) (netfixtures|chainfixtures|validator_harness|shardcast_harness)\b",
                             text, re.M), f"{path.name} imports a test helper"


# a waiting test may wait behind its lane's earlier runs, each bounded by TIMEOUT_S at normal priority
@pytest.mark.timeout((len(PROGRAMS) + 1) * benchsmoke.TIMEOUT_S)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_smoke_mode_runs_and_writes_its_json(name: str, tmp_path: Path) -> None:
    keys, ran = PROGRAMS[name]
    background = benchsmoke.started()
    if background is not None and name in background.futures:
        smoke = background.runs[name]
        background.hurry()
        code, stdout, stderr = background.futures[name].result()
    else:  # selected in a way that did not start it when collection ended
        smoke = benchsmoke.Smoke(name, tmp_path)
        code, stdout, stderr = smoke.run()
    out = smoke.out
    # the lines a table flags come first: a long table's tail alone hid which attack failed (CI runs 56, 58)
    flagged = "\n".join(line for line in stdout.splitlines() if "NOT ALL DETECTED" in line)
    assert code == 0, (f"python -m bench.{name} --smoke exited {code}:\n{flagged}\n{stdout[-3000:]}\n"
                       f"{stderr[-5000:]}")
    result = json.loads(out.read_text())
    assert keys <= set(result), f"missing keys: {sorted(keys - set(result))}"
    assert result.get("smoke", result.get("info", {}).get("smoke")) is True, "the JSON says it was a smoke run"
    assert ran(result), json.dumps(result)[:3000]
    assert stdout.strip(), "a benchmark prints its table"
