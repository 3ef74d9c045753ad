"""Supervised examples: (prompt, completion) conversations rendered through the chat template.

Sources (`data.type`):

- `file`: JSONL (one JSON object per line; blank lines skipped) or Parquet (one row per example), in one
  of the common layouts:
  `{"messages": [{"role": ..., "content": ...}, ...]}` (the last message is the assistant's completion,
  everything before it the prompt), or `{"prompt": ..., "completion": ...}` where each is a string (a
  user turn / an assistant turn) or a list of messages. Anything else is refused with an
  `SFTDataError` naming the file and the line (JSONL) or row (Parquet, counted from 1).
- `environment`: task seed s in `[seed_start, seed_start + num_examples)` is `env.sample(s, 1)[0]`;
  the prompt is the task's messages and the completion `env.reference_completion(task)`. A multi-turn
  environment (`calc-arith`, `alphabet-sort`, `wordle`) gives its reference episode instead, played with the
  environment seed `held_out_env_seed(s)`: the whole interleaved sequence as the network renders it
  (`environments.reference_tokens`: the model's turns, each ending in EOS, and the environment's replies
  appended as tokens), the loss on the model's turns only.

Tokens: the prompt is the chat template with the generation prompt (exactly what `render_prompt` gives
the node at RL time), the completion is what the template adds for the assistant's turn, cut after its
last end-of-turn token (tokens after it are never generated). The loss mask is True on completion
tokens only.

Order: epoch e visits the examples in a permutation seeded by (seed, e); step n takes the examples at
positions `n * B .. n * B + B - 1` of the concatenated epochs. The position is a function of the step,
so resuming needs only the step and a fingerprint of the data (a resumed run on other data is refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import TaskEnvironmentError, TrainerError
from trainer.config import EnvironmentSFTData, FileSFTData

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
MAX_LINE_BYTES = 16 << 20
"""A JSONL line longer than this is refused (a bound on what one example may allocate)."""


class SFTDataError(TrainerError):
    """A supervised data file (or environment) cannot give examples: unreadable, malformed, or empty."""

    code = "sft_data"


Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Conversation:
    """Prompt turns and the completion's turns (assistant), plus where it came from (for error messages)."""

    prompt: Messages
    completion: Messages
    where: str


@dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    where: str

    @property
    def n_loss_tokens(self) -> int:
        return sum(self.loss_mask)


