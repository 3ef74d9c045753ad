"""Compiled contract artifacts (ABI and bytecode) committed under contracts/artifacts/, and revert decoding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from eth_abi.abi import decode as abi_decode
from eth_utils.abi import function_signature_to_4byte_selector

from protocol.errors import ChainError

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"

_ERROR_STRING = bytes.fromhex("08c379a0")  # Error(string)
_PANIC = bytes.fromhex("4e487b71")  # Panic(uint256)


@dataclass(frozen=True)
class Artifact:
    """One compiled contract."""

    name: str
    abi: list[dict[str, Any]]
    bytecode: str


@cache
def load_artifact(name: str) -> Artifact:
    """The committed artifact of contract `name` (e.g. "ComputePool"); ChainError if missing."""
    path = ARTIFACT_DIR / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ChainError(f"no artifact {path}; run `make contracts`") from exc
    return Artifact(name=data["contractName"], abi=data["abi"], bytecode=data["bytecode"])


def _abi_type(param: dict[str, Any]) -> str:
    if param["type"].startswith("tuple"):
        inner = ",".join(_abi_type(c) for c in param["components"])
        return f"({inner}){param['type'][5:]}"
    return str(param["type"])


@cache
def _error_table() -> dict[bytes, tuple[str, list[str], list[str]]]:
    table: dict[bytes, tuple[str, list[str], list[str]]] = {}
    for path in sorted(ARTIFACT_DIR.glob("*.json")):
        for item in load_artifact(path.stem).abi:
            if item["type"] != "error":
                continue
            types = [_abi_type(p) for p in item["inputs"]]
            selector = function_signature_to_4byte_selector(f"{item['name']}({','.join(types)})")
            table[bytes(selector)] = (item["name"], types, [p["name"] for p in item["inputs"]])
    return table


def error_selector(name: str) -> bytes:
    """The 4-byte selector of custom error `name` from any of our contracts (for tests and tooling)."""
    for selector, (error_name, _, _) in _error_table().items():
        if error_name == name:
            return selector
    raise KeyError(name)


def decode_revert(data: bytes) -> tuple[str, str]:
    """(reason, description) for revert data: the custom error's name, a require string, or a panic code."""
    if not data:
        return "revert", "reverted without data"
    selector, body = data[:4], data[4:]
    try:
        if selector == _ERROR_STRING:
            (text,) = abi_decode(["string"], body)
            return str(text), str(text)
        if selector == _PANIC:
            (code,) = abi_decode(["uint256"], body)
            return f"Panic(0x{code:02x})", f"panic 0x{code:02x}"
        known = _error_table().get(selector)
        if known is not None:
            name, types, names = known
            values = abi_decode(types, body)
            shown = ", ".join(
                f"{n}={('0x' + v.hex()) if isinstance(v, bytes) else v}" for n, v in zip(names, values, strict=True)
            )
            return name, f"{name}({shown})"
    except Exception:  # malformed revert payload: report it raw rather than failing to report at all
        pass
    return "unknown", f"unknown revert data 0x{data.hex()}"
