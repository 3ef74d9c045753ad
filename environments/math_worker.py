"""Worker for `math_verifier.MathVerifier`: runs `equivalent()` on its own main thread.

Protocol: one JSON object per line on stdin, `{"gold": str, "pred": str}`; one per line on stdout,
`{"ok": bool}`. Started with `python -I`, so it imports `math_verifier` by file path, not package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path


def main() -> None:
    logging.disable(logging.CRITICAL)  # math-verify logs every timeout; stderr goes nowhere anyway
    spec = importlib.util.spec_from_file_location("math_verifier", Path(__file__).with_name("math_verifier.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            ok = module.equivalent(str(req["gold"]), str(req["pred"]))
        except Exception:  # any failure on odd input is "not equivalent", never a dead worker
            ok = False
        sys.stdout.write(json.dumps({"ok": bool(ok)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
