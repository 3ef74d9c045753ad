"""Reading announcements must not cost libp2p: only discovery.host/service/peerkey import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIGHT = ["discovery", "discovery.messages", "discovery.admission", "discovery.board", "discovery.http",
         "discovery.config", "discovery.errors", "discovery.ratelimit"]
FORBIDDEN = ["libp2p", "trio", "torch", "transformers", "fastapi", "aiohttp"]


def test_light_modules_import_no_libp2p() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {LIGHT!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in {FORBIDDEN!r} if m in sys.modules)\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
