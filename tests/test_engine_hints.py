"""Branch hints: the engine tells the prefix cache where a chat's shared system prompt
ends, so the state there is captured by the first agent's prefill."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.tokenizer import ByteTokenizer, Message, chat_tokens

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 8}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine.open(tmp_path / "bank", "tiny-qwen3", block_size=16)
    try:
        yield e
    finally:
        e.close()


def test_the_hint_is_where_the_system_messages_end(engine: Engine) -> None:
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    prompt = engine.chat_prompt(messages)
    (hint,) = engine.branch_hints(messages, prompt)
    alone = chat_tokens(engine.loaded.tokenizer, [SYSTEM])
    # The shared part: the system message's rendering, less the generation prompt.
    assert prompt[:hint] == alone[:hint] and 0 < hint < len(prompt)
    assert alone[hint:] != prompt[hint : len(alone)]


def test_no_hint_without_a_leading_system_message_or_without_a_user_turn(engine: Engine) -> None:
    user_only = [{"role": "user", "content": "hello"}]
    assert engine.branch_hints(user_only, engine.chat_prompt(user_only)) == ()
    system_only = [SYSTEM]
    assert engine.branch_hints(system_only, engine.chat_prompt(system_only)) == ()


class UserTurnRequired(ByteTokenizer):
    """A chat template that, like some real ones, refuses a conversation with no user."""

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        if not any(m.get("role") == "user" for m in messages):
            raise ValueError("conversation roles must alternate user/assistant")
        return super().apply_chat_template(messages, add_generation_prompt)


def test_a_template_that_cannot_render_the_system_alone_gives_no_hint(engine: Engine) -> None:
    vocab = engine.loaded.tokenizer.vocab_size
    engine.loaded = dataclasses.replace(engine.loaded, tokenizer=UserTurnRequired(vocab))
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    assert engine.branch_hints(messages, engine.chat_prompt(messages)) == ()
