"""`PrefixCache`: an mlx-lm model's prompt caches in and out of a cas_bank bank.

A runtime's whole integration is two calls per prompt:

    pc = PrefixCache(bank, model)                  # derives the model's spec once
    cache, n = pc.restore(tokens)                  # fresh cache + the longest stored prefix
    logits = pc.prefill(tokens, cache, start=n)    # prefill the rest, store what is new

`restore` looks up `tokens[:-1]`, so at least one token is always left to prefill
(the runtime needs its logits). `restore_exact` looks up all of `tokens` and also
returns the logits of the last one when an end record (docs/design.md, "End records")
holds them: an exact repeat of a prompt then needs no forward pass at all.
`prefill` runs the model over `tokens[start:]` in chunks that end on the grid of
`chunk_size` and on every boundary where a recurrent state must be captured, takes
a snapshot of the states there before the next forward pass (`cache_io.snapshot_states`:
new objects over them, which the pass cannot write into), and stores the new full blocks and the
states in one batch when the prompt is done.

Exact ends (the default, `keep_end=True`): `prefill` and `store` also store the end
record of their tokens: the KV of the partial last block, a hybrid model's recurrent
states at exactly that position, and the last token's logits where known. So the next
turn of a conversation (the last prompt, its answer, new tokens) restores all of the
last prompt and answer and prefills only its new tokens, on a hybrid model too. Off:
`PrefixCache(..., keep_end=False)`, or `end=False` on one call; whole blocks and
boundary states are stored either way. `store_end` stores an end record alone.

State policy for hybrid models (Gated DeltaNet layers; docs/design.md, "State capture
policy", implemented by `Namespace.plan_states` /
`cas_bank.index.chain.plan_boundaries`). A state costs as much as many blocks of KV, so
a prefill captures it only at:
  1. the deepest boundary strictly before the prompt's last token: the same prompt
     again, or its next turn, restores all of it but the tail;
  2. the branch point: the boundary where the prompt leaves the stored chain (the
     end of a shared system prompt's full blocks), so that every later prompt that
     shares that prefix restores exactly up to it;
  3. every `BankConfig.state_stride` blocks, when set;
  4. the deepest boundary at or below each of `prefill`'s `hints`: positions the
     runtime knows to be likely branch points (the server passes the end of a chat's
     system messages), so even the second agent sharing a system prompt restores it.
Boundaries at or before `start`, or that already hold a state, are skipped. A restore
never combines KV of length n with a state from another position: it stops at the
deepest matched boundary that has a state.

Decoding: `pc.store(prompt + response, cache, states=recorder)` stores the blocks a
generation produced and its end record; a `StateRecorder` (`pc.recorder(cache)`,
`observe()` after each forward pass) supplies the state at the last boundary decoding
crossed. `tokens` are the tokens that went through the model: mlx-lm's
`generate_step` has fed every token it yielded, so the cache holds prompt + response;
a loop that samples a last token and stops without feeding it stores prompt +
response[:-1] with `logits=` the ones that token was sampled from (as the engine
does): the next turn then prefills from that token on.

Throughput: by default (a bank opened with default settings has a background writer,
`BankConfig.write_behind`) stores are off the caller's thread: `prefill` and `store`
only snapshot the cache (no copy: the cache's next update copies its buffer instead)
and queue the store for the bank's writer (docs/design.md, "Background writer"), so
the first token never waits for a store; a restore (or `match`) right after sees all
of it, blocks, states and end records, from memory until they are written (the bank's
read view, docs/design.md, "Background writer"). `bank.flush()`
waits for what is queued (and raises a store that failed); `store`'s `PendingStore`
waits for its own. `PrefixCache(..., background=False)` stores inline: on the
caller's thread after the last chunk, the KV buffers sliced as zero-copy views,
encoded (the one copy to host bytes) and written in one batch before the call returns
(its share of the prefill: docs/design.md, "Where each figure is measured").
`last_prefill.store_s` against `forward_s` shows the caller's share for any model.

Spares: the bank keeps spare restore destinations (`cas_bank.restore.spares`, in its
`Bank.resources`); `restore` holds the refill it sets off
(the next restore's arrays, a shared lease's copy ahead) until `prefill` is done with
its forward pass, so that refill never runs beside the pass that the time to first
token waits for (at most `Spares.hold_s`, for a caller that prefills elsewhere).

Where the code is: the restores here; a prefill's steps in `runtime.prefill`
(`run_prefill`), the stores in `runtime.cache_stores`.

Thread safety: one PrefixCache per runtime thread; the bank itself may be shared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cas_bank.bank import Bank
from cas_bank.blocks.hashing import as_token_array, max_token
from cas_bank.errors import InvalidInputError
from cas_bank.namespace import Namespace
from cas_bank.spec import ModelSpec
from cas_bank.write.storing import StoreReport
from cas_bank.write.writer import PendingStore

from . import cache_stores
from .cache_io import fill_cache, new_cache, tag_cache
from .model_spec import probe_model, unwrap
from .models import LoadedModel
from .prefill import DEFAULT_CHUNK_SIZE, PrefillReport, exact_parts, run_prefill
from .state_recorder import StateRecorder


class PrefixCache:
    """Restore and store an mlx-lm model's prompt caches in a `Bank`.

    `model`: an mlx-lm model or a `LoadedModel`. `kv_bits` / `kv_group_size`: keep
    attention KV quantized (mlx-lm `QuantizedKVCache`) from the first token on.
    `chunk_size`: tokens per forward pass during prefill. `name`: overrides the
    spec's name (the architecture by default); it is part of the namespace. `salt`: a
    tenant's salt, part of the namespace root: the same salt shares every block,
    different salts share none (see `Bank.namespace`). `skip_store_when_full`: a
    prefill whose store finds the disk full (`BankFullError`) skips the store instead
    of raising (a server keeps answering; `bank.degraded` says why). `background`:
    where `prefill`, `store` and `store_end` write. None (the default): through the
    bank's background writer when it has one (every bank opened with default
    settings), else inline; False: always inline (written when the call returns);
    True: through the writer (inline on a bank without one). `keep_end` (default
    True): `prefill` and `store` keep their tokens' exact end, an end record (see the
    module docstring), so the next turn restores all of them; False: whole blocks and
    boundary states only, unless a call passes `end=True`. `keep_hidden` (default
    False: it costs a hidden state's bytes per record): the end records `prefill`
    writes also hold the last token's hidden state, which
    `restore_exact(..., with_hidden=True)` returns (a multi-token-prediction head
    drafts from it); refused for a model that does not expose it.
    """

    def salted(self, salt: str | bytes | None) -> PrefixCache:
        """This PrefixCache for another tenant's salt (the model is probed once)."""
        if salt == self.salt or (not salt and not self.salt):
            return self
        other = copy.copy(self)
        other.salt = salt
        other.namespace = self.bank.namespace(self.info.spec, salt=salt)
        other.last_prefill = None
        return other

    def __init__(
        self,
        bank: Bank,
        model: nn.Module | LoadedModel,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        name: str | None = None,
        salt: str | bytes | None = None,
        skip_store_when_full: bool = False,
        background: bool | None = None,
        keep_end: bool = True,
        keep_hidden: bool = False,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.bank = bank
        self.model, self.loaded = unwrap(model)
        self.info = probe_model(model, kv_bits=kv_bits, kv_group_size=kv_group_size, name=name)
        self.salt = salt
        self.namespace: Namespace = bank.namespace(self.info.spec, salt=salt)
        self.chunk_size = chunk_size
        self.skip_store_when_full = skip_store_when_full
        self.keep_end = keep_end  # prefill and store write their end record by default
        # The last token's hidden state in the end records prefill writes (for a runtime
        # whose multi-token-prediction head drafts from it): off unless asked, it costs
        # a hidden state's bytes per record.
        self.hidden_parts = exact_parts(self.model, self.new_cache) if keep_hidden else None
        if keep_hidden and self.hidden_parts is None:
            raise InvalidInputError(
                f"keep_hidden: {type(self.model).__name__} does not expose its hidden state "
                f"(an mlx-lm model's body `model.model` and its LM head, which together "
                f"give exactly the model's logits)"
            )
        # Stores go to the bank's background writer (BankConfig.write_behind > 0): the
        # prefill returns once the cache is snapshotted; `bank.flush()` waits for them.
        self.background = bank.writer is not None if background is None else background
        self.last_pending: PendingStore[StoreReport] | None = None  # the last queued store
        self.last_end_pending: PendingStore[int] | None = None  # and end record
        self.last_prefill: PrefillReport | None = None

    @property
    def spec(self) -> ModelSpec:
        return self.info.spec

    @property
    def block_size(self) -> int:
        return self.namespace.block_size

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    # -- caches --------------------------------------------------------------------
    def new_cache(self) -> list[Any]:
        """An empty prompt cache for this model (quantized KV if configured)."""
        cache = new_cache(self.model, self.info.kv_bits, self.info.kv_group_size)
        tag_cache(cache, self.spec)
        return cache

    def tokens(self, tokens: Any) -> np.ndarray:
        """`tokens` as a 1-D int array, checked against the vocabulary."""
        toks = as_token_array(tokens)
        if max_token(toks) >= self.vocab_size:
            bad = int(toks[np.argmax(toks >= self.vocab_size)])
            raise InvalidInputError(
                f"token id {bad} is beyond the vocabulary of {self.spec.name!r} "
                f"({self.vocab_size} ids)"
            )
        return toks

    # -- restore -------------------------------------------------------------------
    def match(self, tokens: Any) -> int:
        """Tokens `restore(tokens)` would cover now, without reading payloads."""
        toks = self.tokens(tokens)
        return self.namespace.match(toks[:-1]) if len(toks) > 1 else 0

    def restore(self, tokens: Any) -> tuple[list[Any], int]:
        """A fresh cache holding the longest stored prefix of `tokens[:-1]`, and its length.

        On a miss the cache is empty and the length 0.
        """
        toks = self.tokens(tokens)
        if len(toks) == 0:
            raise InvalidInputError("restore needs at least one token")
        cache = self.new_cache()
        if len(toks) < 2:
            return cache, 0
        # Room for the whole prompt: its prefill then writes in place, copying nothing.
        # The refill this sets off (`cas_bank.restore.spares`) waits for the prefill's pass.
        with self.bank.resources.holding():
            hit = self.namespace.restore(toks[:-1], room_for=len(toks))
        if hit is None:
            return cache, 0
        fill_cache(self.spec, cache, hit.layers, hit.tokens)
        return cache, hit.tokens

    @overload
    def restore_exact(
        self, tokens: Any, *, with_hidden: Literal[False] = False
    ) -> tuple[list[Any], int, mx.array | None]: ...

    @overload
    def restore_exact(
        self, tokens: Any, *, with_hidden: Literal[True]
    ) -> tuple[list[Any], int, mx.array | None, mx.array | None]: ...

    def restore_exact(
        self, tokens: Any, *, with_hidden: bool = False
    ) -> (
        tuple[list[Any], int, mx.array | None]
        | tuple[list[Any], int, mx.array | None, mx.array | None]
    ):
        """`restore` that may cover the whole prompt: `(cache, n, logits)`.

        With `logits` (an end record of exactly `tokens` that holds them), the cache
        holds all of `tokens` and `logits` are the last token's, shape `[vocab]`: sample
        from them, no prefill. Otherwise `logits` is None and `(cache, n)` is what
        `restore` returns (n < len(tokens)).

        `with_hidden`: `(cache, n, logits, hidden)`, with the last token's hidden state
        (the one the LM head reads, shape `[hidden_size]`) where the end record holds
        it: a prefill of a `PrefixCache(keep_hidden=True)` stored it, for a runtime
        whose multi-token-prediction head drafts from it. None otherwise.
        """
        cache, n, logits, hidden = self._restore_exact(tokens)
        return (cache, n, logits, hidden) if with_hidden else (cache, n, logits)

    def _restore_exact(self, tokens: Any) -> tuple[list[Any], int, mx.array | None, Any]:
        toks = self.tokens(tokens)
        if len(toks) == 0:
            raise InvalidInputError("restore needs at least one token")
        with self.bank.resources.holding():  # its refill waits for the prefill's pass
            hit = self.namespace.restore(toks, room_for=len(toks))
        if hit is not None and hit.tokens == len(toks) and hit.logits is not None:
            self.bank.resources.release()  # no pass: the first token is sampled from `logits`
            cache = self.new_cache()
            fill_cache(self.spec, cache, hit.layers, hit.tokens)
            return cache, hit.tokens, hit.logits, hit.hidden
        if hit is not None and hit.tokens == len(toks):
            # Covered, but without the last token's logits: it is prefilled again. An
            # attention-only cache is the same arrays one token short (what is past its
            # offset is room); a recurrent state cannot be cut, so that restore is redone.
            if not self.spec.is_hybrid:
                cache = self.new_cache()
                fill_cache(self.spec, cache, hit.layers, hit.tokens - 1)
                return cache, hit.tokens - 1, None, None
            cache, n = self.restore(toks)
            return cache, n, None, None
        cache = self.new_cache()
        if hit is None:
            return cache, 0, None, None
        fill_cache(self.spec, cache, hit.layers, hit.tokens)
        return cache, hit.tokens, None, None

    # -- prefill -------------------------------------------------------------------
    def prefill(
        self,
        tokens: Any,
        cache: list[Any],
        start: int = 0,
        *,
        store: bool = True,
        hints: Sequence[int] | None = (),
        this_model: bool = False,
        end: bool | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> mx.array:
        """Run `tokens[start:]` through the model into `cache`; the last position's logits.

        `cache` must hold exactly `tokens[:start]` of this model (from `restore` or
        `new_cache`). States are captured at the planned boundaries (`hints`: likely
        branch points, see the module docstring) and, with `store`
        (and a writable bank), the full blocks and states are stored. Returns the
        logits of the last token, shape `[vocab]`. Bad input raises
        `InvalidInputError` before any forward pass; nothing is stored then. With
        `end` (and `store`; None, the default: this PrefixCache's `keep_end`, True
        unless set), the end record of `tokens` is stored too, with the logits: the same
        prompt again restores with no forward pass (`restore_exact`), and a prompt that
        extends it restores all of it.
        `cancelled`: asked after every forward pass but the last; when it says True the
        prefill stops there, stores the tokens done so far so that the next attempt
        restores all of them (their full blocks, and a hybrid model's state there: on a
        boundary in the chain, else in an end record without logits) and raises
        `PrefillCancelled` (a server stops a request nobody waits for).
        """
        keep = self.keep_end if end is None else end
        try:
            return run_prefill(
                self, tokens, cache, start, store, hints, this_model, keep, cancelled
            )
        finally:  # the refill the restore held (the next restore's spares) may start
            self.bank.resources.release()

    # -- store ---------------------------------------------------------------------
    def recorder(self, cache: Sequence[Any]) -> StateRecorder:
        """A `StateRecorder` on `cache`, for storing after decoding (see its module)."""
        return StateRecorder(
            self.spec, self.block_size, cache, stride=self.bank.config.state_stride
        )

    def store(
        self,
        tokens: Any,
        cache: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
        *,
        end: bool | None = None,
        logits: mx.array | None = None,
        this_model: bool = False,
    ) -> PendingStore[StoreReport]:
        """Store the full blocks of `tokens` from `cache` (which holds at least them),
        and their exact end.

        `states`: recurrent states by boundary (per-layer lists, None for attention
        layers), or a `StateRecorder` that captured them while decoding. The cache must
        come from this PrefixCache (`new_cache`, `restore`, `prefill`); any other is
        refused unless `this_model=True` says that it holds this model's KV. Bad input
        raises here in either mode.

        `end` (None, the default: this PrefixCache's `keep_end`, True unless set): also
        store the end record of `tokens` (docs/design.md, "End records"): the KV after
        the last full block, a hybrid model's recurrent states at exactly `len(tokens)`
        and the last token's `logits` when given, so that a prompt extending `tokens`
        (the next turn) restores all of them. A hybrid cache that holds more than
        `tokens` has no state at their end: no end record then. `tokens` are the tokens
        that went through the model (see the module docstring on decoding).
        `pc.last_end_pending` is the end record's store (its bytes written).

        In the background (see the class) the store is queued and this returns at
        once; inline it is written before this returns. Either way the answer is a
        `PendingStore`: `.result()` is the `StoreReport` (it waits for the write), and
        the report's fields read through it (`pc.store(...).blocks_written`).
        """
        return cache_stores.store(
            self, tokens, cache, states, end=end, logits=logits, this_model=this_model
        )

    def store_end(
        self,
        tokens: Any,
        cache: Sequence[Any],
        *,
        logits: mx.array | None = None,
        hidden: mx.array | None = None,
        this_model: bool = False,
    ) -> int:
        """Store the end record of `tokens` (docs/design.md, "End records") from `cache`,
        which must hold exactly them: the KV of the tokens after the last full block,
        the recurrent states (hybrid models), and the `logits` of the last token (and a
        `hidden` state) when given. The full blocks must be stored already (`store`).
        Through the background writer when this PrefixCache stores in the background.
        Returns the bytes written now (0: nothing new, or queued).
        """
        return cache_stores.store_end(
            self, tokens, cache, logits=logits, hidden=hidden, this_model=this_model
        )

    def store_later(
        self,
        tokens: Any,
        cache: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
        *,
        this_model: bool = False,
    ) -> PendingStore[StoreReport]:
        """`store` through the bank's background writer (`Namespace.store_later`); the
        same checks (the cache must come from this PrefixCache, or `this_model=True`),
        and `skip_store_when_full` holds for the write."""
        return cache_stores.store_later(self, tokens, cache, states, this_model=this_model)

    def __repr__(self) -> str:
        return (
            f"PrefixCache({self.spec.name!r}, layers={len(self.spec.layers)}, "
            f"hybrid={self.spec.is_hybrid}, block_size={self.block_size})"
        )
