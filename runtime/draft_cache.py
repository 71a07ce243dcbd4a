"""A draft model's prompt cache beside its model's, for speculative decoding.

mlx-lm's speculative decoding (`speculative_generate_step`, `mlx_lm.server
--draft-model`) keeps one prompt cache list: the model's caches followed by the draft
model's. The draft continues from where the model is, so both must hold the same
tokens. Here each model keeps its caches in a namespace of its own (its own spec: its
weights digest and layout, a `PrefixCache` each) in the same bank, and a restore
gives both the same length:

    pair = DraftPrefixCache(bank, model, draft_model)
    cache, n = pair.restore(tokens)            # model's caches + draft's, both at n
    ... speculative_generate_step(tokens[n:], model, draft_model, prompt_cache=cache)
    pair.store(tokens + answer, cache)         # each side up to what it holds

A prompt restores only as far as both hold it (`restore_together`):

- An attention-only side (`KVCache`, `QuantizedKVCache`) can be trimmed: restored as
  far as it goes, then trimmed back to the other's length (exact: the trimmed rows
  are never read, the next tokens overwrite them).
- A hybrid side's recurrent state cannot be trimmed: it restores exactly only where
  a state is stored (a block boundary holding one, or an end record). "Both hold it"
  then means the deepest such point at or below what the other side holds; the
  lengths are agreed by looking first (`PrefixCache.match`, no payload read), lowering
  n until every side restores exactly there, and only then read.
- So an end record of one side that the other lacks (one stored with the model's
  answer, a draft whose cache held one token less) only lowers n to what the other
  holds; the two never disagree. A bank filled without the draft model restores
  nothing for it until its caches are stored too.

Salts (`salted`) and the store options are the two `PrefixCache`s'. `BankPromptCache`
(mlx-lm's server) uses `restore_together` with its own stores; `DraftPrefixCache` is
the same for a runtime of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from cas_bank.bank import Bank
from cas_bank.errors import InvalidInputError
from cas_bank.write.storing import StoreReport
from cas_bank.write.writer import PendingStore

from .models import LoadedModel
from .prefill import DEFAULT_CHUNK_SIZE
from .prefix_cache import PrefixCache
from .state_recorder import StateRecorder

if TYPE_CHECKING:
    # mypy cannot see `mlx.nn.Module` through the package's star imports.
    from mlx.nn.layers.base import Module

Caches = list[list[Any]]  # one mlx-lm cache list per side


def trimmable(pc: PrefixCache) -> bool:
    """Whether a restore of `pc`'s model can be trimmed (no recurrent state)."""
    return not pc.spec.is_hybrid


def agreed_length(sides: Sequence[PrefixCache], tokens: Sequence[int]) -> int:
    """The deepest n (at most `len(tokens) - 1`) that every side restores exactly now,
    by looking only (`match`: no payload read; queued stores seen)."""
    toks = list(tokens)
    n = len(toks) - 1
    if n < 1:
        return 0
    for pc in sides:
        if trimmable(pc):  # any length up to what it restores
            n = min(n, pc.match(toks))
    hybrids = [pc for pc in sides if not trimmable(pc)]
    while n > 0 and hybrids:  # only where each holds a state: lower until all agree
        m = n
        for pc in hybrids:
            m = min(m, pc.match(toks[: m + 1]))
        if m == n:
            break
        n = m
    return max(n, 0)


def restore_together(
    sides: Sequence[PrefixCache], tokens: Sequence[int]
) -> tuple[Caches, int, int]:
    """A fresh cache per side, all holding the same `n` tokens of `tokens[:-1]` (see
    the module docstring); `(caches, n, trimmed)`, `trimmed` the tokens a side restored
    past `n` and dropped. A side that restores less than it matched (evicted meanwhile)
    lowers `n` for all."""
    toks = list(tokens)
    n = agreed_length(sides, toks)
    if n == 0:
        return [pc.new_cache() for pc in sides], 0, 0
    caches: Caches = []
    got: list[int] = []
    for pc in sides:
        # Room for the whole prompt (its prefill writes in place), unless a hybrid side
        # would restore past n: then it is asked for n at most.
        whole = trimmable(pc) or n == len(toks) - 1 or pc.match(toks) == n
        cache, k = pc.restore(toks if whole else toks[: n + 1])
        caches.append(cache)
        got.append(k)
    trimmed = 0
    while True:
        n = min(n, *got)
        again = False
        for i, pc in enumerate(sides):
            if got[i] == n:
                continue
            if trimmable(pc):
                trim(pc, caches[i], got[i] - n)
                trimmed += got[i] - n
                got[i] = n
            else:
                caches[i], got[i] = (pc.new_cache(), 0) if n == 0 else pc.restore(toks[: n + 1])
                again = True
        if not again:
            return caches, n, trimmed


def trim(pc: PrefixCache, cache: Sequence[Any], k: int) -> None:
    """Drop the last `k` tokens of a trimmable cache (every layer: mlx-lm's `trim`)."""
    if not all(c.is_trimmable() and c.trim(k) == k for c in cache):
        raise InvalidInputError(f"a restored cache of {pc.spec.name!r} did not trim {k} tokens")


