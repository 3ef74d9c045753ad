"""How the engine's linear layers multiply on this machine: measured once, cached, overridable.

Machines of the same kind differ. On Intel with AMX a bf16 ``torch.mm`` runs at ~2,000 GFLOP/s;
on an AVX2-only AMD EPYC the same call ran at 0.2-1 GFLOP/s (fp32: ~60) and took the engine's bf16
path to ~0.1x Hugging Face ``generate``. So the kernel behind ``y = x W^T + b`` is chosen per
weight shape, by timing the candidates on the model's own shapes and dtype:

- ``linear``: ``F.linear`` with ``W`` in Hugging Face layout ``[out, in]`` (what transformers runs);
- ``mm_t``: ``torch.mm(x, W^T)`` with ``W^T`` stored contiguous ``[in, out]``;
- ``dnn``: oneDNN with the weight packed once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what inductor's CPU
  freezing uses); on the AVX2 EPYC it ran SmolLM2's LM head at 16-64 rows ~1.6x faster than the
  other two; in bf16 it needs AVX512-BW or AVX-NE-CONVERT and is skipped where it does not run;
- ``fp32_linear`` / ``fp32_mm_t`` / ``fp32_dnn`` (bf16 models only): the same, with the weights
  upcast to fp32 once; each call upcasts ``x``, multiplies in fp32 and rounds the result back to
  bf16.

Numerics. bf16 values are exact in fp32 and their products are exact in fp32's 24-bit mantissa,
and the bf16 kernels accumulate in fp32 and round the output once, so the fp32 paths compute the
same bf16-in / bf16-out function; they differ from ``linear`` only in summation order, as any two
bf16 kernels (oneDNN vs MKL, AMX vs AVX2) do. Every output is rounded back to the model dtype at
once, so hidden states stay a bf16 computation of the same model and TOPLOC proofs (built from
bf16 hidden states) verify against a bf16 prefill. For fp32 models the paths differ only in
summation order (~1e-6). The cost: an fp32 path holds its weights at twice the bf16 size, so it
is not a candidate when those copies would not fit in half the available memory.

The measurement runs at the current torch thread count for decode batches of 1, 16 and 64 rows,
on cache-cold weights (each candidate cycles through ~48 MB of weight copies, as a decode step
streams every weight from memory). Each shape's candidates are scored by their slowdown against
the fastest, summed over those batches; a candidate 4x behind the best is not timed further.
It takes several seconds for a 135M model (a fraction of a second for the tiny one), once per
machine: the choice is cached in memory and in a JSON file per machine key (CPU model and SIMD
flags, torch version, threads, dtype, shapes, candidates) under ``<cache_dir()>/kernels``
(``$PRIME_CACHE_DIR`` or ``~/.cache/prime-network``); a file that is unreadable or made for
another key is ignored and replaced. A measurement taken while other processes oversubscribed
the cores can be off; delete the file to measure again. Force one path everywhere with ``kernel=``
(``Engine(..., kernel="fp32_mm_t")``) or ``$PRIME_ENGINE_KERNEL``; ``auto`` measures.
Off the CPU the engine uses ``linear`` without measuring.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from protocol.canonical import canonical_bytes, parse_json
from protocol.errors import ModelError, ProtocolError

logger = logging.getLogger(__name__)

PATHS = ("mm_t", "linear", "dnn", "fp32_mm_t", "fp32_linear", "fp32_dnn")
"""Every kernel path, in order of preference when two measure the same."""
REFERENCE = "linear"
"""The path transformers itself runs (``F.linear`` in the model dtype)."""
ENV_VAR = "PRIME_ENGINE_KERNEL"
CACHE_FORMAT = 1
BATCHES = (1, 16, 64)
"""Rows per call the candidates are timed at (decode batch sizes)."""
DROP_FACTOR = 4.0
"""A candidate this many times slower than the best on a shape is not timed further on it."""
REPEATS = 2
"""Timed samples per candidate after the warm-up pass (which counts as a sample too)."""
SLOW_PASS_S = 0.05
"""A kernel whose first pass over the copies took longer is timed once more, not ``REPEATS`` times."""
MIN_TIMED_S = 0.002
"""Each timed sample runs the kernel often enough to last at least this long."""
STREAM_BYTES = 48 << 20
"""Weight copies per shape total about this many fp32 bytes, more than the CPU caches hold."""
MAX_COPIES = 64

Shape = tuple[int, int]
"""(in_features, out_features) of one weight."""


def _shape_name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


class Linear:
    """``y = x W^T + b`` for ``W`` in Hugging Face layout ``[out, in]``, computed by one kernel path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> None:
        if path not in PATHS:
            raise ModelError(f"unknown kernel path {path!r}; use one of {', '.join(PATHS)}")
        self.path = path
        self.out_dtype = weight.dtype
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        upcast = path.startswith("fp32_")
        w = weight.float() if upcast else weight
        self.compute_dtype = w.dtype
        self.bias = None if bias is None else (bias.float() if upcast else bias)
        self.kind = path.removeprefix("fp32_")
        if self.kind == "mm_t":
            self.weight = w.t().contiguous()
        elif self.kind == "dnn":
            try:  # oneDNN's blocked layout, packed once (it needs AVX512-BW/AVX-NE-CONVERT for bf16)
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
            except (RuntimeError, AttributeError) as exc:
                raise ModelError(f"kernel path {path} is not available here: {exc}") from exc
        else:
            self.weight = w.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != self.compute_dtype:
            flat = flat.to(self.compute_dtype)
        if self.kind == "linear":
            out = F.linear(flat, self.weight, self.bias)
        elif self.kind == "dnn":
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        elif self.bias is not None:
            out = torch.addmm(self.bias, flat, self.weight)
        else:
            out = torch.mm(flat, self.weight)
        if out.dtype != self.out_dtype:
            out = out.to(self.out_dtype)  # one rounding, as a bf16 kernel's fp32 accumulator does
        result: torch.Tensor = out.view(*x.shape[:-1], self.out_features)
        return result


