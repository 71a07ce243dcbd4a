"""From logits to tokens to text: the seeded sampler and the incremental text stream.

`Sampler` is greedy by default (temperature 0). With a temperature it samples from
the (top-p filtered) distribution with its own `mx.random` key, split at every step:
the same seed gives the same tokens whatever else the process samples, which
mlx-lm's `make_sampler` (the global random state) does not promise.

`TextStream` turns generated ids into text deltas for streaming. It re-decodes the
whole generated sequence at each token (tokenizers merge pieces: a lone token's text
is not its share of the sequence's text) and holds back what is not final yet: a
trailing partial UTF-8 character (decoded as U+FFFD) and any tail that could be the
start of a stop string. The cost is O(n) per token; replies are short next to a
prefill, so this is not where time goes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from cas_bank.errors import InvalidInputError

from .tokenizer import AnyTokenizer, decode_tokens

_REPLACEMENT = "\ufffd"


class Sampler:
    """Chooses the next token from one position's logits (shape `[vocab]`).

    `logit_bias` adds to the logits of the given ids before anything else (OpenAI's
    `logit_bias`); `top_p` < 1 keeps the smallest set of tokens holding that mass.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> None:
        self.check(vocab_size, temperature=temperature, top_p=top_p, logit_bias=logit_bias)
        self.temperature = temperature
        self.top_p = top_p
        # A temperature or top_p that float32 cannot tell from 0 (below ~1e-45) keeps
        # only the most likely token: that limit is taken directly, since the float32
        # arithmetic would divide 0 by 0 (NaN logits: token 0 every time).
        self._greedy = temperature == 0 or np.float32(temperature) == 0 or np.float32(top_p) == 0
        self._bias: mx.array | None = None
        if logit_bias:
            dense = [0.0] * vocab_size
            for token_id, bias in logit_bias.items():
                dense[token_id] = float(bias)
            self._bias = mx.array(dense, dtype=mx.float32)
        self._key = mx.random.key(seed % (1 << 64))  # any int: OpenAI seeds may be negative

    @staticmethod
    def check(
        vocab_size: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> None:
        """Raise `InvalidInputError` for settings a sampler would refuse (no MLX work:
        callers on other threads than the model's may use it)."""
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidInputError(f"temperature must be a finite number >= 0, got {temperature}")
        if not 0 < top_p <= 1:  # NaN included
            raise InvalidInputError(f"top_p must be in (0, 1], got {top_p}")
        bad = sorted(i for i in (logit_bias or {}) if not 0 <= i < vocab_size)
        if bad:
            raise InvalidInputError(
                f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})"
            )

    def __call__(self, logits: mx.array) -> int:
        scores = logits.reshape(-1).astype(mx.float32)
        if self._bias is not None:
            scores = scores + self._bias
        if self._greedy:
            return int(mx.argmax(scores))
        logprobs = scores - mx.logsumexp(scores)
        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        self._key, step_key = mx.random.split(self._key)
        # Scaled from the most likely token (0) down: however small the temperature,
        # the rest go to -inf at worst, never 0 * inf.
        scaled = (logprobs - mx.max(logprobs)) / self.temperature
        token = mx.random.categorical(scaled, key=step_key)
        return int(token)


class TextStream:
    """The text of a growing list of generated ids, released as it becomes final.

    `add(token)` returns the newly final text (often "", never text that a later
    token could change or that belongs to a stop string). Once a stop string appears,
    `stopped` is True and the text ends just before it. `finish()` releases the rest.
    """

    def __init__(self, tokenizer: AnyTokenizer, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self._text = ""
        self._sent = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything decoded so far (cut before a stop string once one appeared)."""
        return self._text

    def add(self, token: int) -> str:
        if self.stopped:
            raise RuntimeError("TextStream.add after a stop string ended the text")
        self._ids.append(token)
        text = decode_tokens(self._tokenizer, self._ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._text = text[:cut]
            return self._release(len(self._text))
        self._text = text
        final = len(text)
        while final > self._sent and text[final - 1] == _REPLACEMENT:
            final -= 1
        final -= self._stop_prefix_len(text[:final])
        return self._release(final)

    def finish(self) -> str:
        """The text not yet released (held-back tails included)."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece = self._text[self._sent : end]
        self._sent = end
        return piece

    def _first_stop(self, text: str) -> int | None:
        # A stop string may straddle released text: search a little before it.
        hits = [
            i for s in self._stops if (i := text.find(s, max(0, self._sent - len(s) + 1))) != -1
        ]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """The longest tail of `text` (not yet released) that starts some stop string."""
        longest = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text) - self._sent), longest, -1):
                if s.startswith(text[len(text) - k :]):
                    longest = k
                    break
        return longest
