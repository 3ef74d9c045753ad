"""Every benchmark program runs its `--smoke` mode (its whole code path on the smallest inputs) as a subprocess,
exits 0 and writes JSON with its expected keys, so a rename in a package breaks this test, not the next person
who runs the benchmark (issue 28: `bench/validator.py` once failed with an AttributeError nobody saw).

One parametrization per program, so a failure names the bench. The two that need a whole devnet for more than
a few seconds (`faults`, `learning`: a minute or more of start-up on 2 cores) are in the slow tier. Behaviour
only: no timing is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
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
    "discovery": ({"bench", "smoke", "reach", "rate", "machine"},
                  lambda o: o["reach"]["3"]["ours"]["p50_s"] > 0 and o["rate"]["ours"]["msgs_per_s"] > 0, False),
    "environments_bench": ({"n", "smoke", "rows"}, lambda o: len(o["rows"]) > 5, False),
    "gas": ({"bench", "anchor_gas", "rows", "smoke"}, lambda o: all(r["gas"] > 0 for r in o["rows"]), False),
    "learning_recipe": ({"rows", "ratios", "curves", "smoke"},
                        lambda o: [r["stage"] for r in o["rows"]] == ["base", "sft", "sft+rl", "rl"], False),
    "shardcast": ({"ours_s", "plain_http_s", "raw_copy_s", "ratios", "notes", "skipped", "smoke"},
                  lambda o: not o["notes"] and _ran("ours_s", "plain_http_s", "raw_copy_s")(o), False),
    "toploc": ({"machine", "settings", "proof_math", "smollm2", "smoke", "reference_ran"},
               lambda o: len(o["proof_math"]) == 3 and o["smollm2"]["validation_tok_s"] > 0, False),
    "toploc_margins": ({"thresholds", "rows", "smoke"}, lambda o: len(o["rows"]) > 5, False),
    "trainer": ({"train_tokens_per_s", "matmul_fraction", "packing_efficiency", "smoke"},
                lambda o: o["train_tokens_per_s"] > 0, False),
    "validator": ({"info", "models", "http_intake", "junk_flood", "validation_over_generation", "cheap_checks_per_s"},
                  lambda o: set(o["models"]) == {"tiny"} and o["models"]["tiny"]["check_breakdown_s"]
                  and o["junk_flood"]["requests"] > 0, False),
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


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if slow else n
                                  for n, (_, _, slow) in PROGRAMS.items()])
def test_smoke_mode_runs_and_writes_its_json(name: str, tmp_path: Path) -> None:
    keys, ran, _ = PROGRAMS[name]
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench/{name}.py --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"
    result = json.loads(out.read_text())
    assert keys <= set(result), f"missing keys: {sorted(keys - set(result))}"
    assert result.get("smoke", result.get("info", {}).get("smoke")) is True, "the JSON says it was a smoke run"
    assert ran(result), json.dumps(result)[:3000]
    assert proc.stdout.strip(), "a benchmark prints its table"
