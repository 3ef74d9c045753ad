"""Local mode on a multi-turn environment plays episodes as the network does (issue 36 item 5): the loss falls on
the model's turns only, the reward is the episode's score, and the same seeds give the same episodes."""

from __future__ import annotations

import pytest

from environments import ChatRenderer, MultiTurnEnvironment, render_episode
from environments import get as get_env
from models import LoadedModel, load
from protocol.model_spec import TinyModelSpec
from protocol.rollout_files import Sample
from trainer.local import LocalSource, derive_seed

GROUP = 3
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load(TinyModelSpec(seed=1, hidden_size=32, intermediate_size=64))


def _turns(sample: Sample, prompt_len: int) -> list[list[int]]:
    """The model's turns: the runs of the loss mask after the prompt."""
    turns: list[list[int]] = []
    previous = False
    for token, trained in zip(sample.tokens[prompt_len:], sample.loss_mask[prompt_len:], strict=True):
        if trained:
            if not previous:
                turns.append([])
            turns[-1].append(token)
        previous = trained
    return turns


@pytest.mark.parametrize("name", ["calc-arith", "alphabet-sort"])
def test_a_step_trains_only_on_the_model_turns_and_scores_each_episode(loaded: LoadedModel, name: str) -> None:
    env = get_env(name)
    assert isinstance(env, MultiTurnEnvironment)
    source = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=12, task_seed=5)
    batch = source.next_batch(0, 2, 0)
    tasks = env.sample(derive_seed("tasks", 5, 0) % 2**63, 2)
    assert [g[0].task_id for g in batch.groups] == [t.task_id for t in tasks]
    renderer = ChatRenderer(loaded.tokenizer)
    several = 0
    for g, (group, task) in enumerate(zip(batch.groups, tasks, strict=True)):
        assert len(group) == GROUP and {s.group_id for s in group} == {f"0-{g}"}
        prompt = renderer.prompt_ids(task.messages)
        for sample in group:
            sample.validate(loaded.model.config.vocab_size)
            assert tuple(sample.tokens[:len(prompt)]) == tuple(prompt) and not any(sample.loss_mask[:len(prompt)])
            turns = _turns(sample, len(prompt))
            several += len(turns) > 1
            # what a validator rebuilds from the model's turns alone: the same sequence, spans and reward
            rebuilt = render_episode(renderer, env, task, derive_seed("env", 5, 0, g), turns)
            assert sample.tokens == rebuilt.ids
            assert sample.loss_mask == rebuilt.loss_mask()
            assert sample.reward == rebuilt.episode.reward
            assert all(lp <= 0.0 for lp, m in zip(sample.sampling_logprobs, sample.loss_mask, strict=True) if m)
            assert all(lp == 0.0 for lp, m in zip(sample.sampling_logprobs, sample.loss_mask, strict=True) if not m)
    if name == "alphabet-sort":  # its scripted user answers every turn (a random model never calls calc's tool)
        assert several, "no episode took a second turn: the environment spans went untested"


def test_the_same_seeds_play_the_same_episodes(loaded: LoadedModel) -> None:
    env = get_env("calc-arith")
    first = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=12, task_seed=9).next_batch(3, 2, 0)
    again = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=12, task_seed=9).next_batch(3, 2, 0)
    other = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=12, task_seed=10).next_batch(3, 2, 0)
    assert first.groups == again.groups
    assert first.groups != other.groups
