"""The server's `POST /v1/explain`: `cas-bank explain` for a request, as JSON.

The body names a prompt the way a completion request does: `{"messages": [...]}`
(rendered through the model's chat template) or `{"prompt": "text" | [ids]}`. The
answer is `cas_bank.explain.Explanation.as_dict()` for the ids the engine would look
up for it (the prompt less its last token), plus `prompt_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cas_bank.explain import explain

from .generation import RequestError

if TYPE_CHECKING:
    from .engine import Engine


def explain_request(engine: Engine, body: Mapping[str, Any]) -> dict[str, Any]:
    """The explanation of the prompt `body` names (a `RequestError` for a bad body)."""
    if not isinstance(body, Mapping):
        raise RequestError("the body must be a JSON object with messages or prompt")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise RequestError("messages must be a list of objects", param="messages")
        prompt = engine.chat_prompt(messages)
    elif "prompt" in body:
        raw = body["prompt"]
        if not (
            isinstance(raw, str) or (isinstance(raw, list) and all(type(t) is int for t in raw))
        ):
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
        prompt = engine.text_prompt(raw)
    else:
        raise RequestError("give messages or prompt", param="messages")
    if not prompt:
        raise RequestError("the prompt is empty", param="prompt")
    pc = engine.prefix_cache
    try:
        pc.tokens(prompt)
    except ValueError as e:  # InvalidInputError: an id beyond the vocabulary
        raise RequestError(str(e), param="prompt") from e
    result = explain(engine.bank, pc.namespace.root, prompt[:-1]).as_dict()
    result["prompt_tokens"] = len(prompt)
    return result
