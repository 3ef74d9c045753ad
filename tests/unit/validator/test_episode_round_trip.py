"""Multi-turn round trip on the tiny model: the node's episode loop (`node.episodes`, the `models/` engine) ->
the validator's turn-by-turn check (`validator.episodes`) -> the trainer's feed, and the cheats it names."""

from __future__ import annotations

from pathlib import Path

import pytest

from environments import ChatRenderer
from environments import get as get_environment
from models import load
from models.loading import LoadedModel
from node.engines import ModelsEngine
from node.episodes import build_episode_submission
from protocol.episodes import (
    EpisodeFeedItem,
    EpisodeRollout,
    EpisodeSubmission,
    TaskEpisodes,
    TurnRollout,
    environment_digest,
)
from protocol.model_spec import TinyModelSpec
from protocol.rollout import Reason, RunSpec
from protocol.rollout_files import feed_groups, read_rollouts, write_rollouts
from protocol.seeds import env_seed, sampling_seed, task_seed
from toploc import ToplocThresholds
from toploc.validation import prove
from validator.episodes import EpisodeCheck, check_episodes

SPEC = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=512)
NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil dev account #1 (well-known)
POOL = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
CHAIN = 31337
MANIFEST = b"\x11" * 32  # the version's manifest hash as the chain would record it
TH = ToplocThresholds()


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load(SPEC)


@pytest.fixture(scope="module")
def renderer(model: LoadedModel) -> ChatRenderer:
    return ChatRenderer(model.tokenizer)


def _run(env: str) -> RunSpec:
    return RunSpec(run_id="episodes", env=env, env_version="1", tasks_per_batch=2, samples_per_task=2,
                   max_new_tokens=12)


def _submit(model: LoadedModel, renderer: ChatRenderer, run: RunSpec) -> EpisodeSubmission:
    return build_episode_submission(ModelsEngine(model), run, NODE, 3, 0, MANIFEST, chain_id=CHAIN, pool=POOL,
                                    renderer=renderer)


def _check(model: LoadedModel, renderer: ChatRenderer, run: RunSpec, sub: EpisodeSubmission) -> EpisodeCheck:
    env = get_environment(run.env, run.env_version)
    tasks = env.sample(task_seed(NODE, 3, 0, run_id=run.run_id, chain_id=CHAIN, pool=POOL, manifest_hash=MANIFEST),
                       run.tasks_per_batch)
    at = {"run_id": run.run_id, "chain_id": CHAIN, "pool": POOL, "counter": 0, "manifest_hash": MANIFEST}
    return check_episodes(
        model, renderer, sub, tasks,
        env_seeds=[env_seed(NODE, 3, t.task_id, **at) for t in tasks],  # type: ignore[arg-type]
        seeds=[[sampling_seed(NODE, 3, t.task_id, i, **at) for i in range(len(tr.samples))]  # type: ignore[arg-type]
               for t, tr in zip(tasks, sub.tasks, strict=True)],
        run=run, thresholds=TH, reward_tolerance=1e-6, logprob_tolerance=0.05, eos_tie_drift=0.5)


@pytest.fixture(scope="module")
def sorted_run() -> RunSpec:
    return _run("alphabet-sort")


@pytest.fixture(scope="module")
def honest(model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec) -> EpisodeSubmission:
    return _submit(model, renderer, sorted_run)


def _replace_sample(sub: EpisodeSubmission, sample: EpisodeRollout) -> EpisodeSubmission:
    first = sub.tasks[0]
    task = TaskEpisodes(task_id=first.task_id, samples=(sample, *first.samples[1:]))
    return sub.model_copy(update={"tasks": (task, *sub.tasks[1:])})


