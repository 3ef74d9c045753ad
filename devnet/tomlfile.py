"""Writing the roles' TOML config files (the standard library reads TOML but does not write it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))  # a JSON string is a TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps(data: dict[str, Any], prefix: str = "") -> str:
    """Scalars and lists of scalars first, then one `[table]` per nested dict (None values are left out)."""
    lines = [f"{k} = {_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}{k}"
            out += f"\n[{name}]\n" + dumps(v, name + ".")
    return out


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` so that a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
