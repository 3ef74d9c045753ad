"""Environment messages as tokens, appended after the model's own tokens without re-tokenizing them.

In a multi-turn episode the sequence is prompt ids, then the model's first span (the ids it sampled,
EOS included when it stopped), then an environment span, then the model's second span, and so on.
The model's spans are facts: re-encoding their decoded text can give other ids (a byte-level BPE has
many spellings of one string), which would change the context of every later token. So only the
environment's spans are rendered, from messages, by the chat template:

    renderer = ChatRenderer(tokenizer)            # refuses a template that rewrites earlier turns
    span = renderer.env_span(ids_so_far, reply.messages)
    ids_so_far += span                            # ends with the generation prompt of the next turn

`env_span` renders `[..., assistant: SENTINEL, *messages]` with the template, takes the text after the
sentinel (the scaffold that closes the assistant turn, the new messages, the generation prompt) and
encodes only that. When the model's span already ends with the template's end-of-turn token (it
stopped on EOS), that token is not repeated; when it was cut by length, the span supplies it.

This is only right for a template under which rendering a conversation turn by turn gives a prefix of
rendering it whole. `check_prefix_stable` tests exactly that against `apply_chat_template` over a whole
conversation; a template that drops earlier reasoning (Qwen3 strips past `<think>` blocks) or renders
an earlier assistant turn differently from the last one fails it with `TemplateUnstableError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from protocol.errors import TaskEnvironmentError

from .chat import ChatTokenizer
from .episode import Episode, MultiTurnEnvironment
from .task import Message, Task

SENTINEL = "PRIMEmodelTURNsentinel7f3a"
"""Stands in for the model's turn when the template renders the scaffold around it (never encoded)."""

_CONTEXT = (Message(role="system", content="s"), Message(role="user", content="u"))

PROBE = (
    Message(role="system", content="Use the tool, then answer."),
    Message(role="user", content="What is 12 × 7 - 5?"),
    Message(role="assistant", content="<think>\nmultiply first\n</think>\n<calc>12 * 7 - 5</calc>"),
    Message(role="user", content="<result>79</result>"),
    Message(role="assistant", content="Answer: 79"),
    Message(role="user", content="Now add: Zoë, Ann"),
    Message(role="assistant", content=" <names>\nAnn\nZoë\n</names>"),
)
"""A conversation in the shapes our environments produce (reasoning, a tool call, non-ASCII, a leading
space); `ChatRenderer` checks it at construction."""


