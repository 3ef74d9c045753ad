"""Run the reference `toploc` 0.1.6's own test suite against *our* `toploc`, through a module-path shim.

    python -m bench.toploc_reference_suite [--tests DIR] [--json PATH]

The reference's tests (its sdist's `tests/`, fetched with `pip download --no-binary` into
bench/.venvs/toploc-ref-src unless `--tests` names a folder) import `toploc.poly`, `toploc.utils`
and the compiled modules `toploc.C.csrc.{poly,ndd,utils}`. A conftest written next to a copy of
them maps those module paths onto ours before collection:

- `toploc`, `toploc.poly`, `toploc.utils` and `toploc.C.csrc.poly` (ProofPoly, VerificationResult,
  verify_*): our public names, as they are. A name we do not have becomes a stub that raises
  when called, so each test that needs it fails on its own instead of the whole file.
- `toploc.C.csrc.ndd` (`compute_newton_coefficients`, `evaluate_polynomial`) and
  `toploc.C.csrc.utils.get_fp_parts` are the reference's C internals with no counterpart in our
  API; the shim adapts them over `toploc.field` / torch bit views (interpolation in the monomial
  basis rather than Newton's: the tests only check that evaluation reproduces the points).

Prints one line per test and a per-file table; the headline is the 34 tests of test_poly.py,
test_ndd.py and test_proof_e2e.py (test_utils.py's six `get_fp_parts` cases time the C helper
against a Python loop and are reported separately, with `sha256sum`). No GPU here: the one CUDA
test is skipped and counted as not passed. Runs in this project's venv, ~1 minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC_CACHE = ROOT / "bench" / ".venvs" / "toploc-ref-src"
VERSION = "0.1.6"
HEADLINE_FILES = ("test_poly.py", "test_ndd.py", "test_proof_e2e.py")

SHIM = r'''
"""Module-path shim: the reference's `toploc.*` imports resolve to this project's toploc."""
import sys
import types

import numpy as np
import torch

import toploc as ours
from toploc import field


def _stub(module, name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{module}.{name} is not provided by this project's toploc")
    return missing


def _module(name, source, names, extra=None):
    mod = types.ModuleType(name)
    for n in names:
        if hasattr(source, n):
            setattr(mod, n, getattr(source, n))
    mod.__dict__.update(extra or {})
    mod.__getattr__ = lambda n: _stub(name, n)  # PEP 562: a missing name fails at call, not import
    mod.__path__ = []
    sys.modules[name] = mod
    return mod


try:
    import toploc.poly as our_poly
except ImportError:
    our_poly = ours

POLY = ["ProofPoly", "VerificationResult", "build_proofs", "build_proofs_bytes", "build_proofs_base64",
        "verify_proofs", "verify_proofs_bytes", "verify_proofs_base64", "batch_activations",
        "find_injective_modulus"]
_module("toploc.poly", our_poly, POLY)
_module("toploc.utils", ours, ["sha256sum"])
_module("toploc.C", ours, [])
_module("toploc.C.csrc", ours, [])
_module("toploc.C.csrc.poly", our_poly, ["ProofPoly", "VerificationResult", "verify_proofs",
                                          "verify_proofs_bytes", "verify_proofs_base64"])


def compute_newton_coefficients(x, y):
    if len(x) == 0 or len(x) != len(y):
        raise ValueError("x and y must be non-empty and of equal length")
    xs = np.asarray([x], dtype=np.int64)
    return field.interpolate(xs, np.asarray([y], dtype=np.int64))[0].tolist()


def evaluate_polynomial(coefficients, x):
    c = np.asarray([coefficients], dtype=np.int64)
    return int(field.evaluate(c, np.asarray([[x]], dtype=np.int64))[0, 0])


def get_fp_parts(tensor, num_threads=1):
    if tensor.dtype == torch.bfloat16:
        bits = tensor.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
        return ((bits >> 7) & 0xFF).tolist(), (bits & 0x7F).tolist()
    bits = tensor.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((bits >> 23) & 0xFF).tolist(), (bits & 0x7FFFFF).tolist()


_module("toploc.C.csrc.ndd", ours, [], {"compute_newton_coefficients": compute_newton_coefficients,
                                         "evaluate_polynomial": evaluate_polynomial})
_module("toploc.C.csrc.utils", ours, [], {"get_fp_parts": get_fp_parts})
ours.C = sys.modules["toploc.C"]
sys.modules["toploc.C"].csrc = sys.modules["toploc.C.csrc"]
'''


def fetch_tests() -> Path:
    """The reference sdist's tests/ folder (downloaded once into bench/.venvs/toploc-ref-src)."""
    tests = SRC_CACHE / f"toploc-{VERSION}" / "tests"
    if tests.is_dir():
        return tests
    SRC_CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "-d", str(SRC_CACHE), f"toploc=={VERSION}"], check=True)
    with tarfile.open(SRC_CACHE / f"toploc-{VERSION}.tar.gz") as tar:
        tar.extractall(SRC_CACHE, filter="data")
    return tests


def run(tests: Path) -> dict[str, str]:
    """{test node id: outcome} for every reference test, run against our toploc."""
    with tempfile.TemporaryDirectory(prefix="toploc-ref-suite-") as tmp:
        work = Path(tmp) / "tests"
        shutil.copytree(tests, work)
        (work / "conftest.py").write_text(SHIM)
        report = Path(tmp) / "report.jsonl"
        plugin = Path(tmp) / "outcomes.py"
        plugin.write_text(
            "import json\n"
            "def pytest_runtest_logreport(report):\n"
            "    if report.when == 'call' or report.outcome != 'passed':\n"
            f"        with open({str(report)!r}, 'a') as fh:\n"
            "            fh.write(json.dumps([report.nodeid, report.when, report.outcome]) + '\\n')\n"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), tmp]), OMP_NUM_THREADS="1")
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", tmp, "-p", "no:cacheprovider",
             "-p", "outcomes", str(work)],
            cwd=tmp, env=env, check=False, timeout=1800,
        )
        outcomes: dict[str, str] = {}
        for line in report.read_text().splitlines() if report.exists() else []:
            node, when, outcome = json.loads(line)
            if outcomes.get(node, "passed") == "passed" or when == "setup":
                outcomes[node] = outcome if when == "call" else f"{outcome} ({when})"
        return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="the reference's tests/ folder (default: fetch the sdist)")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args()
    outcomes = run(args.tests or fetch_tests())
    for node, outcome in sorted(outcomes.items()):
        print(f"{outcome:<18} {node}")
    print(f"\n{'file':<22} {'passed':>6} {'of':>4}")
    per_file: dict[str, list[int]] = {}
    for node, outcome in outcomes.items():
        counts = per_file.setdefault(node.split("::")[0].split("/")[-1], [0, 0])
        counts[0] += outcome == "passed"
        counts[1] += 1
    for name, (ok, n) in sorted(per_file.items()):
        print(f"{name:<22} {ok:>6} {n:>4}")
    head = [per_file.get(f, [0, 0]) for f in HEADLINE_FILES]
    passed, total = sum(c[0] for c in head), sum(c[1] for c in head)
    print(f"\nheadline ({', '.join(HEADLINE_FILES)}): {passed} of {total} pass")
    if args.json:
        args.json.write_text(json.dumps({"outcomes": outcomes, "headline": [passed, total],
                                         "per_file": per_file}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
