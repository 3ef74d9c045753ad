"""Where an operator reads a run: TensorBoard event files, W&B offline, the progress line, `eval.every`.

Every value is read back with the consumer's own reader (TensorBoard's EventAccumulator; W&B's protobuf
records from the offline run file) and compared with the metrics JSONL of the same run.
"""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from netfixtures import free_port

import environments
from models import load
from protocol.errors import ConfigError
from protocol.model_spec import HFModelSpec
from trainer.config import SFTConfig, TrainerConfig, WandbSettings, load_config, load_sft_config
from trainer.evaluate import evaluate
from trainer.metrics import STEP_KEYS, MetricsSink

TINY = {"type": "tiny", "seed": 3, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run file: a 7-byte header (`:W&B`, magic, version), then
    LevelDB-log records (crc32c, length, type; 32 KiB blocks) each holding a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    rows, pos, pending = [], 7, b""
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _offline_wandb_env(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """No key, a server address nothing listens on, and W&B's own files under tmp."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp / "wandb-home"))


def _assert_same_scalars(rows: list[dict[str, Any]], by_key: dict[str, dict[int, float]]) -> None:
    for row in rows:
        for key, value in row.items():
            if key == "step" or not isinstance(value, int | float):
                continue
            assert by_key[key][row["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), key


@pytest.mark.timeout(120)
def test_rl_run_logs_every_scalar_to_tensorboard_and_wandb_offline_with_scheduled_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.runner import run

    _offline_wandb_env(monkeypatch, tmp_path)
    cfg = TrainerConfig.model_validate({
        "model": TINY, "max_steps": 3, "progress": False, "torch_threads": 1,
        "batch": {"groups_per_step": 2, "seq_len": 128, "micro_batch_rows": 4, "async_level": 0},
        "data": {"type": "local", "env": "reverse-text", "group_size": 3, "max_new_tokens": 6},
        "checkpoint": {"dir": str(tmp_path / "ck"), "interval": 1, "keep": 3},
        "metrics_file": str(tmp_path / "m.jsonl"), "tensorboard_dir": str(tmp_path / "tb"),
        "wandb": {"project": "prime-test", "name": "tiny", "mode": "offline", "dir": str(tmp_path / "wb")},
        "eval": {"every": 2, "num_tasks": 3, "temperatures": [0.0, 1.0], "max_new_tokens": 5, "seed_start": 9000},
    })
    run(cfg)
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Every 2 steps and after the last: rows 1 (2 steps done) and 2 (the end), not row 0.
    assert not any(k.startswith("eval/") for k in rows[0])
    for row in rows[1:]:
        for label in ("greedy", "t1"):
            assert {f"eval/{label}/pass_rate", f"eval/{label}/mean_reward", f"eval/{label}/truncated_rate"} <= set(row)
    # The row of step n scores the weights after it: the same numbers as `prime-trainer eval` on step-<n+1>.
    env = environments.get("reverse-text")
    for row in rows[1:]:
        ckpt = load(HFModelSpec(name_or_path=str(tmp_path / "ck" / f"step-{row['step'] + 1}")))
        for temperature, label in ((0.0, "greedy"), (1.0, "t1")):
            report = evaluate(ckpt, env, 9000, 3, temperature=temperature, max_new_tokens=5)
            assert row[f"eval/{label}/mean_reward"] == pytest.approx(report.mean_reward, abs=1e-9)
            assert row[f"eval/{label}/mean_completion_tokens"] == report.mean_completion_tokens
    assert rows[0]["samples_per_s"] > 0
    # TensorBoard: every scalar of every JSONL row, at the row's step.
    _assert_same_scalars(rows, _tensorboard_scalars(tmp_path / "tb"))
    # W&B offline: the run file holds the same rows, no network needed.
    run_files = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history = _wandb_history(run_files[0])
    assert [h["_step"] for h in history] == [0, 1, 2]
    _assert_same_scalars(rows, {k: {h["_step"]: h[k] for h in history if k in h} for k in rows[-1]})


@pytest.mark.timeout(120)
def test_sft_run_logs_to_tensorboard_with_scheduled_eval(tmp_path: Path) -> None:
    from trainer.sft import run_sft

    cfg = SFTConfig.model_validate({
        "model": TINY, "progress": False, "max_steps": 2, "torch_threads": 1,
        "batch": {"examples_per_step": 4, "seq_len": 256},
        "data": {"type": "environment", "env": "reverse-text", "seed_start": 0, "num_examples": 8},
        "checkpoint": {"dir": str(tmp_path / "ck"), "interval": 1, "keep": 2},
        "metrics_file": str(tmp_path / "m.jsonl"), "tensorboard_dir": str(tmp_path / "tb"),
        "eval": {"every": 5, "num_tasks": 2, "max_new_tokens": 4},
    })
    run_sft(cfg)
    rows = _rows(tmp_path / "m.jsonl")
    assert "eval/greedy/pass_rate" not in rows[0] and "eval/greedy/pass_rate" in rows[1]  # at the end only
    assert rows[1]["examples_per_s"] > 0
    _assert_same_scalars(rows, _tensorboard_scalars(tmp_path / "tb"))


def test_wandb_mode_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_wandb_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")  # `mode` unset: W&B's own variable decides
    sink = MetricsSink(progress=False, wandb=WandbSettings(project="p", dir=tmp_path / "wb"))
    try:
        sink.record({"step": 0, "loss": 0.5, "eval/greedy/pass_rate": 0.25})
    finally:
        sink.close()
    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    (row,) = _wandb_history(run_file)
    assert row["loss"] == 0.5 and row["eval/greedy/pass_rate"] == 0.25


def test_wandb_configured_but_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        MetricsSink(progress=False, wandb=WandbSettings(project="p"))
    MetricsSink(progress=False, wandb=WandbSettings()).close()  # no project: W&B stays off, nothing imported


def _step_metrics(step: int, **extra: Any) -> dict[str, Any]:
    m: dict[str, Any] = {k: 0.0 for k in STEP_KEYS}
    m.update(step=step, reward_mean=0.625, reward_std=0.25, samples=32, stale_samples=2, staleness_mean=0.5,
             samples_per_s=12.5, tokens_per_s=900.0, step_time_s=2.56, batch_wait_s=1.25, **extra)
    return m


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_per_step() -> None:
    out = io.StringIO()
    sink = MetricsSink(progress=True, total_steps=4, stream=out)
    sink.record(_step_metrics(0))
    sink.record(_step_metrics(1, **{"eval/greedy/pass_rate": 0.75, "eval/greedy/mean_reward": 0.9}))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # one line per step, nothing redrawn, no bar in a log file
    assert lines[0].startswith("step 1/4 reward 0.625 ±0.250 samples 32 stale 2 staleness 0.50 | "
                               "12.50 samples/s 900 tok/s step 2.56 s wait 1.25 s | ")
    assert "eta" in lines[0] and "eval" not in lines[0]
    assert lines[1].startswith("step 2/4 ") and lines[1].endswith(" | eval greedy pass 0.750 reward 0.900")
    tty = _Terminal()
    MetricsSink(progress=True, total_steps=4, stream=tty).record(_step_metrics(1))
    assert tty.getvalue().startswith("[##########          ] step 2/4 reward")


def test_eval_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="eval.env"):  # a directory of rollouts names no environment
        load_config(["--eval.every", "5"])
    assert load_config(["--eval.every", "5", "--eval.env", "arithmetic"]).eval.env == "arithmetic"
    sft = ["--data.type", "environment", "--data.seed-start", "0", "--data.num-examples", "1000", "--eval.every", "5"]
    with pytest.raises(ConfigError, match=r"overlap the training seeds \[0, 1000\)"):
        load_sft_config([*sft, "--eval.seed-start", "990"])
    assert load_sft_config([*sft, "--eval.seed-start", "1000"]).eval.seed_start == 1000
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(["--eval.temperatures", "[1, 1.0]"])


@pytest.mark.timeout(120)
def test_cli_progress_lines_and_no_tracking_imports_unless_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer.cli import main

    for name in ("wandb", "tensorboardX", "tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now raises ImportError
    monkeypatch.chdir(tmp_path)
    rc = main(["--model.type", "tiny", "--model.hidden-size", "32", "--model.intermediate-size", "64",
               "--data.type", "local", "--data.group-size", "2", "--data.max-new-tokens", "4",
               "--batch.groups-per-step", "2", "--max-steps", "2", "--checkpoint.dir", "ck", "--torch-threads", "1",
               "--eval.every", "1", "--eval.num-tasks", "2", "--eval.max-new-tokens", "3"])
    assert rc == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["1/2", "2/2"]
    assert all(" samples/s " in x and " | eval greedy pass " in x for x in lines)


def test_a_failing_destination_does_not_stop_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _offline_wandb_env(monkeypatch, tmp_path)
    sink = MetricsSink(tmp_path / "m.jsonl", progress=False,
                       wandb=WandbSettings(project="p", mode="offline", dir=tmp_path / "wb"))
    try:
        sink.writers[0].run.finish()  # W&B's side is gone: logging to it raises
        sink.record({"step": 0, "loss": 0.5})
    finally:
        sink.close()
    assert "WandbWriter: step 0 not written" in caplog.text
    assert _rows(tmp_path / "m.jsonl") == [{"step": 0, "loss": 0.5}]
