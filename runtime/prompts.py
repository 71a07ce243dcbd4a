"""A request's prompt as token ids: a conversation through the model's chat template, a
completion's text through its tokenizer (or ids as given), and where later prompts
likely branch from it (`Engine.chat_prompt`, `text_prompt`, `branch_hints`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .generation import RequestError
from .tokenizer import chat_tokens

log = logging.getLogger("cas_bank.engine")  # as the engine that asks


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Prompt ids for a conversation, through the model's chat template."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    try:
        return chat_tokens(tokenizer, messages)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"cannot render the messages: {e}", param="messages") from e


def branch_hints(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int]
) -> tuple[int, ...]:
    """Where later prompts likely leave this one: the end of its leading system
    messages (the prompt a fleet of agents shares), as a token position."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    if head == 0 or head == len(messages):
        return ()
    try:
        rendered = chat_tokens(tokenizer, messages[:head])
    except Exception:  # some templates refuse a conversation without a user turn
        log.debug("no branch hint: the template cannot render the system messages alone")
        return ()
    shared = 0  # templates may append a generation prompt: keep the common prefix
    for a, b in zip(rendered, prompt, strict=False):
        if a != b:
            break
        shared += 1
    return (shared,) if shared else ()


def text_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """Prompt ids for a completion: text through the tokenizer, or ids as given."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON)
            raise RequestError(
                f"the prompt is not valid Unicode text: {e.reason} at character {e.start}",
                param="prompt",
            ) from e
        return [int(t) for t in tokenizer.encode(prompt)]
    return [int(t) for t in prompt]
