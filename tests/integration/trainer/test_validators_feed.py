"""The trainer trains on two validators' HTTP feeds (`data.type = "validators"`), and a run stopped
after 2 steps and resumed from its checkpoint trains step 3 exactly as an uninterrupted run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun import torchrun

from tests.unit.trainer.feed_server import POOL, RUN_ID, FeedServer, feed_item
from trainer.config import load_config
from trainer.runner import run

TIMING = {"step_time_s", "batch_wait_s", "train_time_s", "tokens_per_s", "samples_per_s", "eval/time_s",
          "eval/greedy/generation_s"}


def _serve(a: FeedServer, b: FeedServer) -> None:
    """What the run will meet, in feed order (2 groups per step, async_level 1):
    step 0 takes c0, c1; step 1 takes c4 (v1), c2; step 2 drops c3 (v0, stale) and takes c5, c6.
    b's copy of c0 is the same work (trained once); a's tampered item is refused and counted."""
    item = {c: feed_item(0 if c < 4 else 1, c, vocab=320) for c in range(7)}
    for c in (0, 1, 4):
        a.add(item[c])
    a.add_tampered(feed_item(0, 9, vocab=320))
    for c in (2, 0, 3, 5, 6):
        b.add(item[c])


def _config(tmp: Path, a: FeedServer, b: FeedServer, steps: int, name: str) -> Path:
    path = tmp / f"{name}-{steps}.toml"
    path.write_text(f"""
max_steps = {steps}
progress = false
torch_threads = 1
metrics_file = "{tmp / name}.jsonl"
[model]
type = "tiny"
vocab_size = 320
hidden_size = 32
intermediate_size = 64
[optim]
lr = 0.01
[batch]
groups_per_step = 2
seq_len = 32
async_level = 1
[data]
type = "validators"
urls = ["{a.url}", "{b.url}"]
addresses = ["{a.address}", "{b.address}"]
chain_id = 31337
pool = "{POOL}"
run_id = "{RUN_ID}"
poll_interval_s = 0.05
wait_timeout_s = 20
[checkpoint]
dir = "{tmp / name}-ck"
[eval]
every = 2
env = "reverse-text"
num_tasks = 2
max_new_tokens = 3
""")
    return path


def _metrics(path: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {int(r["step"]): {k: v for k, v in r.items() if k not in TIMING} for r in rows}


@pytest.mark.timeout(240)
def test_trainer_on_validator_feeds_resumes_exactly(tmp_path: Path) -> None:
    with FeedServer() as a, FeedServer() as b:
        _serve(a, b)
        run(load_config(toml_path=_config(tmp_path, a, b, 3, "straight")))
        run(load_config(toml_path=_config(tmp_path, a, b, 2, "resumed")))
        requests_before = len(b.requests)
        run(load_config(toml_path=_config(tmp_path, a, b, 3, "resumed")))  # from step-2's checkpoint
        resumed_after = b.requests[requests_before][0]

    straight, resumed = _metrics(tmp_path / "straight.jsonl"), _metrics(tmp_path / "resumed.jsonl")
    assert sorted(straight) == [0, 1, 2] and sorted(resumed) == [0, 1, 2]
    assert straight[0]["rejected_files"] == 1  # the tampered item
    assert [straight[n]["samples"] for n in range(3)] == [8, 8, 8]  # 2 groups of 4, none twice
    assert [straight[n]["stale_samples"] for n in range(3)] == [0, 0, 4]
    assert resumed_after == 2  # b's cursor: c2 trained, the duplicate done, c3 not yet consumed
    assert resumed[2] == straight[2]  # the same groups, model, optimizer and RNG: bit for bit
    # The held-out eval ran after 2 steps and at the end (the resumed run's too); resuming after it stays exact.
    assert "eval/greedy/mean_reward" not in straight[0] and "eval/greedy/mean_reward" in straight[1]
    assert resumed[1] == straight[1] and "eval/greedy/mean_reward" in resumed[2]
    ckpt = json.loads((tmp_path / "straight-ck" / "step-3" / "trainer_state.json").read_text())
    assert ckpt["source"]["validators"][a.url]["cursor"] == 4


@pytest.mark.timeout(300)
def test_two_processes_train_on_rank_zeros_feed(tmp_path: Path) -> None:
    # Only rank 0 reads the feeds; both ranks must train the same groups as one process does.
    with FeedServer() as a, FeedServer() as b:
        _serve(a, b)
        run(load_config(toml_path=_config(tmp_path, a, b, 3, "one")))
        n_requests = len(a.requests) + len(b.requests)
        torchrun(["-m", "trainer.cli", "--config", str(_config(tmp_path, a, b, 3, "two"))], tmp_path, timeout=240)
        two_requests = len(a.requests) + len(b.requests) - n_requests
    one, two = _metrics(tmp_path / "one.jsonl"), _metrics(tmp_path / "two.jsonl")
    assert sorted(two) == [0, 1, 2]
    for n in range(3):
        for key in ("loss", "grad_norm", "samples", "stale_samples", "rejected_files", "eval/greedy/mean_reward"):
            if key.startswith("eval/") and n == 0:
                continue
            assert two[n][key] == pytest.approx(one[n][key], rel=1e-4, abs=1e-6), (n, key)
    assert two_requests == n_requests == 2  # one reader (rank 0), one page from each validator