def test_honest_multi_turn_round_trip_is_accepted_with_the_loss_mask_on_model_tokens(
        model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec, honest: EpisodeSubmission) -> None:
    # the scripted user of alphabet-sort answers every turn: several turns per episode, environment spans between
    assert all(len(s.turns) >= 2 for tr in honest.tasks for s in tr.samples)
    got = _check(model, renderer, sorted_run, honest)
    assert got.failure is None, got.failure
    assert got.paid_tokens is not None and got.paid_tokens <= honest.n_tokens()  # model tokens only
    for tr, group, rewards in zip(honest.tasks, got.groups, got.rewards, strict=True):
        for s, fed, reward in zip(tr.samples, group.samples, rewards, strict=True):
            assert fed.reward == reward == pytest.approx(s.reward)
            mask = fed.loss_mask()
            model_tokens = [t for turn in s.turns for t in turn.tokens]
            # every loss position holds the node's model token, in order; the holes are the environment's
            assert [t for t, m in zip(fed.tokens, mask, strict=True) if m] == model_tokens
            assert len(fed.tokens) > len(model_tokens) and not all(mask)
            assert len(fed.logprobs) == len(model_tokens)
            claimed = [lp for turn in s.turns for lp in turn.logprobs]
            assert max(abs(a - b) for a, b in zip(fed.logprobs, claimed, strict=True)) < 0.05


def test_the_trainer_trains_only_on_model_tokens_of_accepted_episodes(
        model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec, honest: EpisodeSubmission,
        tmp_path: Path) -> None:
    got = _check(model, renderer, sorted_run, honest)
    assert got.failure is None, got.failure
    item = EpisodeFeedItem(run_id=honest.run_id, work_key=b"\x22" * 32, node=honest.node, policy_version=3,
                           env=honest.env, env_version=honest.env_version, groups=got.groups)
    groups = feed_groups(item)
    path = write_rollouts(tmp_path / "r.parquet", [s for g in groups for s in g])
    back = read_rollouts(path, vocab_size=SPEC.vocab_size)  # validates: holes in the mask are allowed
    assert [s.tokens for s in back] == [s.tokens for g in groups for s in g]
    for tr, group, fed_group in zip(honest.tasks, groups, got.groups, strict=True):
        for s, sample, fed in zip(tr.samples, group, fed_group.samples, strict=True):
            p = len(fed_group.prompt_tokens)
            assert sample.tokens == fed_group.prompt_tokens + fed.tokens
            assert sample.loss_mask == (False,) * p + fed.loss_mask()
            assert [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m] == \
                [t for turn in s.turns for t in turn.tokens]
            assert [lp for lp, m in zip(sample.sampling_logprobs, sample.loss_mask, strict=True) if m] == \
                list(fed.logprobs)
            assert all(lp == 0.0 for lp, m in zip(sample.sampling_logprobs, sample.loss_mask, strict=True) if not m)
            assert sample.n_loss_tokens == sum(len(turn.tokens) for turn in s.turns)
    # one advantage per episode, spread over its model tokens only (packing zeroes the environment's holes)
    from trainer.packing import pack

    flat = [s for g in groups for s in g]
    rows = pack(flat, [1.0] * len(flat), [1.0] * len(flat), seq_len=max(len(s.tokens) for s in flat))
    assert int((rows.advantages != 0).sum()) == sum(s.n_loss_tokens for s in flat)


def test_calc_arith_episodes_round_trip(model: LoadedModel, renderer: ChatRenderer) -> None:
    run = _run("calc-arith")
    sub = _submit(model, renderer, run)
    got = _check(model, renderer, run, sub)
    assert got.failure is None, got.failure
    assert [s.reward for tr in sub.tasks for s in tr.samples] == [r for rs in got.rewards for r in rs]


def test_a_faked_environment_span_is_env_mismatch(model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec,
                                                  honest: EpisodeSubmission) -> None:
    # the node claims it saw another environment reply (a faked tool output / an injected hint): its digest names it
    s = honest.tasks[0].samples[0]
    faked = s.model_copy(update={"env_digest": environment_digest([[5, 6, 7]])})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, faked))
    assert got.failure is not None and got.failure[0] is Reason.ENV_MISMATCH


