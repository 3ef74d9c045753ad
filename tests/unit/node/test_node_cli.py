"""prime-node's entry point: usage, fast --help without torch, short flags, every shipped config parses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from node.cli import expand_flags, main
from node.config import load_config


def test_usage_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("join", "status", "claim", "leave", "withdraw", "protection"):
        assert cmd in out
    assert main(["frobnicate"]) == 2


def test_short_flags_expand_into_config_fields() -> None:
    argv = expand_flags(["--gpu", "1", "--deployment", "d.json", "--keystore=k.json", "--rpc-url", "http://x"])
    cfg = load_config(argv)
    assert cfg.engine.device == "cuda:1"
    assert str(cfg.chain.deployment) == "d.json" and str(cfg.key.keystore) == "k.json"
    assert cfg.chain.rpc_url == "http://x"
    assert load_config(expand_flags(["--cpu"])).engine.device == "cpu"


def test_help_imports_no_torch_or_web3() -> None:
    code = ("import sys, time; t=time.monotonic()\nfrom node.cli import main\ntry: main(['join', '--help'])\n"
            "except SystemExit: pass\nassert 'torch' not in sys.modules and 'web3' not in sys.modules, 'heavy import'\n"
            "print(time.monotonic()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--chain.rpc-url" in out.stdout and "--engine.device" in out.stdout
    # the time is printed for the curious; tests assert behaviour, not timing (CONVENTIONS 12)


def test_gpu_flag_picks_vllm_when_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import node.engines

    monkeypatch.setattr(node.engines, "vllm_importable", lambda: True)
    cfg = load_config(expand_flags(["--gpu", "0"]))
    assert (cfg.engine.type, cfg.engine.device) == ("vllm", "cuda:0")
    explicit = load_config(expand_flags(["--gpu=1", "--engine.type", "cpu"]))  # an explicit choice stands
    assert (explicit.engine.type, explicit.engine.device) == ("cpu", "cuda:1")
    monkeypatch.setattr(node.engines, "vllm_importable", lambda: False)
    assert load_config(expand_flags(["--gpu", "0"])).engine.type == "cpu"


def test_engine_type_vllm_without_vllm_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import node.engines
    from protocol.errors import ConfigError
    from protocol.model_spec import TinyModelSpec

    cfg = load_config(["--engine.type", "vllm", "--engine.dtype", "float32"])
    assert cfg.engine.type == "vllm" and cfg.engine.dtype == "float32"
    monkeypatch.setattr(node.engines, "vllm_importable", lambda: False)
    with pytest.raises(ConfigError, match=r"make setup-vllm.*|.*\[gpu\]"):
        node.engines.build_engine(cfg.engine, TinyModelSpec())
    with pytest.raises(Exception, match="does not match any of the expected tags"):
        load_config(["--engine.type", "sglang"])
