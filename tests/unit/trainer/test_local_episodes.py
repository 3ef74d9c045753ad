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


def test_a_turn_the_environment_cannot_answer_drops_its_group_and_the_step_goes_on(loaded: LoadedModel) -> None:
    """An environment whose `step` raises `UngradableError` (its own failure: a starved worker, a dead sandbox)
    stopped the whole local step. Now that episode stops, its group is dropped and counted as ungradable (never
    trained on as reward 0), and the other groups are what they would have been (the same tokens, masks and
    rewards; logprobs to float precision: later turns batch them with fewer companions, 4.8e-7 apart here)."""
    from environments.alphabet_sort import AlphabetSort
    from protocol.errors import UngradableError

    env = get_env("alphabet-sort")
    assert isinstance(env, AlphabetSort)
    first = env.sample(derive_seed("tasks", 5, 0) % 2**63, 2)[0]

    class Failing(AlphabetSort):
        def step(self, task, state, turn_text):  # type: ignore[no-untyped-def]
            if task.task_id == first.task_id:
                raise UngradableError("the scripted user's worker died")
            return super().step(task, state, turn_text)

    batch = LocalSource(loaded, Failing(), group_size=GROUP, max_new_tokens=12, task_seed=5).next_batch(0, 2, 0)
    whole = LocalSource(loaded, env, group_size=GROUP, max_new_tokens=12, task_seed=5).next_batch(0, 2, 0)
    assert batch.counts.ungradable == GROUP and batch.counts.accepted == GROUP
    (group,), kept = batch.groups, whole.groups[1]
    assert [(s.tokens, s.loss_mask, s.reward, s.group_id) for s in group] == \
        [(s.tokens, s.loss_mask, s.reward, s.group_id) for s in kept]
    for got, want in zip(group, kept, strict=True):
        assert got.sampling_logprobs == pytest.approx(want.sampling_logprobs, abs=1e-4)
