"""Where vLLM is installed (`make test-vllm`), a CPU node that names no engine measures the `models/` engine and
vLLM once on the run's model, runs the faster, and reads the choice from its cache afterwards; a named engine is
never second-guessed. (Without vLLM: tests/unit/node/test_engine_choice.py.)"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's own handler writes to streams pytest closes
pytest.importorskip("vllm", reason="vLLM is not installed: `make setup-vllm` then `make test-vllm`")

from bench.loopback import RUN, TINY  # noqa: E402
from node import engine_choice  # noqa: E402
from node.config import load_config  # noqa: E402
from node.engine_choice import choose_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True, scope="module")
def _stop_vllm() -> Any:
    yield
    from node.vllm_engine import close_all

    close_all()


def test_a_cpu_node_without_an_engine_type_runs_the_faster_engine_measured_once_then_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engine_choice, "_MEMO", {})
    unnamed = load_config(["--engine.dtype", "float32"]).engine
    with caplog.at_level(logging.INFO, logger="node.engine_choice"):
        first = choose_engine(unnamed, TINY, RUN, cache_dir=tmp_path)
    assert first.source == "measured", first
    assert first.errors == {} and set(first.tok_s) == {"cpu", "vllm"} and min(first.tok_s.values()) > 0, first
    faster = max(first.tok_s, key=lambda n: (first.tok_s[n], n == "cpu"))
    assert first.settings.type == faster and first.settings.dtype == "float32"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine for"))
    assert f"models/ {first.tok_s['cpu']:.1f} tok/s" in line and f"vLLM {first.tok_s['vllm']:.1f} tok/s" in line
    print(f"\n[engine choice] {line}")
    assert choose_engine(unnamed, TINY, RUN, cache_dir=tmp_path) is first  # in-process memo

    # A new process reads the file instead of measuring; the choice follows the numbers in it (swapped here).
    assert first.cache_file is not None and first.cache_file.parent == tmp_path
    data = json.loads(first.cache_file.read_text())
    data["tok_s"] = {"cpu": first.tok_s["vllm"], "vllm": first.tok_s["cpu"]} if faster == "vllm" else \
        {"cpu": 1.0, "vllm": 2.0}
    first.cache_file.write_text(json.dumps(data))
    monkeypatch.setattr(engine_choice, "_MEMO", {})
    again = choose_engine(unnamed, TINY, RUN, cache_dir=tmp_path)
    assert again.source == "cache" and again.tok_s == data["tok_s"]
    assert again.settings.type == ("cpu" if faster == "vllm" else "vllm")

    # a file made for another machine key is ignored (and the choice measured again: not done here, it costs)
    data["key"]["cpu"] = "Another CPU"
    first.cache_file.write_text(json.dumps(data))
    assert engine_choice._read_cache(first.cache_file, engine_choice.engine_key(unnamed, TINY, RUN)) is None

    # a named engine is never measured, whatever the cache says
    named = load_config(["--engine.type", "cpu"]).engine
    assert choose_engine(named, TINY, RUN, cache_dir=tmp_path).source == "given"
