"""Environment spans appended after the model's own ids, and the prefix-stability check per tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

import environments
from environments import (
    ChatRenderer,
    Message,
    MultiTurnEnvironment,
    TemplateUnstableError,
    check_prefix_stable,
)
from environments.renderer import PROBE
from models.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from protocol.errors import TaskEnvironmentError

MULTI = ["calc-arith", "alphabet-sort", "wordle"]

# Qwen3's shape: earlier assistant turns lose their reasoning, the last keeps it.
THINK_STRIPPING = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
# Renders the last message of a conversation differently from the same message once more follow.
LAST_TURN_MARKED = (
    "{% for m in messages %}<bos>{{ m['role'] }}{% if loop.last %}*{% endif %}\n{{ m['content'] }}<eos>\n"
    "{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
# Drops the content of assistant turns (a template that does not render the turn verbatim).
NO_CONTENT = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
    "<eos>\n{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)


def _tiny(template: str | None = CHAT_TEMPLATE) -> Any:
    tok = build_tiny_tokenizer(512)
    tok.chat_template = template
    return tok


def _episode_ids(renderer: ChatRenderer, env: MultiTurnEnvironment, model_spans: list[list[int]],
                 env_seed: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Prompt, then each model span and the environment's span after it; returns ids and the model spans'
    (offset, length), the shape a node and a validator both build."""
    task = env.sample(2, 1)[0]
    ids = renderer.prompt_ids(task.messages)
    state = env.start(task, env_seed)
    spans = []
    for span in model_spans:
        spans.append((len(ids), len(span)))
        ids += span
        text = renderer.tokenizer.decode(span, skip_special_tokens=True)  # type: ignore[attr-defined]
        reply = env.step(task, state, text)
        state = reply.state
        if reply.done:
            break
        ids += renderer.env_span(ids, reply.messages)
    return ids, spans


def test_tiny_tokenizer_env_span_closes_the_turn_and_opens_the_next() -> None:
    tok = _tiny()
    r = ChatRenderer(tok)  # runs the probe check
    eos, bos = tok.convert_tokens_to_ids(["<eos>", "<bos>"])
    model = r.encode("<calc>1+1</calc>")
    reply = [Message(role="user", content="<result>2</result>")]
    after_eos = r.env_span([5, *model, eos], reply)
    after_length = r.env_span([5, *model], reply)
    assert after_length == [eos, *after_eos]  # a turn cut by length gets the end-of-turn token from the span
    assert after_eos[:2] == [r.encode("\n")[0], bos]
    assert tok.decode(after_eos) == "\n<bos>user\n<result>2</result><eos>\n<bos>assistant\n"


def test_model_ids_are_never_re_encoded() -> None:
    """The environment span depends on the model's span only through its last id (EOS or not): odd ids the
    model sampled stay exactly as sampled, and the same reply renders the same span after any of them."""
    r = ChatRenderer(_tiny())
    env = environments.get("calc-arith")
    assert isinstance(env, MultiTurnEnvironment)
    reply = [Message(role="user", content="<result>2</result>")]
    spans = {tuple(r.env_span([9, *model, r.eos_id], reply)) for model in ([3], [200, 201, 0], [r.eos_id])}
    assert len(spans) == 1
    odd = [[*r.encode("<calc>2*3</calc>"), 0, 0, r.eos_id], [*r.encode("Answer: 1"), r.eos_id]]
    ids, model_at = _episode_ids(r, env, odd)
    for (offset, length), span in zip(model_at, odd, strict=True):
        assert ids[offset:offset + length] == span  # pad ids a model sampled are kept, not cleaned up


@pytest.mark.parametrize("template", [THINK_STRIPPING, LAST_TURN_MARKED, NO_CONTENT])
def test_templates_that_rewrite_earlier_turns_are_refused(template: str) -> None:
    with pytest.raises(TemplateUnstableError):
        ChatRenderer(_tiny(template))
    with pytest.raises(TemplateUnstableError):
        check_prefix_stable(_tiny(template), PROBE)
    assert issubclass(TemplateUnstableError, TaskEnvironmentError) and TemplateUnstableError.code == "template_unstable"


@pytest.mark.parametrize("name", MULTI)
def test_check_environment_refuses_a_template_for_an_environment(name: str) -> None:
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    ChatRenderer(_tiny()).check_environment(env)
    with pytest.raises(TemplateUnstableError):
        ChatRenderer(_tiny(LAST_TURN_MARKED), check=False).check_environment(env)


def test_think_stripping_passes_when_no_turn_reasons() -> None:
    """The check is per conversation: without `</think>` the stripping template happens to be stable, which
    is why `ChatRenderer` probes with a reasoning turn."""
    plain = tuple(Message(role=m.role, content=m.content.split("</think>")[-1]) for m in PROBE)
    check_prefix_stable(_tiny(THINK_STRIPPING), plain)


