"""What every benchmark program shares: the `--smoke/--quick/--json` flags, a description of the machine it
ran on, and the JSON file it writes (CONVENTIONS 12: a benchmark says what machine, threads and sizes it used).

    ap = harness.parser(__doc__, smoke="...", quick="...")   # then the program's own flags
    args = ap.parse_args()
    ...
    harness.write_json(args.json, {"smoke": args.smoke, "machine": harness.machine(threads), ...})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: a program another one starts runs from here (`python -m bench.<name>`, cwd ROOT)."""
SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx")
"""The CPU flags that decide how fast a matmul runs (the prefixes of /proc/cpuinfo's flags that are kept)."""


def parser(doc: str | None, *, smoke: str, quick: str,
           json_help: str = "write the results here as JSON") -> argparse.ArgumentParser:
    """An argument parser with the three flags every program has; `smoke` and `quick` say what they run here
    (`--smoke`: seconds, the whole code path on the smallest inputs, run by the default test tier;
    `--quick`: a minute or two)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help=smoke)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--json", type=Path, help=json_help)
    return ap


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and its matmul-relevant flags (empty where /proc/cpuinfo is missing)."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), sorted(f for f in flags.split() if f.startswith(SIMD))


def machine(threads: int | None = None) -> dict[str, Any]:
    """The machine a result was measured on. `threads`: the torch threads the program used (default: torch's
    setting when the program imported torch; torch is never imported here)."""
    name, flags = cpu()
    torch = sys.modules.get("torch")
    if threads is None and torch is not None:
        threads = torch.get_num_threads()
    return {"cpu": name, "flags": flags, "cores": os.cpu_count(), "threads": threads,
            "torch": getattr(torch, "__version__", None), "python": platform.python_version(),
            "platform": platform.platform(), "load_average": list(os.getloadavg())}


def describe(m: dict[str, Any]) -> str:
    """One line for the top of a program's table."""
    return (f"{m['cpu']} ({', '.join(m['flags']) or 'no avx2/avx512/amx'}), {m['cores']} cores, "
            f"threads={m['threads']}, python {m['python']}, load {m['load_average'][0]:.2f}")


def write_json(path: Path | str | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (nothing when None), making its folder."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")


def command(name: str, argv: list[str] | None = None) -> str:
    """The command line that ran program `name` (for the JSON: how to reproduce a result)."""
    return " ".join(["python", "-m", f"bench.{name}", *(sys.argv[1:] if argv is None else argv)])
