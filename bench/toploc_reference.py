"""The reference `toploc` 0.1.6 in its own throwaway venv (bench/.venvs/toploc-ref, gitignored).

Used by `bench.toploc` (side-by-side timings) and `bench.toploc_reference_vectors`
(compatibility vectors). The reference's prebuilt extension does not load with torch 2.13
(undefined symbol), so when importing it fails we rebuild its three C++ modules from the wheel's
own sources against the venv's torch. The venv never touches the project's venv.

    python -m bench.toploc_reference          # create/repair the venv, print its python
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venvs" / "toploc-ref"
WORKER = Path(__file__).resolve().parent / "toploc_reference_worker.py"
TOPLOC_VERSION = "0.1.6"
TORCH_VERSION = "2.13.0"  # the CPU build on disk; an unpinned torch would pull a CUDA build

_REBUILD_SETUP = r"""
import glob, os, sys, tempfile
import importlib.util
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

spec = importlib.util.find_spec("toploc")
pkg = os.path.dirname(spec.origin)
csrc = os.path.join(pkg, "C", "csrc")
site = os.path.dirname(pkg)
for so in glob.glob(os.path.join(csrc, "*.so")):
    os.remove(so)  # the prebuilt ones were linked against another torch
args = dict(extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"])
exts = [CppExtension(f"toploc.C.csrc.{m}", [os.path.join(csrc, f"{m}.cpp")], **args)
        for m in ("ndd", "utils", "poly")]
build = tempfile.mkdtemp(prefix="toploc-build-")
setup(name="toploc-rebuild", ext_modules=exts, cmdclass={"build_ext": BuildExtension},
      script_args=["-q", "build_ext", "--build-lib", site, "--build-temp", build])
"""


def _python() -> Path:
    return VENV / "bin" / "python"


def venv_exists() -> bool:
    """Whether the reference venv was made (`--smoke` runs the anchor only then, never creating it)."""
    return _python().exists()


def _imports_ok(py: Path) -> bool:
    # Isolated mode and a neutral cwd, or `import toploc` would find this repo's package.
    probe = "import toploc, torch; from toploc import build_proofs_bytes; print(toploc.__version__)"
    r = subprocess.run([str(py), "-I", "-c", probe], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        logger.info("reference toploc does not import: %s", r.stderr.strip().splitlines()[-1:])
    return r.returncode == 0


def ensure_reference_venv() -> Path:
    """Create the venv (idempotent), install torch + toploc, rebuild the extension if needed."""
    py = _python()
    if py.exists() and _imports_ok(py):
        return py
    if not py.exists():
        logger.info("creating %s", VENV)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}", "numpy", "setuptools", "wheel"], check=True)
    subprocess.run([*pip, "--no-deps", f"toploc=={TOPLOC_VERSION}"], check=True)
    if _imports_ok(py):
        return py
    logger.info("rebuilding the reference extension against torch %s (takes a minute or two)", TORCH_VERSION)
    env = dict(os.environ, MAX_JOBS="2")
    subprocess.run([str(py), "-I", "-c", _REBUILD_SETUP], check=True, env=env, cwd=tempfile.gettempdir())
    if not _imports_ok(py):
        raise RuntimeError("the reference toploc still does not import after the rebuild")
    return py


def run_worker(command: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    """Run one command in the reference venv (see toploc_reference_worker.py) and return its JSON."""
    py = ensure_reference_venv()
    with tempfile.TemporaryDirectory(prefix="toploc-ref-") as tmp:
        cmd_path = Path(tmp) / "command.json"
        out_path = Path(tmp) / "result.json"
        cmd_path.write_text(json.dumps(command))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        # -I (isolated): the repo (our own `toploc`) is not on sys.path; the worker runs as a file, not as
        # `bench.toploc_reference_worker`, since the reference venv has neither our packages nor bench/.
        subprocess.run([str(py), "-I", str(WORKER), str(cmd_path), str(out_path)], check=True, env=env,
                       timeout=timeout, cwd=tmp)
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_reference_venv())
    sys.exit(0)