def test_a_redrawn_turn_is_sampling_mismatch(model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec,
                                             honest: EpisodeSubmission) -> None:
    # the last turn drawn again from another seed (with its own valid proofs and logprobs): the environment's
    # replay still matches (the last turn has no reply after it), the seeded sampler does not
    from models.engine import Engine
    from models.sampling import SamplingParams

    s = honest.tasks[0].samples[0]
    env = get_environment(sorted_run.env, "1")
    tasks = env.sample(task_seed(NODE, 3, 0, run_id=sorted_run.run_id, chain_id=CHAIN, pool=POOL,
                                 manifest_hash=MANIFEST), 2)
    at = {"run_id": sorted_run.run_id, "chain_id": CHAIN, "pool": POOL, "counter": 0, "manifest_hash": MANIFEST}
    from environments import render_episode
    r = render_episode(renderer, env, tasks[0], env_seed(NODE, 3, tasks[0].task_id, **at),  # type: ignore[arg-type]
                       [t.tokens for t in s.turns])
    context = list(r.ids[:r.model_spans[-1][0]])
    steps = sum(len(t.tokens) for t in s.turns[:-1])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    for other_seed in range(1, 40):
        g = Engine(model).generate([context], params, [other_seed], sorted_run.max_new_tokens, [steps])[0]
        if g.tokens != list(s.turns[-1].tokens) and g.finish_reason == s.turns[-1].finish_reason:
            break
    assert g.tokens != list(s.turns[-1].tokens)
    redrawn = TurnRollout(tokens=tuple(g.tokens), logprobs=tuple(g.logprobs), finish_reason=g.finish_reason,
                          proofs=tuple(prove(g.hidden_states)))
    reward = env.episode_reward(tasks[0], r.episode.env_seed, [*r.episode.turns[:-1], renderer.decode(g.tokens)])
    cheat = s.model_copy(update={"turns": (*s.turns[:-1], redrawn), "reward": reward})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, cheat))
    assert got.failure is not None and got.failure[0] is Reason.SAMPLING_MISMATCH, got.failure


def test_a_turn_after_the_end_is_env_mismatch(model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec,
                                              honest: EpisodeSubmission) -> None:
    s = honest.tasks[0].samples[0]
    assert s.ended in ("done", "max_turns")
    cheat = s.model_copy(update={"turns": (*s.turns, s.turns[-1])})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, cheat))
    assert got.failure is not None and got.failure[0] is Reason.ENV_MISMATCH, got.failure


def test_stopping_before_the_environment_ended_is_env_mismatch(
        model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec, honest: EpisodeSubmission) -> None:
    s = honest.tasks[0].samples[0]
    cheat = s.model_copy(update={"turns": s.turns[:1], "ended": "max_tokens", "env_digest": environment_digest([])})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, cheat))
    assert got.failure is not None and got.failure[0] is Reason.ENV_MISMATCH, got.failure


def test_an_inflated_reward_is_reward_mismatch(model: LoadedModel, renderer: ChatRenderer, sorted_run: RunSpec,
                                               honest: EpisodeSubmission) -> None:
    s = honest.tasks[0].samples[0]
    cheat = s.model_copy(update={"reward": 1.0 if s.reward < 0.5 else 0.0})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, cheat))
    assert got.failure is not None and got.failure[0] is Reason.REWARD_MISMATCH, got.failure


def test_one_prefill_per_episode_gives_each_turns_rows(model: LoadedModel, renderer: ChatRenderer,
                                                        sorted_run: RunSpec, honest: EpisodeSubmission) -> None:
    # the rows cut from one prefill over the whole sequence are those a prefill of the turn's own context gives
    import torch

    from environments import render_episode
    from models.scoring import Scorer
    from validator.episodes import turn_states

    env = get_environment(sorted_run.env, "1")
    tasks = env.sample(task_seed(NODE, 3, 0, run_id=sorted_run.run_id, chain_id=CHAIN, pool=POOL,
                                 manifest_hash=MANIFEST), 2)
    s = honest.tasks[0].samples[0]
    r = render_episode(renderer, env, tasks[0], env_seed(NODE, 3, tasks[0].task_id, run_id=sorted_run.run_id,
                                                         chain_id=CHAIN, pool=POOL, counter=0,
                                                         manifest_hash=MANIFEST),
                       [t.tokens for t in s.turns])
    rows = turn_states(model, [r], 8192)
    assert len(rows) == len(s.turns) >= 2
    for (offset, n), got in zip(r.model_spans, rows, strict=True):
        alone = Scorer.of(model).hidden([list(r.ids[:offset])], [list(r.ids[offset:offset + n])], [0])[0]
        torch.testing.assert_close(got.float(), alone.float(), rtol=1e-4, atol=1e-4)