def test_bad_inputs_are_typed() -> None:
    r = ChatRenderer(_tiny())
    with pytest.raises(TaskEnvironmentError):
        r.env_span([1, 2], [])
    with pytest.raises(TaskEnvironmentError):
        r.env_span([], [Message(role="user", content="x")])
    with pytest.raises(TaskEnvironmentError):
        r.env_span([1], [Message(role="assistant", content="x")])
    with pytest.raises(TaskEnvironmentError):
        ChatRenderer(_tiny(None))
    with pytest.raises(TaskEnvironmentError):
        check_prefix_stable(_tiny(), [Message(role="assistant", content="x")])


@pytest.mark.parametrize("name", MULTI)
def test_reference_conversations_are_prefix_stable_on_the_tiny_tokenizer(name: str) -> None:
    tok = _tiny()
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    for i, task in enumerate(env.sample(13, 8)):
        check_prefix_stable(tok, env.reference_conversation(task, i))


@pytest.mark.parametrize("name", MULTI)
def test_reference_tokens_are_the_template_s_rendering_with_model_spans_marked(name: str) -> None:
    tok = _tiny()
    r = ChatRenderer(tok)
    env = environments.get(name)
    assert isinstance(env, MultiTurnEnvironment)
    for i, task in enumerate(env.sample(31, 5)):
        rendered = environments.reference_tokens(r, env, task, i)
        whole = tok.apply_chat_template([{"role": m.role, "content": m.content}
                                         for m in env.reference_conversation(task, i)], tokenize=True)
        whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert list(rendered.ids) == whole[:len(rendered.ids)] and len(whole) - len(rendered.ids) == 1  # "\n"
        assert rendered.episode == env.replay(task, i, env.reference_episode(task, i))
        assert rendered.episode.reward > 0.5 and rendered.episode.done
        mask = rendered.loss_mask()
        assert sum(mask) == sum(n for _, n in rendered.model_spans) and not any(mask[:rendered.prompt_len])
        assert len(rendered.model_spans) == len(rendered.env_spans) + 1
        for offset, n in rendered.model_spans:
            assert rendered.ids[offset + n - 1] == r.eos_id
        cover = sorted([*rendered.model_spans, *rendered.env_spans])  # spans tile the completion region
        assert cover[0][0] == rendered.prompt_len and cover[-1][0] + cover[-1][1] == len(rendered.ids)
        assert all(a + n == b for (a, n), (b, _) in zip(cover, cover[1:], strict=False))
        turns = [list(rendered.ids[o:o + n]) for o, n in rendered.model_spans]
        with pytest.raises(TaskEnvironmentError):
            environments.render_episode(r, env, task, i, [*turns, turns[-1]])


@pytest.mark.slow
def test_smollm2_template_is_prefix_stable_with_every_environment() -> None:
    from transformers import AutoTokenizer

    from models.smollm2 import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    r = ChatRenderer(tok)
    assert tok.convert_ids_to_tokens([r.eos_id]) == ["<|im_end|>"]
    reply = [Message(role="user", content="<result>79</result>")]
    span = r.env_span([1, 2, r.eos_id], reply)
    assert tok.decode(span) == "\n<|im_start|>user\n<result>79</result><|im_end|>\n<|im_start|>assistant\n"
    assert r.env_span([1, 2, 3], reply) == [r.eos_id, *span]
    for name in MULTI:
        env = environments.get(name)
        assert isinstance(env, MultiTurnEnvironment)
        for i, task in enumerate(env.sample(17, 6)):
            conversation = env.reference_conversation(task, i)
            check_prefix_stable(tok, conversation)
            whole = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in conversation],
                                            tokenize=True)
            whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
            ids = environments.reference_tokens(r, env, task, i).ids
            assert list(ids) == whole[:len(ids)]
            # The prompt renders exactly as the node renders a single-turn prompt today.
            rendered = environments.render_prompt(tok, task, tokenize=True)
            rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
            assert r.prompt_ids(task.messages) == [int(t) for t in rendered]
    # A model span in a non-canonical spelling (one id per piece of a word) is kept as sampled.
    pieces = [i for ch in "Answer: 79" for i in r.encode(ch)]
    assert pieces != r.encode("Answer: 79")
    env = environments.get("calc-arith")
    assert isinstance(env, MultiTurnEnvironment)
    task = env.sample(2, 1)[0]
    rendered = environments.render_episode(r, env, task, 0, [[*r.encode("<calc>7*7</calc>"), r.eos_id],
                                                             [*pieces, r.eos_id]])
    offset, length = rendered.model_spans[1]
    assert list(rendered.ids[offset:offset + length]) == [*pieces, r.eos_id]
    assert rendered.episode.turns[1] == "Answer: 79" and rendered.episode.replies[0][0].content == "<result>49</result>"
