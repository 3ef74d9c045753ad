"""The async window, group filtering in a step, and bad rollout files from the network."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from protocol.errors import UnknownVersionError
from protocol.rollout_files import ROLLOUT_SCHEMA, RolloutError, Sample, read_rollouts, write_rollouts
from tests.unit.trainer.conftest import tiny_llama
from tests.unit.trainer.rollout_factory import make_group
from trainer.config import TrainerConfig
from trainer.grpo import Trainer
from trainer.source import DataStarvedError, DirectorySource, Fill, window_verdict


def _groups(versions: list[int], size: int = 2, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [s for i, v in enumerate(versions) for s in make_group(rng, f"g{i}-v{v}", v, size, 64)]


def test_window_verdicts() -> None:
    g = _groups([3])
    assert window_verdict(g, step=5, async_level=2) == "ok"
    assert window_verdict(g, step=6, async_level=2) == "stale"
    assert window_verdict(g, step=2, async_level=2) == "future"
    assert window_verdict(g, step=3, async_level=0) == "ok"


def test_directory_source_drops_and_counts_stale_and_future(tmp_path: Path) -> None:
    write_rollouts(tmp_path / "a.parquet", _groups([0, 4, 5, 9, 5, 3]))
    src = DirectorySource(tmp_path, poll_interval_s=0.01, wait_timeout_s=0.2)
    batch = src.next_batch(step=5, n_groups=2, async_level=1)
    assert [g[0].policy_version for g in batch.groups] == [4, 5]
    assert batch.counts.stale == 2 and batch.counts.accepted == 4
    batch = src.next_batch(step=5, n_groups=1, async_level=1)
    assert [g[0].policy_version for g in batch.groups] == [5]
    assert batch.counts.future == 2  # version 9 from step 5's point of view
    with pytest.raises(DataStarvedError):
        src.next_batch(step=5, n_groups=1, async_level=1)  # only the stale v3 group is left


def test_directory_source_position_round_trips(tmp_path: Path) -> None:
    write_rollouts(tmp_path / "000.parquet", _groups([0, 0, 0], seed=1))
    src = DirectorySource(tmp_path, wait_timeout_s=0.1)
    first = src.next_batch(0, 1, 0)
    state = src.state_dict()
    rest = src.next_batch(0, 2, 0)
    again = DirectorySource(tmp_path, wait_timeout_s=0.1)
    again.load_state_dict(state)
    assert again.next_batch(0, 2, 0).groups == rest.groups
    assert first.groups[0] not in rest.groups


def test_malformed_files_are_rejected_and_counted(tmp_path: Path) -> None:
    (tmp_path / "000-garbage.parquet").write_bytes(b"not parquet at all")
    bad = _groups([0])
    broken = Sample(**{**bad[0].__dict__, "loss_mask": bad[0].loss_mask[:-1]})
    write_rollouts(tmp_path / "001-short-mask.parquet", [broken])
    t = pa.table({n: [] for n in ROLLOUT_SCHEMA.names}, schema=ROLLOUT_SCHEMA.with_metadata({b"prime.rollout.schema": b"9"}))
    pq.write_table(t, tmp_path / "002-future-schema.parquet")
    (tmp_path / "003-partial.parquet.tmp").write_bytes(b"half")
    write_rollouts(tmp_path / "004-good.parquet", _groups([0]))
    src = DirectorySource(tmp_path, wait_timeout_s=0.2)
    batch = src.next_batch(0, 1, 0)
    assert batch.counts.rejected_files == 3 and len(batch.groups) == 1
    with pytest.raises(RolloutError):
        read_rollouts(tmp_path / "001-short-mask.parquet")
    with pytest.raises(UnknownVersionError):
        read_rollouts(tmp_path / "002-future-schema.parquet")


@pytest.mark.parametrize("field,value", [("reward", float("nan")), ("tokens", (1,)), ("policy_version", -1)])
def test_sample_validation(field: str, value: object) -> None:
    s = _groups([0])[0]
    with pytest.raises(RolloutError):
        Sample(**{**s.__dict__, field: value}).validate()
    with pytest.raises(RolloutError):
        Sample(**{**s.__dict__, "tokens": (1, 999) + s.tokens[2:]}).validate(vocab_size=64)


def test_step_filters_zero_advantage_groups_and_trains_on_the_rest(tmp_path: Path) -> None:
    rng = random.Random(0)
    flat = [Sample(**{**s.__dict__, "reward": 0.5}) for s in make_group(rng, "flat", 0, 4, 64)]
    live = make_group(rng, "live", 0, 4, 64)
    (tmp_path / "r").mkdir()
    write_rollouts(tmp_path / "r" / "0.parquet", flat + live)
    cfg = TrainerConfig.model_validate({
        "max_steps": 1, "progress": False,
        "batch": {"groups_per_step": 2, "seq_len": 32, "async_level": 0},
        "data": {"type": "directory", "path": str(tmp_path / "r"), "wait_timeout_s": 1},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    })
    trainer = Trainer(cfg, tiny_llama(), DirectorySource(tmp_path / "r", wait_timeout_s=1), torch.device("cpu"))
    m = trainer.train_step().metrics
    assert m["filtered_groups"] == 1
    assert m["samples"] == 4
    assert m["loss_tokens"] == sum(s.n_loss_tokens for s in live)
    assert m["grad_norm"] > 0
    assert (tmp_path / "ck" / "step-1" / "model.safetensors").is_file()


def test_kl_to_reference_starts_at_zero_then_grows(tmp_path: Path) -> None:
    rng = random.Random(3)
    (tmp_path / "r").mkdir()
    for n in range(2):
        write_rollouts(tmp_path / "r" / f"{n}.parquet", make_group(rng, f"g{n}", n, 4, 64))
    cfg = TrainerConfig.model_validate({
        "max_steps": 2, "progress": False, "optim": {"lr": 0.05},
        "loss": {"kl_coef": 0.1, "entropy_coef": 0.01, "normalization": "sequence"},
        "batch": {"groups_per_step": 1, "seq_len": 32, "async_level": 0},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    })
    trainer = Trainer(cfg, tiny_llama(), DirectorySource(tmp_path / "r", wait_timeout_s=1), torch.device("cpu"))
    first, second = trainer.run()
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)
    assert second["kl"] > 1e-6
    assert first["entropy"] > 0


def test_directory_step_trains_on_what_arrived_after_the_fill_timeout(tmp_path: Path) -> None:
    """Issue 26 item 2: after `fill_timeout_s` a step takes the fresh groups it has, if at least `min_groups`."""
    write_rollouts(tmp_path / "a.parquet", _groups([0, 3, 3]))
    src = DirectorySource(tmp_path, poll_interval_s=0.01, wait_timeout_s=0.3)
    state = src.state_dict()
    with pytest.raises(DataStarvedError):
        src.next_batch(step=3, n_groups=4, async_level=1)
    src.load_state_dict(state)
    batch = src.next_batch(step=3, n_groups=4, async_level=1, min_groups=2, fill_timeout_s=0.05)
    assert [g[0].policy_version for g in batch.groups] == [3, 3] and batch.counts.stale == 2
    with pytest.raises(DataStarvedError):
        src.next_batch(step=3, n_groups=4, async_level=1, min_groups=1, fill_timeout_s=0.05)


def test_after_a_short_step_the_next_takes_what_the_last_one_got_without_waiting_out_the_deadline(
        tmp_path: Path) -> None:
    """Issue 39 item 3: a dead node's share is not waited for again. With a fill deadline far away, a step that
    has 3 of 4 groups waits (here: starves after `wait_timeout_s`); told the last step got 3, it takes them."""
    write_rollouts(tmp_path / "a.parquet", _groups([3, 3, 3]))
    src = DirectorySource(tmp_path, poll_interval_s=0.01, wait_timeout_s=0.5)
    state = src.state_dict()
    with pytest.raises(DataStarvedError):
        src.next_batch(step=3, n_groups=4, async_level=1, min_groups=2, fill_timeout_s=3600)
    src.load_state_dict(state)
    batch = src.next_batch(step=3, n_groups=4, async_level=1, min_groups=2, fill_timeout_s=3600, expected=3)
    assert len(batch.groups) == 3
    # `expected` never goes below `min_groups`, and a run without a fill deadline (no short steps) ignores it
    assert Fill.start(4, 2, 3600, expected=1).expected == 2 and Fill.start(4, 2, None, expected=3).expected is None


def test_the_trainer_learns_the_expected_groups_from_a_short_step_and_forgets_them_after_a_full_one(
        tmp_path: Path) -> None:
    rng = random.Random(5)
    (tmp_path / "r").mkdir()
    write_rollouts(tmp_path / "r" / "0.parquet", [s for n in range(3) for s in make_group(rng, f"a{n}", 0, 4, 64)])
    cfg = TrainerConfig.model_validate({
        "max_steps": 2, "progress": False,
        "batch": {"groups_per_step": 4, "seq_len": 32, "async_level": 1, "fill_timeout_s": 0.2,
                  "min_groups_per_step": 2},
        "data": {"type": "directory", "path": str(tmp_path / "r"), "wait_timeout_s": 60},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    })
    trainer = Trainer(cfg, tiny_llama(), DirectorySource(tmp_path / "r", wait_timeout_s=60), torch.device("cpu"))
    assert trainer.expected.value is None
    assert trainer.train_step().metrics["groups"] == 3  # cut short by the fill deadline: a share is missing
    assert trainer.expected.value == 3
    write_rollouts(tmp_path / "r" / "1.parquet", [s for n in range(4) for s in make_group(rng, f"b{n}", 1, 4, 64)])
    assert trainer.train_step().metrics["groups"] == 4  # all there at once: the full count is expected again
    assert trainer.expected.value is None
