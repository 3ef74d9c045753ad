"""Local mode when the environment cannot grade: the group is dropped and counted, never a reward of 0,
and the trainer keeps going."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from environments import Environment, Message, Task, UngradableError, make_task
from environments.math_verifier import MathVerifier
from environments.mathematics import MathEnvironment
from models import LoadedModel, load
from protocol.model_spec import TinyModelSpec
from trainer.config import TrainerConfig
from trainer.grpo import Trainer
from trainer.local import LocalSource, derive_seed

GROUP = 4


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load(TinyModelSpec(seed=1, hidden_size=32, intermediate_size=64))


class OddTasksUngradable(Environment):
    """Grades every completion 0.5, except that it cannot grade tasks with an odd number."""

    name = "toy-odd-ungradable"
    version = "1"

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from(f"task {rng.randrange(1000)}", "")

    def task_from(self, question: str, answer: str) -> Task:
        return make_task(self.name, self.version, (Message(role="user", content=question),), answer)

    def _score(self, task: Task, completion: str) -> float:
        if int(task.question().split()[-1]) % 2:
            raise UngradableError("this grader cannot grade odd tasks")
        return 0.5


@pytest.mark.timeout(120)
def test_only_the_ungradable_groups_are_dropped(loaded: LoadedModel) -> None:
    env = OddTasksUngradable()
    source = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=4, task_seed=3)
    batch = source.next_batch(0, 8, 0)
    tasks = env.sample(derive_seed("tasks", 3, 0) % 2**63, 8)  # the step's tasks, as the source draws them
    odd = [t.task_id for t in tasks if int(t.question().split()[-1]) % 2]
    assert 0 < len(odd) < 8, "the seed should give both kinds"
    assert batch.counts.ungradable == len(odd) * GROUP
    assert batch.counts.accepted == (8 - len(odd)) * GROUP == sum(len(g) for g in batch.groups)
    assert not {s.task_id for g in batch.groups for s in g} & set(odd)
    assert all(s.reward == 0.5 for g in batch.groups for s in g)  # no stand-in 0 among them
    assert len({g[0].group_id for g in batch.groups}) == len(batch.groups)


@pytest.mark.timeout(120)
def test_trainer_survives_a_grader_that_cannot_grade(loaded: LoadedModel, tmp_path: Path) -> None:
    # A real grader failure: the math worker cannot even start in the time it is given.
    verifier = MathVerifier(start_timeout_s=0.001)
    source = LocalSource(loaded, MathEnvironment(verifier), group_size=GROUP, max_new_tokens=4)
    cfg = TrainerConfig.model_validate({
        "max_steps": 1, "progress": False,
        "batch": {"groups_per_step": 2, "seq_len": 256, "micro_batch_rows": 8, "async_level": 0},
        "data": {"type": "local", "env": "math", "group_size": GROUP, "max_new_tokens": 4},
        "checkpoint": {"dir": str(tmp_path / "ck"), "interval": 100},
    })
    trainer = Trainer(cfg, loaded.model, source, torch.device("cpu"), pad_token_id=0, tokenizer=loaded.tokenizer)
    source.attach(trainer.model)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step().metrics
    verifier.close()
    assert metrics["ungradable_samples"] == 2 * GROUP and metrics["samples"] == 0
    # Nothing was trained on: no reward of 0 stood in for the missing grades.
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True))