class TemplateUnstableError(TaskEnvironmentError):
    """The chat template is not prefix-stable: rendering turn by turn differs from rendering whole."""

    code = "template_unstable"


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class ChatRenderer:
    """Renders environment spans for one tokenizer (one instance per tokenizer; stateless after init)."""

    def __init__(self, tokenizer: ChatTokenizer, *, check: bool = True) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TaskEnvironmentError("tokenizer has no chat template; set tokenizer.chat_template first")
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise TaskEnvironmentError("tokenizer has no single eos_token_id; the turn end is undefined")
        self.tokenizer = tokenizer
        self.eos_id = eos
        if check:
            check_prefix_stable(tokenizer, PROBE, renderer=self)

    def check_environment(self, env: MultiTurnEnvironment, n: int = 4) -> None:
        """Run `check_prefix_stable` on `env`'s reference conversations of task seeds 0..n-1 (the message
        shapes this environment produces); `TemplateUnstableError` refuses the pair before any episode."""
        for seed in range(n):
            task = env.sample(seed, 1)[0]
            check_prefix_stable(self.tokenizer, env.reference_conversation(task, seed), renderer=self)

    def encode(self, text: str) -> list[int]:
        """Text to ids with no special tokens added (special-token markup in `text` is parsed)."""
        return _ids(self.tokenizer(text, add_special_tokens=False))  # type: ignore[operator]

    def decode(self, ids: Sequence[int]) -> str:
        """A model span's text as environments read it (special tokens skipped, as the node decodes)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's ids with the generation prompt, exactly as `node.rollouts.prompt_ids` renders them."""
        return _ids(self.tokenizer.apply_chat_template(_dicts(messages), add_generation_prompt=True, tokenize=True))

    def env_span(self, ids_so_far: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """The ids to append after the model's last span so the model next speaks after `messages`.

        `ids_so_far` is the whole sequence so far and must end with a model span; only its last id is
        read (did the model stop on the template's end-of-turn token?). Never empty: an episode that is
        done has no environment span, so `messages` must not be empty either.
        """
        if not messages:
            raise TaskEnvironmentError("an environment span needs at least one message")
        if any(m.role == "assistant" for m in messages):
            raise TaskEnvironmentError("environment messages cannot speak as the assistant")
        if not ids_so_far:
            raise TaskEnvironmentError("an environment span follows a model span; the sequence is empty")
        conversation = [*_CONTEXT, Message(role="assistant", content=SENTINEL), *messages]
        text = self.tokenizer.apply_chat_template(_dicts(conversation), add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str) or text.count(SENTINEL) != 1:
            raise TemplateUnstableError("the chat template does not render an assistant turn's content verbatim")
        span = self.encode(text.split(SENTINEL, 1)[1])
        if not span:
            raise TemplateUnstableError("the chat template renders nothing after an assistant turn")
        if int(ids_so_far[-1]) == self.eos_id:
            if span[0] != self.eos_id:
                raise TemplateUnstableError(
                    "the chat template does not close an assistant turn with the tokenizer's EOS token")
            span = span[1:]
        return span


def check_prefix_stable(tokenizer: ChatTokenizer, conversation: Sequence[Message], *,
                        renderer: ChatRenderer | None = None) -> None:
    """Refuse (`TemplateUnstableError`) a template under which `conversation` rendered turn by turn is not
    what `apply_chat_template` renders for the whole of it.

    `conversation`: prompt messages, then assistant turns, each followed by the environment's messages.
    Each assistant turn stands for a model span, its content's ids plus EOS (and, checked too, without
    EOS, as when cut by length). After every environment span the incremental ids must equal the
    template's rendering of the conversation so far with the generation prompt; after the last turn they
    must be a prefix of the rendering without it.
    """
    r = renderer if renderer is not None else ChatRenderer(tokenizer, check=False)
    first = next((i for i, m in enumerate(conversation) if m.role == "assistant"), None)
    if first is None or first == 0:
        raise TaskEnvironmentError("a conversation to check needs prompt messages, then assistant turns")
    ids = r.prompt_ids(conversation[:first])
    i = first
    while i < len(conversation):
        content = r.encode(conversation[i].content)
        j = i + 1
        while j < len(conversation) and conversation[j].role != "assistant":
            j += 1
        env = conversation[i + 1:j]
        if not env:
            whole = _ids(tokenizer.apply_chat_template(
                _dicts(conversation[:j]), add_generation_prompt=False, tokenize=True))
            got = ids + content + [r.eos_id]
            if whole[:len(got)] != got:
                _refuse(got, whole, j)
            ids = got
        else:
            expected = r.prompt_ids(conversation[:j])
            by_eos = ids + content + [r.eos_id]
            by_eos += r.env_span(by_eos, env)
            by_length = ids + content
            by_length += r.env_span(by_length, env)
            for got in (by_eos, by_length):
                if got != expected:
                    _refuse(got, expected, j)
            ids = by_eos
        i = j


def _refuse(got: list[int], expected: list[int], upto: int) -> None:
    at = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
    raise TemplateUnstableError(
        f"chat template is not prefix-stable: the conversation's first {upto} messages rendered turn by turn "
        f"differ from the template's rendering at token {at} (turn by turn {len(got)} ids, whole {len(expected)})")


class RenderedEpisode(BaseModel):
    """One episode as the single token sequence a validator prefills and a trainer trains on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ids: tuple[int, ...]
    """Prompt, then model and environment spans interleaved, in order."""
    prompt_len: int
    """How many of `ids` are the prompt."""
    model_spans: tuple[tuple[int, int], ...]
    """(offset, length) of each model turn in `ids`: the only positions sampled, proven and trained on."""
    env_spans: tuple[tuple[int, int], ...]
    """(offset, length) of each environment span in `ids` (one after every model turn but a final one)."""
    episode: Episode
    """The replayed episode: turns as decoded, the environment's messages, the end and the reward."""

    def loss_mask(self) -> tuple[bool, ...]:
        """True exactly on model-span positions (the first id, a prompt id, is never one)."""
        mask = [False] * len(self.ids)
        for offset, length in self.model_spans:
            mask[offset:offset + length] = [True] * length
        return tuple(mask)


def render_episode(renderer: ChatRenderer, env: MultiTurnEnvironment, task: Task, env_seed: int,
                   model_turns: Sequence[Sequence[int]]) -> RenderedEpisode:
    """Rebuild an episode from the model's own ids per turn: decode each turn (special tokens skipped, as
    the node decodes a completion today), step the environment, append its span. The model's ids are
    kept exactly as given. A turn after the environment said done raises `TaskEnvironmentError`."""
    ids = renderer.prompt_ids(task.messages)
    prompt_len = len(ids)
    state = env.start(task, env_seed)
    model_spans: list[tuple[int, int]] = []
    env_spans: list[tuple[int, int]] = []
    texts: list[str] = []
    replies: list[tuple[Message, ...]] = []
    for turn in model_turns:
        if state.done:
            raise TaskEnvironmentError(f"{env.name}: a model turn after the episode ended")
        span = [int(t) for t in turn]
        if not span:
            raise TaskEnvironmentError("a model turn has no tokens")
        model_spans.append((len(ids), len(span)))
        ids += span
        texts.append(renderer.decode(span))
        reply = env.step(task, state, texts[-1])
        state = reply.state
        replies.append(reply.messages)
        if reply.messages:
            env_ids = renderer.env_span(ids, reply.messages)
            env_spans.append((len(ids), len(env_ids)))
            ids += env_ids
    episode = Episode(task_id=task.task_id, env_seed=env_seed, turns=tuple(texts), replies=tuple(replies),
                      done=state.done, turn_rewards=state.turn_rewards, reward=env.score_state(task, state))
    return RenderedEpisode(ids=tuple(ids), prompt_len=prompt_len, model_spans=tuple(model_spans),
                           env_spans=tuple(env_spans), episode=episode)


def reference_tokens(renderer: ChatRenderer, env: MultiTurnEnvironment, task: Task, env_seed: int) -> RenderedEpisode:
    """The reference episode as tokens (SFT warm-up): each reference turn encoded, plus EOS, as the model
    would write it; train on `loss_mask()`."""
    turns = [renderer.encode(text) + [renderer.eos_id] for text in env.reference_episode(task, env_seed)]
    return render_episode(renderer, env, task, env_seed, turns)
