"""Checkpoints: Hugging Face safetensors weights plus everything exact resume needs.

Layout of `<dir>/step-<n>/` (n = policy version = optimizer steps taken):

- `model.safetensors`, `config.json` (+ generation config): loadable with `from_pretrained`
- `optimizer.pt`: AdamW state keyed by parameter name (a full, unsharded state dict)
- `trainer_state.json`: step, data-source position, counters
- `rng.pt`: torch / Python / NumPy RNG states

A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed into
place, so a `kill -9` at any moment leaves either the previous checkpoint or the new one, never half.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from protocol.errors import ModelError

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "trainer_state.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
    trainer_state: dict[str, Any],
    tokenizer: Any = None,
) -> Path:
    """Write checkpoint `step` atomically; `model_state` is the full (gathered) state dict on CPU.

    With a tokenizer the directory is a complete model that `models.load(HFModelSpec(path))` opens.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # save_pretrained writes config + safetensors in the HF layout (tied weights written once).
    model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(optim_state, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, sort_keys=True, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same step after a crash between rename and rotation
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state, trainer state, rng state) of one checkpoint directory."""
    try:
        model_state = load_model_state(path)
        optim_state = torch.load(path / "optimizer.pt", weights_only=False)
        rng = torch.load(path / "rng.pt", weights_only=False)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{path}: unreadable checkpoint: {exc}") from exc
    return model_state, optim_state, trainer_state, rng


def rotate(root: Path, keep: int, protected: Iterable[Path] = ()) -> None:
    """Delete all but the `keep` newest checkpoints (and stale temporaries), sparing `protected`."""
    spare = {Path(p).resolve() for p in protected}
    ckpts = list_checkpoints(root)
    for _, p in ckpts[:-keep] if keep > 0 else ckpts:
        if p.resolve() not in spare:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step-*.tmp-*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
