"""Rendering a task through a model's chat template (the one step that needs a tokenizer)."""

from __future__ import annotations

from typing import Any, Protocol

from protocol.errors import TaskEnvironmentError

from .task import Task


class ChatTokenizer(Protocol):
    """Anything with Hugging Face's `apply_chat_template` (a `transformers` tokenizer)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def render_prompt(tokenizer: ChatTokenizer, task: Task, *, tokenize: bool = False) -> Any:
    """The prompt text (or token ids with `tokenize=True`) that opens the assistant's turn.

    Raises `TaskEnvironmentError` when the tokenizer has no chat template (base models): callers
    must pick an instruct model or set a template; silently concatenating turns would change
    the prompt distribution between node and validator.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TaskEnvironmentError("tokenizer has no chat template; set tokenizer.chat_template first")
    return tokenizer.apply_chat_template(task.as_messages(), add_generation_prompt=True, tokenize=tokenize)
