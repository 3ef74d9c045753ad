"""Operator surface: config layering, shipped configs, --help without torch, metrics, publish hook."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from netfixtures import free_port

from protocol.errors import ConfigError
from trainer.config import TrainerConfig, load_config
from trainer.metrics import STEP_KEYS, MetricsSink
from trainer.publish import LocalDirectoryPublisher, Publisher, PublishHook, publish_timing

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "trainer").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path: Path) -> None:
    from trainer.config import load_sft_config

    # `*-sft.toml` are `prime-trainer sft` configs; the others are RL configs.
    cfg = (load_sft_config if path.stem.endswith("-sft") else load_config)(["--config", str(path)])
    assert cfg.max_steps > 0


def test_sources_layer_defaults_toml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('max_steps = 7\n[loss]\nepsilon_high = 0.3\ndelta = 5.0\n'
                    '[data]\ntype = "directory"\npath = "from-toml"\n')
    monkeypatch.setenv("PRIME_LOSS__DELTA", "6.0")
    monkeypatch.setenv("PRIME_MAX_STEPS", "8")
    cfg = load_config(["--config", str(toml), "--max-steps", "9", "--data.poll-interval-s", "2"])
    assert cfg.loss.epsilon_high == 0.3 and cfg.loss.delta == 6.0 and cfg.max_steps == 9
    assert cfg.loss.epsilon_low == TrainerConfig().loss.epsilon_low
    assert str(cfg.data.path) == "from-toml"  # type: ignore[union-attr]
    assert cfg.data.poll_interval_s == 2.0  # type: ignore[union-attr]


@pytest.mark.parametrize("argv", [["--loss.delta", "0.5"], ["--batch.seq-len", "many"], ["--data.type", "ftp"]])
def test_bad_values_raise_config_error(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        load_config(argv)


def test_unknown_toml_key_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[loss]\nepsilon = 0.2\n")
    with pytest.raises(ConfigError, match="epsilon"):
        load_config(["--config", str(toml)])


def test_help_does_not_import_torch() -> None:
    code = ("import sys, contextlib, io\nfrom trainer.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main(['--help'])\n    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nassert '--loss.epsilon-high' in out.getvalue()\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rank_leaves_with_its_code_and_its_output_flushed(world: str) -> None:
    """Under torchrun a rank skips the interpreter's finalization (`exit_process`: gloo's threads can abort it);
    what it printed and logged still reaches the pipes, and the exit code is the run's. An atexit hook runs only
    outside torchrun: that is what skipping the finalization means."""
    code = ("import atexit, logging, sys\nfrom trainer.cli import exit_process\n"
            "logging.basicConfig(level=logging.INFO)\nlogging.getLogger('t').info('logged line')\n"
            "print('printed line')\nsys.stderr.write('stderr line')\n"
            "atexit.register(lambda: print('finalized'))\nexit_process(3)\n")
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": world, "PYTHONPATH": str(ROOT)}  # PYTHONUNBUFFERED unset
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert "printed line" in r.stdout and "logged line" in r.stderr and "stderr line" in r.stderr
    assert ("finalized" in r.stdout) == (world == "1")


def test_metrics_json_lines_and_prometheus(tmp_path: Path) -> None:
    import io

    port = free_port()
    out = io.StringIO()
    sink = MetricsSink(tmp_path / "m.jsonl", port=port, progress=True, total_steps=2, stream=out)
    try:
        m = {k: 0.0 for k in STEP_KEYS}
        m.update(step=0, loss=0.25, reward_mean=0.5, stale_samples=3)
        sink.record(m)
        line = json.loads((tmp_path / "m.jsonl").read_text())
        assert line["loss"] == 0.25 and line["stale_samples"] == 3
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "prime_trainer_reward_mean 0.5" in body
        assert "step 1/2" in out.getvalue()
    finally:
        sink.close()


class _GatedPublisher(Publisher):
    """Copies like the local publisher, but only once the test opens the gate."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalDirectoryPublisher(root)
        self.gate = threading.Event()

    def publish(self, step: int, path: Path) -> None:
        assert self.gate.wait(30)
        self.inner.publish(step, path)


def test_publish_hook_does_not_block_and_publishes_in_order(tmp_path: Path) -> None:
    ckpts = []
    for n in (1, 2):
        d = tmp_path / "ck" / f"step-{n}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"w" * n)
        (d / "optimizer.pt").write_bytes(b"private")
        ckpts.append(d)
    pub = _GatedPublisher(tmp_path / "pub")
    hook = PublishHook(pub)
    hook.submit(1, ckpts[0])
    hook.submit(2, ckpts[1])  # returns although the first publication is still blocked
    assert hook.published == [] and len(hook.in_flight()) == 2
    pub.gate.set()
    hook.close(timeout=30)
    assert hook.published == [1, 2] and hook.failures == 0 and not hook.in_flight()
    timing = publish_timing(hook)  # what each step's metrics report (bench/learning.py's publication time)
    assert timing["published_versions"] == 2 and timing["publish_seconds"] > 0
    assert timing["publish_chain_seconds"] == 0.0  # a local directory records nothing on chain
    assert (tmp_path / "pub" / "latest").read_text().strip() == "2"
    assert (tmp_path / "pub" / "step-2" / "model.safetensors").read_bytes() == b"ww"
    assert not (tmp_path / "pub" / "step-2" / "optimizer.pt").exists()


def test_publish_failure_is_counted_not_raised(tmp_path: Path) -> None:
    hook = PublishHook(LocalDirectoryPublisher(tmp_path / "pub"))
    hook.submit(1, tmp_path / "does-not-exist")
    hook.close(timeout=30)
    assert hook.failures == 1 and hook.published == []
