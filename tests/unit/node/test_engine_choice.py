"""The node's default engine where vLLM is not installed: the `models/` engine, unmeasured, vLLM never imported.
(Where vLLM is installed the choice is measured: tests/integration/node/test_engine_choice_vllm.py, `make test-vllm`.)"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from node import commands
from node.config import CpuEngineSettings, load_config
from node.engine_choice import choose_engine, named
from protocol.model_spec import TinyModelSpec
from protocol.run import RunSpec

RUN = RunSpec(run_id="choice", tasks_per_batch=1, samples_per_task=2, max_new_tokens=4)


def test_without_vllm_a_cpu_node_runs_the_models_engine_without_measuring(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # as if vLLM were not installed, in any venv: find_spec("vllm") answers None and `import vllm` raises
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("PRIME_CACHE_DIR", str(tmp_path))
    cfg = load_config([])  # no engine type named anywhere
    assert not named(cfg.engine)
    with caplog.at_level(logging.INFO, logger="node.engine_choice"):
        settings = commands.engine_settings(cfg, TinyModelSpec(), RUN)
        choice = choose_engine(cfg.engine, TinyModelSpec(), RUN)
    assert settings == cfg.engine and settings.type == "cpu"
    assert (choice.source, choice.tok_s) == ("no vllm", {})
    assert "vLLM is not installed here" in caplog.text
    assert sys.modules["vllm"] is None and "node.vllm_engine" not in sys.modules  # never imported
    assert not list(tmp_path.rglob("engine-*.json"))  # nothing measured, nothing cached


def test_an_engine_type_named_in_any_source_is_never_second_guessed(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    assert named(load_config(["--engine.type", "cpu"]).engine)
    assert named(load_config(["--engine.type", "vllm"]).engine)
    (tmp_path / "node.toml").write_text('[engine]\ntype = "cpu"\n')
    assert named(load_config(["--config", str(tmp_path / "node.toml")]).engine)
    monkeypatch.setenv("PRIME_ENGINE__TYPE", "cpu")
    assert named(load_config([]).engine)
    monkeypatch.delenv("PRIME_ENGINE__TYPE")
    # other engine fields alone do not name the engine
    assert not named(load_config(["--engine.threads", "2", "--engine.dtype", "bfloat16"]).engine)
    assert not named(CpuEngineSettings())
    given = load_config(["--engine.type", "cpu"]).engine
    assert choose_engine(given, TinyModelSpec(), RUN).source == "given"
    gpu = load_config(["--engine.device", "cuda:0"]).engine
    assert choose_engine(gpu, TinyModelSpec(), RUN).source == "device"