def test_token_ids_outside_the_vocabulary_are_schema(model: LoadedModel, renderer: ChatRenderer,
                                                      sorted_run: RunSpec, honest: EpisodeSubmission) -> None:
    s = honest.tasks[0].samples[0]
    bad = s.turns[0].model_copy(update={"tokens": (SPEC.vocab_size + 5, *s.turns[0].tokens[1:])})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, s.model_copy(update={"turns": (bad, *s.turns[1:])})))
    assert got.failure is not None and got.failure[0] is Reason.SCHEMA, got.failure


def test_a_turn_generated_after_an_injected_hint_is_caught(model: LoadedModel, renderer: ChatRenderer,
                                                            sorted_run: RunSpec, honest: EpisodeSubmission) -> None:
    # The node swaps the environment's first reply for its own (a hint, a faked tool result) and generates turn 2
    # after it with the right seed and step. Committing to what it saw names it (env_mismatch); forging the digest
    # to the replay's leaves turn 2 drawn in a context the validator never rebuilds (sampling or proofs).
    from environments import Message, render_episode
    from models.engine import Engine
    from models.sampling import SamplingParams

    env = get_environment(sorted_run.env, "1")
    tasks = env.sample(task_seed(NODE, 3, 0, run_id=sorted_run.run_id, chain_id=CHAIN, pool=POOL,
                                 manifest_hash=MANIFEST), 2)
    at = {"run_id": sorted_run.run_id, "chain_id": CHAIN, "pool": POOL, "counter": 0, "manifest_hash": MANIFEST}
    e_seed = env_seed(NODE, 3, tasks[0].task_id, **at)  # type: ignore[arg-type]
    s = honest.tasks[0].samples[0]
    first = list(s.turns[0].tokens)
    context = renderer.prompt_ids(tasks[0].messages) + first
    hint = renderer.env_span(context, [Message(role="user", content="Hint: the answer is Zed, Ann, Bob.")])
    g = Engine(model).generate([context + hint], SamplingParams(temperature=1.0), [sampling_seed(
        NODE, 3, tasks[0].task_id, 0, **at)], sorted_run.max_new_tokens, [len(first)])[0]  # type: ignore[arg-type]
    turn2 = TurnRollout(tokens=tuple(g.tokens), logprobs=tuple(g.logprobs), finish_reason=g.finish_reason,
                        proofs=tuple(prove(g.hidden_states)))
    truth = render_episode(renderer, env, tasks[0], e_seed, [first, g.tokens])
    true_spans = [truth.ids[o:o + n] for o, n in truth.env_spans]
    ended = "max_tokens" if not truth.episode.done else ("max_turns" if len(truth.model_spans) >= env.max_turns
                                                         else "done")
    seen = s.model_copy(update={"turns": (s.turns[0], turn2), "env_digest": environment_digest([hint, *true_spans[1:]]),
                                "ended": ended, "reward": truth.episode.reward})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, seen))
    assert got.failure is not None and got.failure[0] is Reason.ENV_MISMATCH, got.failure
    if ended == "max_tokens":
        return  # the replay's episode goes on after turn 2: the forged variant would fail on its ending first
    forged = seen.model_copy(update={"env_digest": environment_digest(true_spans)})
    got = _check(model, renderer, sorted_run, _replace_sample(honest, forged))
    if tuple(g.tokens) == s.turns[1].tokens:
        # the tiny random model's draws hardly depend on the context: the hint changed no token, and the forged
        # submission is the honest one (nothing gained, nothing to slash). A real policy's draws move with it.
        assert got.failure is None
        return
    assert got.failure is not None and got.failure[0] in (Reason.PROOF_MISMATCH, Reason.SAMPLING_MISMATCH), got.failure
