"""A byte-level tokenizer for the embedded models, and one way to talk to any tokenizer.

The embedded models (`runtime.models`) have random weights and no tokenizer files, so
they get `ByteTokenizer`: ids 0..255 are the bytes of the UTF-8 text, then a few
special tokens (BOS, EOS, chat role markers), then reserved ids up to the model's
vocabulary size. Text can never produce a special id, so a message cannot forge a
role marker.

Its chat template is append-only: the rendering of a conversation is a token prefix
of the rendering of any continuation of it, which is what lets a follow-up turn
share every earlier token (and so every stored block) with the turn before.

`chat_tokens`, `decode_tokens` and `eos_token_ids` hide the difference between this
tokenizer and mlx-lm's `TokenizerWrapper` (a Hugging Face tokenizer) from the server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

BYTE_COUNT: Final = 256
BOS_TOKEN_ID: Final = 256
EOS_TOKEN_ID: Final = 257

# Fixed ids, never renumbered: stored blocks are named by token ids, so a change here
# would silently turn every stored conversation into a miss.
SPECIAL_TOKENS: Final[Mapping[str, int]] = {
    "<|bos|>": BOS_TOKEN_ID,
    "<|eos|>": EOS_TOKEN_ID,
    "<|system|>": 258,
    "<|user|>": 259,
    "<|assistant|>": 260,
    "<|end|>": 261,
    "<|tool|>": 262,
}
END_OF_MESSAGE_ID: Final = SPECIAL_TOKENS["<|end|>"]
ROLE_TOKEN_IDS: Final[Mapping[str, int]] = {
    "system": SPECIAL_TOKENS["<|system|>"],
    "user": SPECIAL_TOKENS["<|user|>"],
    "assistant": SPECIAL_TOKENS["<|assistant|>"],
    "tool": SPECIAL_TOKENS["<|tool|>"],
}
MIN_VOCAB_SIZE: Final = BYTE_COUNT + len(SPECIAL_TOKENS)

Message: TypeAlias = Mapping[str, Any]


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus fixed special tokens and reserved ids.

    `vocab_size` is the model's vocabulary: ids from `MIN_VOCAB_SIZE` up to it are
    reserved (never produced by `encode`) and decode as `<|reserved_N|>`, so that any
    id a random-weight model samples can still be shown.
    """

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"a byte tokenizer needs a vocabulary of at least {MIN_VOCAB_SIZE} ids "
                f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
            )
        self._vocab_size = vocab_size
        self._special_names = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int:
        return BOS_TOKEN_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_TOKEN_ID

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generated reply: EOS, and the end of an assistant message."""
        return frozenset({EOS_TOKEN_ID, END_OF_MESSAGE_ID})

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`; no BOS, so `decode(encode(t)) == t`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`: bytes as UTF-8 (invalid sequences replaced), specials by name.

        Raises `ValueError` for an id outside `0..vocab_size-1`.
        """
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < BYTE_COUNT:
                pending.append(token_id)
                continue
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary (0..{self._vocab_size - 1})"
                )
            # Flush the bytes first: a multi-byte character is never split by a special.
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(self._special_names.get(token_id, f"<|reserved_{token_id}|>"))
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids for a conversation: BOS, then `<|role|> content <|end|>` per message.

        With `add_generation_prompt`, ends with `<|assistant|>`. Rendering is append-only:
        `apply_chat_template(m[:k], False)` is a prefix of `apply_chat_template(m)`, and so
        is `apply_chat_template(m[:k], True)` when `m[k]` is an assistant message.
        """
        ids = [BOS_TOKEN_ID]
        for index, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLE_TOKEN_IDS:
                raise ValueError(
                    f"message {index} has role {role!r}; known roles: {sorted(ROLE_TOKEN_IDS)}"
                )
            ids.append(ROLE_TOKEN_IDS[role])
            ids.extend(self.encode(_message_text(message, index)))
            ids.append(END_OF_MESSAGE_ID)
        if add_generation_prompt:
            ids.append(ROLE_TOKEN_IDS["assistant"])
        return ids


def _message_text(message: Message, index: int) -> str:
    """The text of a chat message: a string, a list of text parts, or None (empty)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError(f"message {index}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message {index}: content must be a string or a list of text parts")


AnyTokenizer: TypeAlias = "ByteTokenizer | TokenizerWrapper"


def chat_tokens(tokenizer: AnyTokenizer, messages: Sequence[Message]) -> list[int]:
    """The prompt token ids for `messages`, ending with the assistant's generation prompt."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # mlx-lm's wrapper forwards to a Hugging Face tokenizer, which is untyped.
    wrapper: Any = tokenizer
    if not getattr(wrapper, "has_chat_template", True):
        # The same fallback as mlx-lm's server for tokenizers without a template.
        text = "\n".join(_message_text(m, i) for i, m in enumerate(messages))
        return [int(t) for t in wrapper.encode(text)]
    rendered = wrapper.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding (a mapping) where 4.x returned the ids.
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


def decode_tokens(tokenizer: AnyTokenizer, ids: Sequence[int]) -> str:
    """Text for generated `ids` with either kind of tokenizer."""
    return str(tokenizer.decode(list(ids)))


def eos_token_ids(tokenizer: AnyTokenizer) -> frozenset[int]:
    """The ids that end generation with either kind of tokenizer."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = [tokenizer.eos_token_id]
    return frozenset(int(t) for t in ids)
