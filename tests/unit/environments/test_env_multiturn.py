"""The multi-turn interface (start/step/replay) and the three environments built on it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
from pydantic import JsonValue

import environments
from environments import EpisodeState, Message, MultiTurnEnvironment, Task, episode_rng
from environments.alphabet_sort import NAMES, AlphabetSort, parse_names, similarity
from environments.calculator import MAX_CALLS, CalcError, calculate, tool_reply
from environments.wordle import WORDS, feedback, parse_guess
from protocol.errors import TaskEnvironmentError, UngradableError

MULTI = ["calc-arith", "alphabet-sort", "wordle"]


@pytest.mark.parametrize("name", MULTI)
def test_reference_episodes_end_with_full_reward(name: str) -> None:
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    for i, task in enumerate(env.sample(11, 40)):
        turns = env.reference_episode(task, i)
        episode = env.replay(task, i, turns)
        assert episode.done and 1 <= len(turns) <= env.max_turns
        assert episode.replies[-1] == () and all(episode.replies[:-1])
        if name == "wordle":  # the reward falls by 0.1 per extra guess; the reference still solves it
            assert episode.reward == pytest.approx(1.0 - 0.1 * (len(turns) - 1))
        else:
            assert episode.reward == 1.0
        conversation = env.reference_conversation(task, i)
        assert conversation[:len(task.messages)] == task.messages
        assert [m.content for m in conversation if m.role == "assistant"] == list(turns)


@pytest.mark.parametrize("name", MULTI)
def test_step_refuses_what_the_caller_got_wrong(name: str) -> None:
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    task, other = env.sample(3, 2)
    with pytest.raises(TaskEnvironmentError):
        env.start(task, -1)
    with pytest.raises(TaskEnvironmentError):
        env.start(task, True)
    with pytest.raises(TaskEnvironmentError):
        env.start(environments.get("arithmetic").sample(3, 1)[0], 0)  # another environment's task
    state = env.start(task, 5)
    with pytest.raises(TaskEnvironmentError):
        env.step(other, state, "x")  # the state belongs to another task
    with pytest.raises(TaskEnvironmentError):
        env.step(task, state, b"x")  # type: ignore[arg-type]
    with pytest.raises(TaskEnvironmentError):  # single-turn grading of a multi-turn task
        env.reward(task, "anything")
    turns = env.reference_episode(task, 5)
    with pytest.raises(TaskEnvironmentError):  # continuing after the environment said done
        env.replay(task, 5, [*turns, turns[-1]])


@pytest.mark.parametrize("name", MULTI)
def test_odd_turns_never_crash(name: str) -> None:
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    task = env.sample(3, 1)[0]
    odd = ("\ud800 lone surrogate", "\x00" * 1000, "\u202e\u200b", "<calc>", "<calc>\ud800</calc>", "<names>",
           "<guess>", "\\boxed{", "<calc>" + "(" * 5000 + "</calc>", "x" * 200_000)
    for text in odd:
        episode = env.replay(task, 0, [text])
        assert 0.0 <= episode.reward <= 1.0


@pytest.mark.parametrize("name", MULTI)
def test_max_turns_ends_the_episode_whatever_the_model_says(name: str) -> None:
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    task = env.task_from("Eva, Ada; Bo; Cy", "") if name == "alphabet-sort" else env.sample(4, 1)[0]
    stall = "<calc>1+1</calc>" if name == "calc-arith" else "I am not sure."
    state = env.start(task, 0)
    for k in range(env.max_turns):
        assert not state.done
        reply = env.step(task, state, stall)
        state = reply.state
        assert state.turn == k + 1
    assert reply.done and reply.messages == () and state.done
    with pytest.raises(TaskEnvironmentError):
        env.step(task, state, stall)
    assert env.score_state(task, state) < 0.5


def test_unfinished_episode_is_scored_not_refused() -> None:
    env = environments.get("alphabet-sort")
    assert isinstance(env, MultiTurnEnvironment)
    task = env.sample(9, 1)[0]
    first = env.reference_episode(task, 0)[:1]
    episode = env.replay(task, 0, first)
    assert not episode.done and len(episode.replies[0]) == 1
    n_turns = len(task.info["batches"])  # type: ignore[arg-type]
    assert episode.reward == pytest.approx(1.0 / n_turns)  # turns never played count 0


class _Broken(MultiTurnEnvironment):
    name = "broken-multi"
    version = "1"
    max_turns = 2

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from("q", "a")

    def task_from(self, question: str, answer: str) -> Task:
        return environments.make_task(self.name, self.version, [Message(role="user", content=question)], answer)

    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        return {}

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        raise KeyError("a bug in the environment")

    def _final_reward(self, task: Task, state: EpisodeState) -> float:
        return float("nan")

    def _reference_turns(self, task: Task, env_seed: int) -> Sequence[str]:
        return ("a",)


def test_a_failing_environment_is_ungradable_and_nan_is_zero() -> None:
    env = _Broken()
    task = env.sample(0, 1)[0]
    state = env.start(task, 0)
    with pytest.raises(UngradableError):
        env.step(task, state, "hello")
    assert env.score_state(task, state) == 0.0


class _Garbled(_Broken):
    name = "garbled-multi"

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        return [Message(role="user", content="half a character \ud800")], False, data, None


class _Silent(_Broken):
    name = "silent-multi"

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        return [], False, data, float("nan")


def test_a_message_no_tokenizer_can_encode_is_the_environment_s_failure() -> None:
    env = _Garbled()
    task = env.sample(0, 1)[0]
    with pytest.raises(UngradableError, match="invalid message"):
        env.step(task, env.start(task, 0), "hello")
    silent = _Silent()  # going on without a message would leave nothing to render before the next turn
    with pytest.raises(UngradableError, match="without saying"):
        quiet = silent.sample(0, 1)[0]
        silent.step(quiet, silent.start(quiet, 0), "x")


class _Appending(_Broken):
    name = "appending-multi"

    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        return {"seen": []}

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        data["seen"].append(text)  # type: ignore[union-attr]  # in place, on purpose
        return [Message(role="user", content=str(len(data["seen"])))], False, data, None  # type: ignore[arg-type]


def test_an_environment_changing_its_data_in_place_cannot_reach_the_earlier_state() -> None:
    env = _Appending()
    task = env.sample(0, 1)[0]
    start = env.start(task, 0)
    first = env.step(task, start, "a")
    again = env.step(task, start, "a")  # the same state replayed: the same answer
    assert start.data == {"seen": []} and first == again and first.state.data == {"seen": ["a"]}


def test_episode_streams_are_per_turn_and_seed() -> None:
    a = episode_rng("alphabet-sort", "t1", 7, 1).getrandbits(64)
    assert a == episode_rng("alphabet-sort", "t1", 7, 1).getrandbits(64)
    others = {episode_rng("alphabet-sort", "t1", 8, 1).getrandbits(64),
              episode_rng("alphabet-sort", "t1", 7, 2).getrandbits(64),
              episode_rng("alphabet-sort", "t2", 7, 1).getrandbits(64),
              episode_rng("wordle", "t1", 7, 1).getrandbits(64)}
    assert a not in others and len(others) == 4


def test_state_survives_a_json_round_trip() -> None:
    for name in MULTI:
        env = environments.get(name)
        assert isinstance(env, MultiTurnEnvironment)
        task = env.sample(21, 1)[0]
        state = env.start(task, 3)
        for text in env.reference_episode(task, 3)[:-1]:
            reply = env.step(task, state, text)
            stored = EpisodeState.model_validate_json(reply.state.model_dump_json())
            assert stored == reply.state
            state = stored


# -- calc-arith --------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "value"), [
    ("1+2*3", 7), ("(1+2)*3", 9), ("12 × 7 - 5", 79), ("84 ÷ 12", 7), ("-3 - -4", 1), ("7/3", Fraction(7, 3)),
    ("((((2))))", 2), ("  5  ", 5), ("10 - 2 - 3", 5), ("100 / 10 / 5", 2), ("+4", 4),
])
def test_calculator_values(expr: str, value: Fraction | int) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize(("expr", "why"), [
    ("", "empty"), ("1+", "end"), ("1/0", "zero"), ("(1+2", "end"), ("1)", "unexpected"), ("2**3", "unexpected"),
    ("1e9", "character"), ("__import__('os')", "character"), ("١+1", "character"), ("9" * 13, "too long"),
    ("(" * 17 + "1" + ")" * 17, "nested"), ("-" * 40 + "1", "nested"), ("1+" * 120 + "1", "too long"),
    ("*".join(["999999999999"] * 4), "too large"),
])
def test_calculator_refuses_with_a_reason(expr: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        calculate(expr)
    assert tool_reply(expr).startswith("<error>")


def test_calc_arith_plays_like_the_brief_says() -> None:
    env = environments.get("calc-arith")
    assert isinstance(env, MultiTurnEnvironment)
    task = env.task_from("What is 12 × 7 - 5?", "79")
    assert task.info["expression"] == "12 × 7 - 5"
    state = env.start(task, 0)
    reply = env.step(task, state, "<think>use the tool</think>Let me check. <calc>12*7-5</calc> <calc>1</calc>")
    assert [m.content for m in reply.messages] == ["<result>79</result>"] and not reply.done
    assert [m.role for m in reply.messages] == ["user"]
    reply2 = env.step(task, reply.state, "<calc>12*7</calc>")
    assert [m.content for m in reply2.messages] == ["<result>84</result>"]
    wrong = env.step(task, reply2.state, "<calc>1</calc>")  # a third call: the last turn, unanswered
    assert wrong.done and env.score_state(task, wrong.state) == 0.0
    assert env.episode_reward(task, 0, ["Answer: 79"]) == 1.0  # no tool needed
    assert env.episode_reward(task, 0, ["Answer: 80"]) == 0.0
    assert env.episode_reward(task, 0, ["<calc>2+</calc>", "\\boxed{79}"]) == 1.0
    # a call inside the reasoning does not count: that turn is an answer
    assert env.episode_reward(task, 0, ["<calc>12*7-5</calc></think>Answer: 79"]) == 1.0
    assert env.max_turns == MAX_CALLS + 1


def test_calc_arith_asks_arithmetic_s_questions() -> None:
    calc = environments.get("calc-arith")
    for c in calc.sample(5, 50):
        assert c.question() == f"What is {c.info['expression']}?"
        assert calculate(str(c.info["expression"])) == Fraction(c.answer)  # the tool agrees with the answer


# -- alphabet-sort -----------------------------------------------------------------------------


def test_alphabet_sort_names_and_scoring() -> None:
    assert len(set(NAMES)) == len(NAMES) and all(n.isascii() and n.isalpha() for n in NAMES)
    assert parse_names("<names>\n Bo \n\nAl,\n</names>") == ["Bo", "Al"]
    assert parse_names("</think>no tags") == []
    assert similarity(["Al", "Bo"], ["Al", "Bo"]) == 1.0
    assert similarity(["Bo", "Al"], ["Al", "Bo"]) == 0.5
    assert similarity([], ["Al"]) == 0.0


def test_alphabet_sort_dense_reward_and_scripted_user() -> None:
    env = AlphabetSort()
    task = env.task_from("Eva, Ada, Cy; Bo; Dan, Al", "")
    assert task.answer == "Ada\nAl\nBo\nCy\nDan\nEva"
    perfect = ["<names>\nAda\nCy\nEva\n</names>", "<names>\nAda\nBo\nCy\nEva\n</names>",
               "<names>\nAda\nAl\nBo\nCy\nDan\nEva\n</names>"]
    episode = env.replay(task, 1, perfect)
    assert episode.reward == 1.0 and episode.turn_rewards == (1.0, 1.0, 1.0)
    assert episode.replies[0][0].content == "Now add this name: Bo. Reply with the whole list, sorted."
    added = {env.replay(task, s, perfect).replies[1][0].content for s in range(20)}
    assert added == {"Now add these names: Dan, Al. Reply with the whole list, sorted.",
                     "Now add these names: Al, Dan. Reply with the whole list, sorted."}  # order from the seed
    swapped = env.replay(task, 1, [perfect[0], "<names>\nBo\nAda\nCy\nEva\n</names>", perfect[2]])
    assert swapped.turn_rewards[1] == pytest.approx(0.75 ** 4)
    assert swapped.reward == pytest.approx((2 + 0.75 ** 4) / 3)
    with pytest.raises(TaskEnvironmentError):
        env.task_from("a;b;c;d", "")


# -- wordle ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("guess", "word", "marks"), [
    ("crane", "crane", "GGGGG"), ("apple", "paper", "YYGXY"), ("eerie", "there", "YXYXG"),
    ("llama", "hello", "YYXXX"), ("zzzzz", "crane", "XXXXX"), ("sheep", "sleep", "GXGGG"),
])
def test_wordle_feedback_handles_duplicates(guess: str, word: str, marks: str) -> None:
    assert feedback(guess, word) == marks


def test_wordle_rewards_and_parsing() -> None:
    env = environments.get("wordle")
    assert isinstance(env, MultiTurnEnvironment)
    assert len(set(WORDS)) == len(WORDS) and all(len(w) == 5 and w.isalpha() and w.islower() for w in WORDS)
    assert parse_guess("<think><guess>xx</guess></think> <guess> CRANE </guess>") == "crane"
    assert parse_guess("<guess>cran</guess>") is None and parse_guess("<guess>crâne</guess>") is None
    task = env.task_from("Guess the word.", "crane")
    assert "crane" not in " ".join(m.content for m in task.messages)
    assert env.episode_reward(task, 0, ["<guess>crane</guess>"]) == 1.0
    episode = env.replay(task, 0, ["<guess>trace</guess>", "<guess>crane</guess>"])
    assert episode.replies[0][0].content == "TRACE: X G G Y G. 5 guesses left."
    assert episode.reward == pytest.approx(0.9)
    miss = env.replay(task, 0, ["nonsense", *(["<guess>trace</guess>"] * 5)])
    assert miss.done and miss.replies[0][0].content.startswith("Invalid guess")
    assert miss.reward == pytest.approx(0.5 * (3 + 0.5) / 5)
    for word in WORDS:  # the reference solver needs at most five guesses on every listed word
        assert len(env.reference_episode(env.task_from("Guess the word.", word), 0)) <= 5
