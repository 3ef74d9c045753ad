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
