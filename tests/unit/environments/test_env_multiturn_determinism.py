"""Replayability: the same (task, env seed, model turns) give byte-identical environment messages, token
spans and reward, in this process, in another with a different hash salt, and against pinned digests.

A property test over many generated turn sequences (a fixed-seed generator: adversarial fragments,
reference turns and their mutations), not a handful of examples. Hypothesis is not a dependency here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import environments
from environments import ChatRenderer, MultiTurnEnvironment

REPO = Path(environments.__file__).resolve().parents[1]
MULTI = ["calc-arith", "alphabet-sort", "wordle"]
CASES = 60

FRAGMENTS = (
    "<calc>", "</calc>", "<names>", "</names>", "<guess>", "</guess>", "<think>", "</think>", "Answer:",
    "\\boxed{", "}", "<answer>", "12", "-7", "×", "÷", "*", "/", "(", ")", "+", " ", "\n", "Ada", "Zoe", "Eva",
    "crane", "GHOST", "é", "\u202e", "\x00", "9" * 13, "ß", "١٢", "\ud800", "((((", "1e9", "apple",
)


def _turns(env: MultiTurnEnvironment, task: environments.Task, env_seed: int, rng: random.Random) -> list[str]:
    reference = list(env.reference_episode(task, env_seed))
    n = rng.randint(1, env.max_turns)
    turns = []
    for k in range(n):
        kind = rng.randrange(3)
        if kind == 0 and k < len(reference):
            turns.append(reference[k])
        elif kind == 1 and reference:
            text = list(rng.choice(reference))
            for _ in range(rng.randint(1, 3)):
                if text:
                    del text[rng.randrange(len(text))]
            turns.append("".join(text))
        else:
            turns.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12))))
    return turns


def _corpus() -> str:
    """Every case's replay and rendered environment spans (tiny tokenizer) as canonical JSON."""
    from models.tiny_tokenizer import build_tiny_tokenizer

    renderer = ChatRenderer(build_tiny_tokenizer(512))
    out = []
    for name in MULTI:
        env = environments.get(name)
        assert isinstance(env, MultiTurnEnvironment)
        rng = random.Random(f"multiturn-determinism/{name}")
        tasks = env.sample(0xE9150DE, CASES)
        for i, task in enumerate(tasks):
            env_seed = rng.randrange(2**256)
            state = env.start(task, env_seed)
            played, spans = [], []
            ids = renderer.prompt_ids(task.messages)
            for raw in _turns(env, task, env_seed, rng):
                text = raw.encode("utf-8", "replace").decode("utf-8")  # what decoding a model's ids can give
                reply = env.step(task, state, text)
                played.append(text)
                state = reply.state
                ids += renderer.encode(text) + [renderer.eos_id]
                if reply.done:
                    break
                span = renderer.env_span(ids, reply.messages)
                spans.append(span)
                ids += span
            episode = env.replay(task, env_seed, played)
            assert episode.done == state.done and episode.reward == env.score_state(task, state)
            out.append({"env": name, "i": i, "episode": episode.model_dump(mode="json"), "spans": spans})
    return json.dumps(out, sort_keys=True, ensure_ascii=True)


SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.unit.environments.test_env_multiturn_determinism import _corpus
sys.stdout.write(_corpus())
"""

# Pinned: a change in any environment message, termination, reward or span must come with a new version.
PINNED = "bf75d00969fdb34ad2f595f1e102f408f19446509cd30fe080d9550de054cff1"


def test_replay_is_identical_in_process() -> None:
    assert _corpus() == _corpus()


def test_the_env_seed_moves_only_what_the_environment_draws_from_it() -> None:
    env = environments.get("alphabet-sort")
    assert isinstance(env, MultiTurnEnvironment)
    rng = random.Random(5)
    reordered = 0
    for task in env.sample(77, 30):
        turns = env.reference_episode(task, 0)
        a, b = env.replay(task, 1, turns), env.replay(task, 2, turns)
        assert (a.reward, a.done, a.turn_rewards) == (b.reward, b.done, b.turn_rewards)
        assert [sorted(m.content.replace(",", " ").replace(".", " ").split()) for r in a.replies for m in r] == \
            [sorted(m.content.replace(",", " ").replace(".", " ").split()) for r in b.replies for m in r]
        reordered += a.replies != b.replies
        odd = _turns(env, task, 1, rng)[:len(turns)]  # never past the end (the reference plays every turn)
        assert env.replay(task, 1, odd) == env.replay(task, 1, odd)
    assert reordered > 0  # the user's order of new names does come from the seed


def test_two_processes_with_different_hash_salts_agree_and_match_the_pin() -> None:
    here = _corpus()
    digests = {hashlib.sha256(here.encode()).hexdigest()}
    for salt in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": salt, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], env=env, capture_output=True,
                              text=True, timeout=300, cwd=str(REPO))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == here
        digests.add(hashlib.sha256(proc.stdout.encode()).hexdigest())
    assert digests == {PINNED}
