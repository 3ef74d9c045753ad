"""Each multi-turn cheat of `bench.episode_adversaries` (the attack bench's episode rows) against the validator's
turn-by-turn check (`validator.episodes.check_episodes`), on the tiny model and `alphabet-sort` (the tiny model
never writes a `<calc>` call, so the multi-turn paths run on the scripted user): every cheat ends in the
verdict that names it, and the cheat loop's honest play is accepted (so a verdict is the cheat's doing)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bench.adversaries import perturbed
from bench.episode_adversaries import CHEATS, Assignment, Cheat, narrow_first_eos, play
from environments import ChatRenderer
from models import load
from models.loading import LoadedModel
from protocol.episodes import MAX_TURNS, EpisodeRollout, EpisodeSubmission, TurnRollout
from protocol.model_spec import TinyModelSpec
from protocol.rollout import Reason, RunSpec
from protocol.run import MAX_TOKENS
from toploc import ToplocThresholds
from validator.episodes import EpisodeCheck, check_episodes, episode_schema_problem

SPEC = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=512)
NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil dev account #1 (well-known)
POOL = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
RUN = RunSpec(run_id="episodes", env="alphabet-sort", env_version="1", tasks_per_batch=2, samples_per_task=2,
              max_new_tokens=12)
AT = Assignment(NODE, 3, 0, b"\x11" * 32, 31337, POOL)
FP32_DRIFT = 0.01
"""The harness validators' `eos_tie_drift` (`bench.loopback.FP32_EOS_TIE_DRIFT`): fp32 everywhere, honest margins 0."""
NARROW_EOS = (10, (1, 1))
"""An assignment counter of `AT`'s node, and its episode, whose first turn ends early on an EOS won by (0.01, 0.5]
(the first `narrow_first_eos` finds over counters 0, 1, ...; a test checks it still is one)."""


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load(SPEC)


@pytest.fixture(scope="module")
def renderer(model: LoadedModel) -> ChatRenderer:
    return ChatRenderer(model.tokenizer)


def _check(model: LoadedModel, renderer: ChatRenderer, sub: EpisodeSubmission, at: Assignment = AT) -> EpisodeCheck:
    tasks = at.tasks(RUN)
    return check_episodes(
        model, renderer, sub, tasks, env_seeds=[at.seeds(RUN, t, 0)[0] for t in tasks],
        seeds=[[at.seeds(RUN, t, i)[1] for i in range(RUN.samples_per_task)] for t in tasks],
        run=RUN, thresholds=ToplocThresholds(), reward_tolerance=1e-6, logprob_tolerance=0.05,
        eos_tie_drift=FP32_DRIFT)


def test_the_cheat_loops_honest_play_is_accepted(model: LoadedModel, renderer: ChatRenderer) -> None:
    sub = play(model, renderer, RUN, AT, Cheat("honest"))
    assert all(len(s.turns) >= 2 for tr in sub.tasks for s in tr.samples)
    got = _check(model, renderer, sub)
    assert got.failure is None, got.failure


@pytest.mark.parametrize("name", ["fake_env", "hint", "redraw", "early_stop", "after_done", "inflate_reward",
                                  "env_seed"])
def test_an_episode_cheat_gets_the_verdict_that_names_it(model: LoadedModel, renderer: ChatRenderer,
                                                         name: str) -> None:
    sub = play(model, renderer, RUN, AT, Cheat(name))
    got = _check(model, renderer, sub)
    assert got.failure is not None and got.failure[0].value == CHEATS[name], got.failure


def test_turns_from_two_policy_versions_in_one_episode_are_caught(model: LoadedModel, renderer: ChatRenderer) -> None:
    # turn 1 by the version's weights, turn 2 by another version's (10% apart: a 3% step stays inside the tiny
    # model's TOPLOC limits, single-turn too, see `bench.attacks.UNDETECTABLE`): the environment replays fine
    # and the reward is honest for those turns; turn 2's proofs and draws are not these weights'
    other = perturbed(model, 0.10, 7)
    sub = play(model, renderer, RUN, AT, Cheat("two_policies", other=other))
    assert len(sub.tasks[0].samples[0].turns) >= 2
    got = _check(model, renderer, sub)
    assert got.failure is not None and got.failure[0] in (Reason.PROOF_MISMATCH, Reason.SAMPLING_MISMATCH), got.failure


def test_the_narrow_eos_assignment_is_still_one(model: LoadedModel) -> None:
    counter, where = NARROW_EOS
    at = Assignment(AT.node, AT.version, counter, AT.manifest_hash, AT.chain_id, AT.pool)
    assert narrow_first_eos(model, RUN, [at], above=FP32_DRIFT) == (at, where)


def test_skipping_a_mid_episode_eos_beyond_the_drift_is_termination(model: LoadedModel,
                                                                    renderer: ChatRenderer) -> None:
    counter, where = NARROW_EOS
    at = Assignment(AT.node, AT.version, counter, AT.manifest_hash, AT.chain_id, AT.pool)
    honest = play(model, renderer, RUN, at, Cheat("honest"))
    first = honest.tasks[where[0]].samples[where[1]].turns
    assert len(first) >= 2 and first[0].finish_reason == "eos"  # the EOS ends turn 1: the environment answers it
    assert _check(model, renderer, honest, at).failure is None
    sub = play(model, renderer, RUN, at, Cheat("skip_eos", at=where))
    turns = sub.tasks[where[0]].samples[where[1]].turns
    assert len(turns[0].tokens) > 1 and len(turns) >= 2
    got = _check(model, renderer, sub, at)
    assert got.failure is not None and got.failure[0] is Reason.TERMINATION, got.failure


def test_oversize_episodes_are_schema_or_refused_by_the_wire_type(model: LoadedModel, renderer: ChatRenderer) -> None:
    # a turn longer than the run's per-turn limit: the intake's cheap check (schema, before any model runs)
    sub = play(model, renderer, RUN, AT, Cheat("oversize"))
    assert len(sub.tasks[0].samples[0].turns[0].tokens) > RUN.max_new_tokens
    problem = episode_schema_problem(sub, RUN, ToplocThresholds().decode_batching_size)
    assert problem is not None and "max_new_tokens" in problem
    # too many turns or model tokens for one episode: the wire type refuses to parse it (intake: 400, no row)
    s = sub.tasks[0].samples[1]
    with pytest.raises(ValidationError):
        EpisodeRollout.model_validate({**s.model_dump(), "turns": [s.turns[0].model_dump()] * (MAX_TURNS + 1)})
    big = TurnRollout(tokens=(5,) * (MAX_TOKENS // 2 + 1), logprobs=(-1.0,) * (MAX_TOKENS // 2 + 1),
                      finish_reason="length", proofs=())
    with pytest.raises(ValidationError):
        EpisodeRollout.model_validate({**s.model_dump(), "turns": [big.model_dump(), big.model_dump()]})
    # within the wire limits but longer than the model's context: schema from the check itself
    long = TurnRollout(tokens=(5,) * (model.max_context + 8), logprobs=(-1.0,) * (model.max_context + 8),
                       finish_reason="length", proofs=())
    cheat = s.model_copy(update={"turns": (long, *s.turns[1:])})
    first = sub.tasks[0]
    honest = play(model, renderer, RUN, AT, Cheat("honest"))
    tasks = (first.model_copy(update={"samples": (honest.tasks[0].samples[0], cheat)}), *honest.tasks[1:])
    got = _check(model, renderer, honest.model_copy(update={"tasks": tasks}))
    assert got.failure is not None and got.failure[0] is Reason.SCHEMA, got.failure