@cache
def available(path: str, dtype: torch.dtype) -> bool:
    """Whether ``path`` runs for ``dtype`` weights on this CPU (oneDNN's bf16 needs AVX512-BW or AMX)."""
    try:
        Linear(torch.ones((4, 8), dtype=dtype), None, path)(torch.ones((2, 8), dtype=dtype))
    except (ModelError, RuntimeError) as exc:
        logger.debug("kernel path %s unavailable for %s: %s", path, dtype, exc)
        return False
    return True


@dataclass
class KernelChoice:
    """The path of every weight shape, and where the choice came from."""

    paths: dict[Shape, str]
    source: str
    """``measured``, ``cache``, ``forced`` or ``device`` (not a CPU: no measurement)."""
    key: dict[str, object] = field(default_factory=dict)
    gflops: dict[Shape, dict[str, dict[int, float]]] = field(default_factory=dict)
    """Measured GFLOP/s per shape, candidate and rows (empty unless measured or cached)."""
    cache_file: Path | None = None

    def path(self, shape: Shape) -> str:
        return self.paths[shape]

    def summary(self) -> str:
        counts = Counter(self.paths.values())
        return ", ".join(f"{p} x{n}" for p, n in counts.most_common())

    def describe(self) -> str:
        """One line per shape: the chosen path and every measured candidate's GFLOP/s."""
        lines = []
        for shape, path in sorted(self.paths.items()):
            rates = self.gflops.get(shape, {})
            cand = "; ".join(
                f"{c} " + "/".join(f"{rates[c][m]:.1f}" if m in rates[c] else "-" for m in BATCHES)
                for c in PATHS
                if c in rates
            )
            lines.append(
                f"{_shape_name(shape)}: {path}" + (f" (GFLOP/s at {BATCHES} rows: {cand})" if cand else "")
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "paths": {_shape_name(s): p for s, p in sorted(self.paths.items())},
            "gflops": {
                _shape_name(s): {c: {str(m): v for m, v in r.items()} for c, r in rates.items()}
                for s, rates in sorted(self.gflops.items())
            },
            "cache_file": str(self.cache_file) if self.cache_file else None,
        }


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths worth timing for weights in ``dtype`` (the fp32 ones are the plain ones for fp32)."""
    paths = [p for p in PATHS if dtype != torch.float32 or not p.startswith("fp32_")]
    return tuple(p for p in paths if available(p, dtype))


def cpu_identity() -> dict[str, object]:
    """The CPU a measurement was taken on (model name, architecture, SIMD flags): part of every machine key
    (this module's and the node's engine choice, `node/engine_choice.py`)."""
    model: str | None = None
    flags: str | None = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and model is None:
                    model = value.strip()
                elif name == "flags" and flags is None:
                    flags = value
                if model is not None and flags is not None:
                    break  # the first processor is enough
    except OSError:
        pass
    simd = sorted(f for f in (flags or "").split() if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "arch": platform.machine(),
        "simd": simd,
    }


def simd_summary(simd: object) -> str:
    flags = set(simd) if isinstance(simd, list) else set()
    shown = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return " ".join(shown) or "no avx2"


def machine_key(shapes: Sequence[Shape], dtype: torch.dtype, threads: int | None = None) -> dict[str, object]:
    """Everything a measured choice depends on; a cache file is valid only for an equal key."""
    return {
        "format": CACHE_FORMAT,
        **cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if threads is None else threads,
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": [list(s) for s in sorted(set(shapes))],
        "candidates": list(candidates(dtype)),
    }


def default_cache_dir() -> Path:
    from models.smollm2 import cache_dir

    return cache_dir() / "kernels"


def cache_file(key: dict[str, object], directory: Path) -> Path:
    digest = hashlib.sha256(canonical_bytes(key)).hexdigest()[:16]
    return directory / f"kernels-{digest}.json"


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _time_calls(linears: Sequence[Linear], x: torch.Tensor, passes: int) -> float:
    """Seconds per call, running every copy in turn ``passes`` times."""
    t0 = time.perf_counter()
    for _ in range(passes):
        for lin in linears:
            lin(x)
    return (time.perf_counter() - t0) / (passes * len(linears))


def measure(
    shapes: Sequence[Shape], dtype: torch.dtype, paths: Sequence[str], batches: Sequence[int] = BATCHES
) -> dict[Shape, dict[str, dict[int, float]]]:
    """Seconds per call of every path on every shape at every row count (a hopeless path is dropped).

    Each path runs over enough distinct copies of the weight (~``STREAM_BYTES``) that they do not
    stay in the CPU caches between calls: in a decode step every weight is read from memory once,
    and a kernel timed on a cache-hot weight ranks differently (measured on the AVX2 EPYC).
    """
    gen = torch.Generator().manual_seed(0)
    out: dict[Shape, dict[str, dict[int, float]]] = {}
    with torch.inference_mode():
        for shape in sorted(set(shapes), key=lambda s: s[0] * s[1]):
            k, n = shape
            copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (4 * k * n))))
            weight = (torch.randn((n, k), generator=gen) * 0.02).to(dtype)
            weights = [weight] + [weight.clone() for _ in range(copies - 1)]  # distinct memory is what counts
            linears = {p: [Linear(w, None, p) for w in weights] for p in paths}
            del weight, weights
            times: dict[str, dict[int, float]] = {p: {} for p in paths}
            alive = list(paths)
            for rows in batches:
                x = torch.randn((rows, k), generator=gen).to(dtype)
                first = {p: _time_calls(linears[p], x, 1) for p in alive}  # warm-up
                # A first pass this far behind (and slow enough to matter) is not timed again.
                cut = DROP_FACTOR * min(first.values())
                alive = [p for p in alive if first[p] <= cut or first[p] * copies < 0.01]
                best = {p: first[p] for p in alive}
                for r in range(REPEATS):
                    for p in alive:
                        if r and first[p] * copies > SLOW_PASS_S:
                            continue  # one timed pass is enough for a slow kernel (few are, and briefly)
                        passes = max(1, int(MIN_TIMED_S / max(first[p] * copies, 1e-7)))
                        best[p] = min(best[p], _time_calls(linears[p], x, passes))
                for p in alive:
                    times[p][rows] = best[p]
                fastest = min(best.values())
                alive = [p for p in alive if best[p] <= DROP_FACTOR * fastest]
            out[shape] = {p: t for p, t in times.items() if t}
            del linears
    return out


def pick(times: dict[Shape, dict[str, dict[int, float]]]) -> dict[Shape, str]:
    """Per shape, the path with the least summed slowdown against each row count's fastest."""
    chosen: dict[Shape, str] = {}
    for shape, by_path in times.items():
        rows = sorted({m for t in by_path.values() for m in t})
        fastest = {m: min(t[m] for t in by_path.values() if m in t) for m in rows}

        scores = {
            # a path missing a row count was dropped before it: it was far behind
            p: sum(t[m] / fastest[m] for m in rows) if all(m in t for m in rows) else math.inf
            for p, t in by_path.items()
        }
        chosen[shape] = min(scores, key=lambda p: (scores[p], PATHS.index(p)))
    return chosen


