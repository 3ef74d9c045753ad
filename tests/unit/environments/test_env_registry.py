"""Registry, task identity, sampling arguments and chat rendering."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import environments
from environments import Task, task_digest_ok
from protocol.errors import TaskEnvironmentError

SINGLE = ["reverse-text", "arithmetic", "math", "code", "lowercase"]
ALL = [*SINGLE, "calc-arith", "alphabet-sort", "wordle"]  # multi-turn: odd turns in test_env_multiturn.py


def test_registry_names_and_versions() -> None:
    assert environments.names() == sorted(ALL)
    for name in ALL:
        env = environments.get(name)
        assert env.name == name and env.version == environments.versions(name)[-1]
        assert environments.get(name, env.version) is env


@pytest.mark.parametrize(("name", "version"), [
    ("nope", None), ("math", "2"), ("math", ""), ("math+length-foo", None), ("math+length-max", "1"),
    ("math+length-max", "1.length9"), ("", None), (3, None), ("math", 1),
])
def test_unknown_environment_or_version_is_typed(name: object, version: object) -> None:
    with pytest.raises(TaskEnvironmentError):
        environments.get(name, version)  # type: ignore[arg-type]


def test_register_twice_is_an_error() -> None:
    with pytest.raises(TaskEnvironmentError):
        environments.register("math", "1", lambda: environments.get("math"))


@pytest.mark.parametrize("seed", [-1, 2**256, 1.5, "7", True, None])
def test_bad_seed_is_typed(seed: object) -> None:
    with pytest.raises(TaskEnvironmentError):
        environments.get("arithmetic").sample(seed, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [-1, 4097, 2.0, True])
def test_bad_count_is_typed(n: object) -> None:
    with pytest.raises(TaskEnvironmentError):
        environments.get("arithmetic").sample(1, n)  # type: ignore[arg-type]


def test_sampling_is_prefix_stable_and_seed_sensitive() -> None:
    for name in ALL:
        env = environments.get(name)
        five, ten = env.sample(42, 5), env.sample(42, 10)
        assert five == ten[:5]
        assert [t.task_id for t in env.sample(43, 5)] != [t.task_id for t in five]
        assert env.sample(2**256 - 1, 1)[0].env == name
        assert env.sample(0, 0) == []


def test_task_ids_bind_content() -> None:
    task = environments.get("arithmetic").sample(1, 1)[0]
    assert task_digest_ok(task)
    edited = task.model_copy(update={"answer": "0"})
    assert not task_digest_ok(edited)
    again = Task.model_validate_json(task.model_dump_json())
    assert again == task and task_digest_ok(again)


def test_task_from_other_env_is_refused() -> None:
    task = environments.get("arithmetic").task_from("What is 1 + 1?", "2")
    with pytest.raises(TaskEnvironmentError):
        environments.get("math").reward(task, "2")
    with pytest.raises(TaskEnvironmentError):
        environments.get("arithmetic").reward(task, b"2")  # type: ignore[arg-type]


def _tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "hello": 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = template
    return fast


def test_render_prompt_through_a_chat_template() -> None:
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    task = environments.get("reverse-text").task_from("hello", "olleh")
    text = environments.render_prompt(_tokenizer(template), task)
    assert text.startswith("<|system|>Reverse the text") and text.endswith("<|user|>hello\n<|assistant|>")
    ids = environments.render_prompt(_tokenizer(template), task, tokenize=True)
    assert 1 in list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with pytest.raises(TaskEnvironmentError):
        environments.render_prompt(_tokenizer(None), task)


@pytest.mark.parametrize("name", SINGLE)
def test_odd_text_never_crashes(name: str) -> None:
    env = environments.get(name)
    task = env.sample(3, 1)[0]
    for completion in ("\ud800 lone surrogate", "\x00" * 1000, "\u202e\u200b", "```", "<answer>", "\\boxed{"):
        assert 0.0 <= env.reward(task, completion) <= 1.0
    odd = environments.get("reverse-text").task_from("a\ud800b", "b\ud800a")
    assert task_digest_ok(odd)
