"""protocol/ must stay light: importing all of it pulls in no ML framework and no web server."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import protocol

FORBIDDEN = ["torch", "vllm", "transformers", "aiohttp", "fastapi", "starlette", "uvicorn"]
ROOT = Path(__file__).resolve().parents[3]


def test_every_module_imports_without_heavy_dependencies() -> None:
    modules = sorted(m.name for m in pkgutil.iter_modules(protocol.__path__, "protocol."))
    assert {"protocol.identity", "protocol.envelope", "protocol.config", "protocol.seeds"} <= set(modules)
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in {FORBIDDEN!r} if m in sys.modules)\n"
        "assert not bad, bad\n"
        "print('ok', len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_importing_identity_keeps_stdlib_json_safe() -> None:
    # eth-account's py_ecc raises the recursion limit to 100000, with which json.loads on deeply
    # nested input segfaults (exit -11) instead of raising RecursionError.
    code = (
        "import json, sys, threading\n"
        "import protocol.identity\n"
        "import web3  # imports eth-account/py_ecc again; must not undo the fix\n"
        "assert sys.getrecursionlimit() <= 10_000, sys.getrecursionlimit()\n"
        "data = '[' * 300_000 + ']' * 300_000\n"
        "def parse():\n"
        "    try:\n"
        "        json.loads(data)\n"
        "    except RecursionError:\n"
        "        print('RecursionError')\n"
        "parse()\n"
        "t = threading.Thread(target=parse)\n"
        "t.start()\n"
        "t.join()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["RecursionError", "RecursionError"]