def _gflops(times: dict[Shape, dict[str, dict[int, float]]]) -> dict[Shape, dict[str, dict[int, float]]]:
    return {
        s: {p: {m: 2 * m * s[0] * s[1] / t / 1e9 for m, t in by_m.items()} for p, by_m in by_path.items()}
        for s, by_path in times.items()
    }


def _parse_shape(name: str) -> Shape:
    k, n = name.split("x")
    return int(k), int(n)


def _candidates_of(key: dict[str, object]) -> list[str]:
    cands = key.get("candidates")
    return [str(c) for c in cands] if isinstance(cands, list) else []


def _read_cache(path: Path, key: dict[str, object], shapes: set[Shape]) -> KernelChoice | None:
    """The cached choice at ``path``, or None (logged) when it is missing, corrupt or another key's."""
    try:
        data = parse_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ProtocolError) as exc:
        logger.warning("ignoring unreadable kernel cache %s: %s", path, exc)
        return None
    try:
        if data["key"] != key:
            logger.warning("ignoring kernel cache %s: made for another machine key", path)
            return None
        paths = {_parse_shape(name): str(p) for name, p in data["paths"].items()}
        if set(paths) != shapes or any(p not in _candidates_of(key) for p in paths.values()):
            raise ValueError("shapes or paths do not match the key")
        gflops = {
            _parse_shape(name): {c: {int(m): float(v) for m, v in r.items()} for c, r in rates.items()}
            for name, rates in data.get("gflops", {}).items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring malformed kernel cache %s: %s", path, exc)
        return None
    return KernelChoice(paths, "cache", key, gflops, path)


def write_cache_file(path: Path, data: dict[str, object], what: str) -> None:
    """Write a measurement cache file as JSON, whole or not at all; a failure is logged, never raised
    (the measurement stays valid in memory)."""
    # A temporary sibling, fsynced, then renamed: a reader never sees half a file, and two
    # processes measuring at once both write whole files (the last rename wins).
    body = json.dumps(data, indent=1, sort_keys=True).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        logger.warning("could not write %s cache %s: %s", what, path, exc)


def _write_cache(choice: KernelChoice) -> None:
    assert choice.cache_file is not None
    write_cache_file(choice.cache_file, {"key": choice.key, **choice.to_json()}, "kernel")


_MEMO: dict[str, KernelChoice] = {}


def choose(
    shapes: Sequence[Shape],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    kernel: str | None = None,
    cache_dir: Path | None = None,
) -> KernelChoice:
    """The kernel path for every shape in ``shapes`` (one entry per weight; repeats allowed).

    ``kernel`` (else ``$PRIME_ENGINE_KERNEL``, else ``auto``) forces one path for every shape;
    ``auto`` measures on a CPU (or reuses the cached measurement) and picks ``linear`` elsewhere.
    """
    unique = set(shapes)
    forced = kernel if kernel is not None else os.environ.get(ENV_VAR, "auto")
    if forced != "auto":
        if forced not in PATHS:
            raise ModelError(f"unknown kernel path {forced!r}; use auto or one of {', '.join(PATHS)}")
        logger.info(
            "engine kernels forced: %s for every %s weight", forced, str(dtype).removeprefix("torch.")
        )
        return KernelChoice(dict.fromkeys(unique, forced), "forced")
    if torch.device(device).type != "cpu":
        return KernelChoice(dict.fromkeys(unique, REFERENCE), "device")
    key = machine_key(shapes, dtype)
    cands = list(candidates(dtype))
    if dtype != torch.float32:
        extra = sum(n * s[0] * s[1] * 4 for s, n in Counter(shapes).items())
        available = _available_bytes()
        if available is not None and extra > available // 2:
            logger.info(
                "fp32 kernel paths skipped: fp32 weights need %.1f GB of %.1f GB available",
                extra / 1e9,
                available / 1e9,
            )
            cands = [p for p in cands if not p.startswith("fp32_")]
            key["candidates"] = cands
    path: Path | None
    try:
        path = cache_file(key, cache_dir if cache_dir is not None else default_cache_dir())
    except OSError as exc:  # e.g. a read-only home: measure, remember in memory only
        logger.warning("no kernel cache directory: %s", exc)
        path = None
    memo_key = str(path) if path is not None else canonical_bytes(key).decode()
    if memo_key in _MEMO:
        return _MEMO[memo_key]
    choice = _read_cache(path, key, unique) if path is not None else None
    if choice is None:
        t0 = time.perf_counter()
        logger.info(
            "measuring matmul kernels for %d %s weight shapes (once per machine; cached in %s)",
            len(unique),
            key["dtype"],
            path,
        )
        times = measure(sorted(unique), dtype, cands)
        choice = KernelChoice(pick(times), "measured", key, _gflops(times), path)
        logger.info("kernel measurement took %.1f s", time.perf_counter() - t0)
        if path is not None:
            _write_cache(choice)
    logger.info(
        "engine kernels for %s on %s (%s, %s threads), %s: %s\n%s",
        key["dtype"],
        key["cpu"],
        simd_summary(key["simd"]),
        key["threads"],
        choice.source,
        choice.summary(),
        choice.describe(),
    )
    _MEMO[memo_key] = choice
    return choice
