"""The server's `POST /v1/explain`: `cas-bank explain` for a request, as JSON.

The body names a prompt the way a completion request does: `{"messages": [...]}`
(rendered through the model's chat template) or `{"prompt": "text" | [ids]}`, and
optionally its `cache_salt`. The answer is `cas_bank.maintenance.explain.Explanation.as_dict()`
for the ids the engine looks up for it, as `PrefixCache.restore_exact` does: the whole
prompt when an end record of all of it holds its logits (an exact repeat), else the
prompt less its last token; plus `prompt_tokens`. It leaves out the stored block's
token and name where the prompt diverges (`stored_token`, `sibling`): any client may
ask, and those would rebuild another user's prompt a token per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cas_bank.blocks.hashing import namespace_root, salt_bytes
from cas_bank.index.tree import HeaderIndex
from cas_bank.maintenance.explain import explain

from .generation import RequestError
from .openai_types import MAX_SALT_CHARS, first_bad_text, name_problem

if TYPE_CHECKING:
    from .engine import Engine


def explain_request(engine: Engine, body: Mapping[str, Any]) -> dict[str, Any]:
    """The explanation of the prompt `body` names (a `RequestError` for a bad body)."""
    if not isinstance(body, Mapping):
        raise RequestError("the body must be a JSON object with messages or prompt")
    if (bad := first_bad_text(body)) is not None:  # before a tokenizer or a hash sees it
        raise RequestError(f"{bad[0]}: {bad[1]}", param=bad[0])
    salt = body.get("cache_salt")
    if salt is not None and (why := name_problem(salt, MAX_SALT_CHARS)) is not None:
        raise RequestError(f"cache_salt {why}", param="cache_salt")
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
    # The salted root, computed: a diagnostic records no namespace for a new salt.
    root = namespace_root(pc.spec.fingerprint, pc.block_size, salt_bytes(salt))
    index = HeaderIndex.load(engine.bank.store)  # read once for both looks
    found = explain(engine.bank, root, prompt, index)
    exact = found.end_record_tokens == len(prompt) and found.end_record_logits
    if not exact and found.restorable_tokens >= len(prompt):
        # What `restore_exact` falls back to.
        found = explain(engine.bank, root, prompt[:-1], index)
    result = found.as_dict(stored_tokens=False)  # another user's tokens stay unsaid
    result["prompt_tokens"] = len(prompt)
    return result