def held(pc: PrefixCache, cache: Sequence[Any]) -> int:
    """Tokens `cache` holds: its first attention layer's offset."""
    layers = pc.spec.attention_layers
    if not layers:
        raise InvalidInputError(f"{pc.spec.name!r} has no attention layer to read a length")
    offset = getattr(cache[layers[0]], "offset", None)
    if not isinstance(offset, int):
        raise InvalidInputError("the cache's first attention layer has no int offset")
    return offset


class DraftPrefixCache:
    """A model's `PrefixCache` and its draft model's, over one bank (see the module).

    A cache here is mlx-lm's speculative-decoding list: the model's caches, then the
    draft model's. The options are `PrefixCache`'s, for both (`name` the model's,
    `draft_name` the draft model's namespace name).
    """

    def __init__(
        self,
        bank: Bank,
        model: Module | LoadedModel,
        draft_model: Module | LoadedModel,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        name: str | None = None,
        draft_name: str | None = None,
        salt: str | bytes | None = None,
        skip_store_when_full: bool = False,
        background: bool | None = None,
        keep_end: bool = True,
    ) -> None:
        common: dict[str, Any] = dict(
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            chunk_size=chunk_size,
            salt=salt,
            skip_store_when_full=skip_store_when_full,
            background=background,
            keep_end=keep_end,
        )
        self.model = PrefixCache(bank, model, name=name, **common)
        self.draft = PrefixCache(bank, draft_model, name=draft_name, **common)
        self.last_draft_logits: mx.array | None = None  # the draft's, from `prefill`

    @classmethod
    def of(cls, model: PrefixCache, draft: PrefixCache) -> DraftPrefixCache:
        """A pair of existing `PrefixCache`s (the same bank)."""
        if model.bank is not draft.bank:
            raise InvalidInputError("a model and its draft model keep their caches in one bank")
        pair = cls.__new__(cls)
        pair.model, pair.draft, pair.last_draft_logits = model, draft, None
        return pair

    @property
    def sides(self) -> tuple[PrefixCache, PrefixCache]:
        return self.model, self.draft

    def salted(self, salt: str | bytes | None) -> DraftPrefixCache:
        """Both models' caches under another tenant's salt."""
        return DraftPrefixCache.of(self.model.salted(salt), self.draft.salted(salt))

    def new_cache(self) -> list[Any]:
        return [*self.model.new_cache(), *self.draft.new_cache()]

    def split(self, cache: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The model's caches and the draft model's (InvalidInputError: another count)."""
        n, d = len(self.model.spec.layers), len(self.draft.spec.layers)
        if not isinstance(cache, (list, tuple)) or len(cache) != n + d:
            size = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
            raise InvalidInputError(
                f"a speculative-decoding cache holds the model's {n} layers and then the "
                f"draft model's {d}; this one has {size}"
            )
        return list(cache[:n]), list(cache[n:])

    def match(self, tokens: Sequence[int]) -> int:
        """Tokens `restore(tokens)` would give both models now."""
        return agreed_length(self.sides, tokens)

    def restore(self, tokens: Sequence[int]) -> tuple[list[Any], int]:
        """Fresh caches (the model's, then the draft model's) holding the longest prefix
        of `tokens[:-1]` that both restore, and its length."""
        (model, draft), n, _ = restore_together(self.sides, tokens)
        return [*model, *draft], n

    def prefill(
        self,
        tokens: Sequence[int],
        cache: list[Any],
        start: int = 0,
        *,
        store: bool = True,
        hints: Sequence[int] | None = (),
        this_model: bool = False,
        end: bool | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> mx.array:
        """`PrefixCache.prefill` of both models from `start` (the draft model first, the
        small one): the model's last logits (`last_draft_logits`: the draft's). A
        cancel in either stops both where they are; a restore after it agrees on what
        both stored."""
        model, draft = self.split(cache)
        kw: dict[str, Any] = dict(
            store=store, hints=hints, this_model=this_model, end=end, cancelled=cancelled
        )
        self.last_draft_logits = self.draft.prefill(tokens, draft, start, **kw)
        return self.model.prefill(tokens, model, start, **kw)

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
        *,
        draft_states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
        end: bool | None = None,
        logits: mx.array | None = None,
        this_model: bool = False,
    ) -> tuple[PendingStore[StoreReport], PendingStore[StoreReport]]:
        """`PrefixCache.store` of each model's part, each up to the tokens it holds (after
        speculative decoding the draft model's may hold one token less than the
        model's); `logits` are the model's, for its end record of all of `tokens`."""
        model, draft = self.split(cache)
        toks = list(tokens)
        m, d = min(len(toks), held(self.model, model)), min(len(toks), held(self.draft, draft))
        kw: dict[str, Any] = dict(end=end, this_model=this_model)
        last = logits if m == len(toks) else None  # the logits of all of `tokens`
        return (
            self.model.store(toks[:m], model, states, logits=last, **kw),
            self.draft.store(toks[:d], draft, draft_states, **kw),
        )

    def __repr__(self) -> str:
        return f"DraftPrefixCache({self.model!r}, draft={self.draft!r})"