# ------------------------------------------------------------------------------------ conversations
def _messages(value: Any, what: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise ValueError(f"`{what}` must be a non-empty list of messages")
    out: Messages = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise ValueError(f"`{what}[{k}]` must be an object with `role` and `content` only")
        if m["role"] not in ROLES:
            raise ValueError(f"`{what}[{k}].role` must be one of {ROLES}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"`{what}[{k}].content` must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _turns(value: Any, what: str, role: str) -> Messages:
    return [{"role": role, "content": value}] if isinstance(value, str) else _messages(value, what)


def conversation_from(record: Any, where: str) -> Conversation:
    """One record in either layout (see the module docstring); `SFTDataError` naming `where` otherwise."""
    try:
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        if "messages" in record:
            extra = set(record) - {"messages"}
            if extra:
                raise ValueError(f"unexpected keys {sorted(extra)} beside `messages`")
            msgs = _messages(record["messages"], "messages")
            if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
                raise ValueError("`messages` must end with an assistant message after at least one prompt message")
            prompt, completion = msgs[:-1], msgs[-1:]
        elif "prompt" in record and "completion" in record:
            extra = set(record) - {"prompt", "completion"}
            if extra:
                raise ValueError(f"unexpected keys {sorted(extra)} beside `prompt` and `completion`")
            prompt = _turns(record["prompt"], "prompt", "user")
            completion = _turns(record["completion"], "completion", "assistant")
            if any(m["role"] != "assistant" for m in completion):
                raise ValueError("`completion` messages must all be assistant messages")
            if prompt[-1]["role"] == "assistant":
                raise ValueError("`prompt` must not end with an assistant message")
        else:
            raise ValueError(f"expected `messages`, or `prompt` and `completion`; got keys {sorted(record)}")
    except ValueError as exc:
        raise SFTDataError(f"{where}: {exc}") from exc
    return Conversation(prompt, completion, where)


def _jsonl_records(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise SFTDataError(f"{path}: cannot read: {exc}") from exc
    with fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path} line {lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise SFTDataError(f"{where}: longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                yield json.loads(raw), where
            except (ValueError, UnicodeDecodeError) as exc:
                raise SFTDataError(f"{where}: not valid JSON: {exc}") from exc


def _parquet_records(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise SFTDataError(f"{path}: not a readable Parquet file: {exc}") from exc
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield record, f"{path} row {row}"
    except pa.ArrowException as exc:
        raise SFTDataError(f"{path}: unreadable after row {row}: {exc}") from exc


def read_conversations(path: Path, fmt: str = "auto") -> list[Conversation]:
    """Every conversation in a JSONL or Parquet file, or `SFTDataError` at the first bad one."""
    path = Path(path)
    if fmt == "auto":
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            fmt = "jsonl"
        elif suffix in (".parquet", ".pq"):
            fmt = "parquet"
        else:
            raise SFTDataError(f"{path}: cannot tell the format from the suffix {suffix!r}; set data.format")
    if not path.is_file():
        raise SFTDataError(f"{path}: no such file")
    records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)
    out = [conversation_from(rec, where) for rec, where in records]
    if not out:
        raise SFTDataError(f"{path}: no examples")
    return out


def environment_conversations(env_name: str, env_version: str | None, seed_start: int, count: int) -> list[Conversation]:
    """Task seeds `seed_start ..` with the environment's reference completions."""
    from environments import get as get_env

    env = get_env(env_name, env_version)
    out = []
    for seed, task in enumerate(seed_range_tasks(env, seed_start, count), seed_start):
        try:
            answer = env.reference_completion(task)
        except TaskEnvironmentError as exc:
            raise SFTDataError(f"data.env = {env_name!r}: {exc}") from exc
        out.append(Conversation(task.as_messages(), [{"role": "assistant", "content": answer}],
                                f"{env_name} task seed {seed}"))
    return out


def environment_episodes(env: Any, tokenizer: Any, seed_start: int, count: int) -> list[Example]:
    """Task seeds `seed_start ..` of a multi-turn environment as reference episodes, tokens and loss mask."""
    from environments import ChatRenderer, reference_tokens

    try:
        renderer = ChatRenderer(tokenizer)
        renderer.check_environment(env)  # a template that rewrites earlier turns cannot render an episode
    except TaskEnvironmentError as exc:
        raise SFTDataError(f"data.env = {env.name!r}: {exc}") from exc
    out = []
    for seed, task in enumerate(seed_range_tasks(env, seed_start, count), seed_start):
        try:
            rendered = reference_tokens(renderer, env, task, held_out_env_seed(seed))
        except TaskEnvironmentError as exc:
            raise SFTDataError(f"data.env = {env.name!r}, task seed {seed}: {exc}") from exc
        out.append(Example(rendered.ids, rendered.loss_mask(),
                           f"{env.name} task seed {seed} (reference episode, {len(rendered.model_spans)} turns)"))
    return out


def held_out_env_seed(task_seed: int) -> int:
    """The environment seed of task seed s off the network (SFT reference episodes, held-out evaluation): a
    function of s alone, so a task plays the same every time it is scored (the network's come from work keys)."""
    from trainer.local import derive_seed

    return derive_seed("env", "task seed", task_seed)


def seed_range_tasks(env: Any, seed_start: int, count: int) -> list[Any]:
    """Task seed s (for s in the range) is `env.sample(s, 1)[0]`: one task per seed, so ranges of seeds
    are ranges of tasks (SFT data, evaluation sets) that never overlap when the ranges do not."""
    return [env.sample(s, 1)[0] for s in range(seed_start, seed_start + count)]


# ------------------------------------------------------------------------------------------ tokens
def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def tokenize(tokenizer: Any, conv: Conversation, eos_ids: Sequence[int]) -> Example:
    """Prompt + completion tokens through the chat template; the loss mask covers the completion only."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError("the tokenizer has no chat template; SFT renders conversations through it")
    try:
        prompt = _ids(tokenizer.apply_chat_template(conv.prompt, add_generation_prompt=True, tokenize=True))
        full = _ids(tokenizer.apply_chat_template(conv.prompt + conv.completion, tokenize=True))
    except Exception as exc:  # noqa: BLE001 - a template error (jinja raise_exception) names the example
        raise SFTDataError(f"{conv.where}: the chat template refused it: {exc}") from exc
    if full[: len(prompt)] != prompt:
        raise SFTDataError(f"{conv.where}: the chat template renders the prompt differently inside the full "
                           "conversation, so the completion's tokens cannot be told apart")
    completion = full[len(prompt):]
    eos = set(eos_ids)
    ends = [i for i, t in enumerate(completion) if t in eos]
    if ends:  # what follows the last end-of-turn token (a newline) is never generated: not trained on
        completion = completion[: ends[-1] + 1]
    if not completion:
        raise SFTDataError(f"{conv.where}: empty completion")
    return Example(tuple(prompt) + tuple(completion), (False,) * len(prompt) + (True,) * len(completion), conv.where)


def fingerprint(examples: Sequence[Example]) -> str:
    """blake2b-128 over every example's tokens and mask: a resumed run must see the same data."""
    h = hashlib.blake2b(digest_size=16)
    for ex in examples:
        h.update(len(ex.tokens).to_bytes(4, "big"))
        h.update(b"".join(t.to_bytes(4, "big") for t in ex.tokens))
        h.update(bytes(ex.loss_mask))
    return h.hexdigest()


class SFTDataset:
    """The examples and their order (see the module docstring); its position goes into checkpoints."""

    def __init__(self, examples: Sequence[Example], shuffle: bool = True, seed: int = 0) -> None:
        if not examples:
            raise SFTDataError("no examples to train on")
        self.examples = list(examples)
        self.shuffle = shuffle
        self.seed = seed
        self.fingerprint = fingerprint(self.examples)
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.examples)))
            if self.shuffle:
                from trainer.local import derive_seed

                random.Random(derive_seed("sft-order", self.seed, epoch)).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is enough for a forward-moving loop
        return order

    def batch(self, step: int, size: int) -> list[Example]:
        """The examples of `step` (`size` of them, wrapping into the next epoch as needed)."""
        n = len(self.examples)
        out = []
        for pos in range(step * size, (step + 1) * size):
            out.append(self.examples[self._order(pos // n)[pos % n]])
        return out

    def epoch(self, step: int, size: int) -> float:
        """Epochs completed after `step` (fractional)."""
        return (step + 1) * size / len(self.examples)

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "examples": len(self.examples), "shuffle": self.shuffle,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise TrainerError(f"the checkpoint was trained on other SFT data ({state.get('examples')} examples, "
                               f"fingerprint {state.get('fingerprint')}); this run has {len(self.examples)} "
                               f"examples, fingerprint {self.fingerprint}: use a fresh checkpoint.dir")
        if state.get("shuffle") != self.shuffle or state.get("seed") != self.seed:
            raise TrainerError("the checkpoint used another example order (data.shuffle or seed changed)")


def build_dataset(data: FileSFTData | EnvironmentSFTData, tokenizer: Any, eos_ids: Sequence[int], seq_len: int,
                  seed: int) -> SFTDataset:
    """Read, tokenize and filter the configured examples (those longer than `seq_len` are left out, logged)."""
    from environments import MultiTurnEnvironment
    from environments import get as get_env

    if isinstance(data, FileSFTData):
        examples = [tokenize(tokenizer, c, eos_ids) for c in read_conversations(data.path, data.format)]
    elif isinstance(env := get_env(data.env, data.env_version), MultiTurnEnvironment):
        examples = environment_episodes(env, tokenizer, data.seed_start, data.num_examples)
    else:
        examples = [tokenize(tokenizer, c, eos_ids)
                    for c in environment_conversations(data.env, data.env_version, data.seed_start, data.num_examples)]
    fit = [ex for ex in examples if len(ex.tokens) <= seq_len]
    if len(fit) < len(examples):
        first = next(ex for ex in examples if len(ex.tokens) > seq_len)
        log.warning("%d of %d examples are longer than batch.seq_len = %d and are left out (first: %s, %d tokens)",
                    len(examples) - len(fit), len(examples), seq_len, first.where, len(first.tokens))
    if not fit:
        raise SFTDataError(f"every example is longer than batch.seq_len = {seq_len}")
    log.info("SFT data: %d examples, %d tokens (%d on completions)", len(fit), sum(len(e.tokens) for e in fit),
             sum(e.n_loss_tokens for e in fit))
    return SFTDataset(fit, data.shuffle, seed)
