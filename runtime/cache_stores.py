"""A `PrefixCache`'s stores: an mlx-lm cache's full blocks, boundary states and end
record checked, cut into its namespace's per-layer arrays and handed to the namespace,
queued for the bank's background writer or written inline (`PrefixCache.store`,
`store_later`, `store_end`, and the store step of `prefill`).

Queued (the default where the bank has a writer): the blocks and the end record are
checked and snapshotted on the caller's thread, then queued last, back to back
(`Namespace.store_turn_later`): the writer works while the caller goes on to its first
token. Inline (`background=False`): written before the call returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from cas_bank.bank import Bank
from cas_bank.errors import BankFullError, InvalidInputError
from cas_bank.namespace import EndOf, Namespace
from cas_bank.spec import ModelSpec
from cas_bank.write.storing import StoreReport
from cas_bank.write.writer import PendingStore

from .cache_io import cache_layers, check_cache, snapshot_states, vouch_for
from .state_recorder import StateRecorder

log = logging.getLogger("cas_bank")


class StoringCache(Protocol):
    """What a store needs of a `PrefixCache` (which meets it; a protocol, so that this
    module does not import the one that imports it)."""

    bank: Bank
    namespace: Namespace
    background: bool
    keep_end: bool
    skip_store_when_full: bool
    last_pending: PendingStore[StoreReport] | None
    last_end_pending: PendingStore[int] | None

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def block_size(self) -> int: ...

    def tokens(self, tokens: Any) -> np.ndarray: ...

    def store_end(
        self,
        tokens: Any,
        cache: Sequence[Any],
        *,
        logits: mx.array | None = None,
        hidden: mx.array | None = None,
        this_model: bool = False,
    ) -> int: ...


def store_prefill(
    pc: StoringCache,
    toks: np.ndarray,
    cache: list[Any],
    states: dict[int, list[Any]],
    last: mx.array | None,
    end: bool,
    hidden: mx.array | None = None,
) -> StoreReport | None:
    """Store what a prefill computed: queued for the background writer, or inline
    (then its report); with `end`, the end record (with the logits `last` and the
    `hidden` state) too."""
    if pc.background:
        # `toks` and `cache` were checked when the prefill began, and the cache holds
        # exactly `toks` (this model's pass wrote it): the blocks and the end record
        # are prepared once, and queued last (the writer then works while this thread
        # goes on to the first token).
        layers = cache_layers(pc.spec, cache, len(toks))
        ends = _end_of(pc, cache, last, hidden) if end else None
        pc.last_pending, queued_end = pc.namespace.store_turn_later(
            toks,
            layers,
            states,
            end=ends,
            skip_when_full=pc.skip_store_when_full,
            checked=True,
        )
        if queued_end is not None:
            pc.last_end_pending = queued_end
        return None
    report = None
    try:
        report = _store_inline(pc, toks, cache, states)
        if end:
            pc.store_end(toks, cache, logits=last, hidden=hidden)
    except BankFullError as e:
        if not pc.skip_store_when_full:
            raise
        log.warning("cas_bank: prefill not stored: %s", e)
    return report


def store(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
    *,
    end: bool | None = None,
    logits: mx.array | None = None,
    this_model: bool = False,
) -> PendingStore[StoreReport]:
    """`PrefixCache.store(tokens, cache, states, ...)` of `pc` (its docstring says what
    it does)."""
    keep = pc.keep_end if end is None else end
    toks, layers, by_boundary = _store_input(pc, tokens, cache, states, this_model)
    if pc.background:
        # The end record is checked and snapshotted before anything is queued (as a
        # prefill's): bad input queues nothing, and the writer works meanwhile.
        ends = _end_of(pc, cache, logits) if keep and _keeps_end(pc, toks, cache, logits) else None
        pending, queued_end = pc.namespace.store_turn_later(
            toks, layers, by_boundary, end=ends, skip_when_full=pc.skip_store_when_full
        )
        if queued_end is not None:
            pc.last_end_pending = queued_end
        return pending
    record = _end_for_store(pc, toks, cache, logits) if keep else None
    done: PendingStore[StoreReport] = PendingStore()
    done._set(pc.namespace.store(toks, layers, by_boundary), None)
    if record is not None:
        end_toks, end_layers, state = record
        end_done: PendingStore[int] = PendingStore()
        end_done._set(pc.namespace.store_end(end_toks, end_layers, state, logits=logits), None)
        pc.last_end_pending = end_done
    return done


def _keeps_end(
    pc: StoringCache, toks: np.ndarray, cache: Sequence[Any], logits: mx.array | None
) -> bool:
    """Whether `store` keeps an end record of `toks` from `cache` (both checked by
    `_store_input`): not where there is none worth keeping, a hybrid cache past
    `toks` (its state is not theirs), or an attention-only one ending on a block
    boundary without logits (it would hold nothing the blocks do not)."""
    n = len(toks)
    if n == 0:
        return False
    if pc.spec.is_hybrid:
        return _offset(pc.spec, cache, n) == n
    return n % pc.block_size != 0 or logits is not None


def _end_for_store(
    pc: StoringCache, toks: np.ndarray, cache: Sequence[Any], logits: mx.array | None
) -> tuple[np.ndarray, list[Any], list[Any] | None] | None:
    """The end record `store` keeps of `toks` from `cache` (`_keeps_end`), or None."""
    if not _keeps_end(pc, toks, cache, logits):
        return None
    return _end_input(pc, toks, cache, True, longer=not pc.spec.is_hybrid)


def _end_of(
    pc: StoringCache,
    cache: Sequence[Any],
    logits: mx.array | None,
    hidden: mx.array | None = None,
) -> EndOf:
    """The end record of a checked `cache` at exactly its tokens, as a queued store
    keeps it: a hybrid model's recurrent states snapshotted now (`snapshot_states`:
    taken for this record, not copied again), the last `logits`."""
    state = snapshot_states(pc.spec, cache) if pc.spec.is_hybrid else None
    return EndOf(state, logits, hidden, state_copied=True)


def _store_inline(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
    *,
    this_model: bool = False,
) -> StoreReport:
    """`store`, written on this thread now."""
    toks, layers, by_boundary = _store_input(pc, tokens, cache, states, this_model)
    return pc.namespace.store(toks, layers, by_boundary)


def _store_input(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | StateRecorder | None,
    this_model: bool,
) -> tuple[np.ndarray, list[Any], Mapping[int, Sequence[Any]] | None]:
    """A store's tokens, the cache's layers holding them and the states by boundary,
    checked: the cache must come from this PrefixCache (or `this_model=True`)."""
    toks = pc.tokens(tokens)
    check_cache(pc.spec, cache, _offset(pc.spec, cache, len(toks)))
    vouch_for(pc.spec, cache, this_model)
    if isinstance(states, StateRecorder):
        states = states.states_for(len(toks))
    return toks, cache_layers(pc.spec, cache, len(toks)), states


def store_end(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    *,
    logits: mx.array | None = None,
    hidden: mx.array | None = None,
    this_model: bool = False,
) -> int:
    """`PrefixCache.store_end(tokens, cache, ...)` of `pc` (its docstring says what it
    does)."""
    if pc.background:
        pc.last_end_pending = _end_later(
            pc, tokens, cache, logits, hidden=hidden, this_model=this_model
        )()
        return 0
    toks, layers, state = _end_input(pc, tokens, cache, this_model)
    return pc.namespace.store_end(toks, layers, state, logits=logits, hidden=hidden)


def _end_input(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    this_model: bool,
    *,
    longer: bool = False,
) -> tuple[np.ndarray, list[Any], list[Any] | None]:
    """An end record's tokens, layers and state from `cache`, checked. `longer`: an
    attention-only cache may hold more than the tokens (their KV is its first
    rows); else it must hold exactly them."""
    toks = pc.tokens(tokens)
    n = len(toks)
    if n == 0:
        raise InvalidInputError("an end record needs at least one token")
    offset = _offset(pc.spec, cache, n)
    if offset != n and not (longer and offset > n):
        raise InvalidInputError(
            f"an end record needs a cache of exactly its {n} tokens; this one holds {offset}"
        )
    check_cache(pc.spec, cache, offset)
    vouch_for(pc.spec, cache, this_model)
    layers = cache_layers(pc.spec, cache, n)
    state = snapshot_states(pc.spec, cache) if pc.spec.is_hybrid else None
    return toks, layers, state


def _end_later(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    logits: mx.array | None,
    *,
    hidden: mx.array | None = None,
    this_model: bool = False,
) -> Callable[[], PendingStore[int]]:
    """The end record checked and snapshotted now; the function returned queues it."""
    toks, layers, state = _end_input(pc, tokens, cache, this_model)
    return pc.namespace.prepare_end_later(
        toks,
        layers,
        state,
        logits=logits,
        hidden=hidden,
        skip_when_full=pc.skip_store_when_full,
        state_copied=state is not None,  # `snapshot_states` took it for this record
    )


def store_later(
    pc: StoringCache,
    tokens: Any,
    cache: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | StateRecorder | None = None,
    *,
    this_model: bool = False,
) -> PendingStore[StoreReport]:
    """`PrefixCache.store_later(tokens, cache, states, ...)` of `pc` (its docstring says
    what it does)."""
    toks, layers, by_boundary = _store_input(pc, tokens, cache, states, this_model)
    return pc.namespace.store_later(
        toks, layers, by_boundary, skip_when_full=pc.skip_store_when_full
    )


def _offset(spec: ModelSpec, cache: Any, default: int) -> int:
    """Tokens the cache's attention layers hold (they must agree)."""
    if not isinstance(cache, (list, tuple)) or len(cache) != len(spec.layers):
        check_cache(spec, cache, 0)  # raises, naming what is wrong
    offsets = {getattr(cache[i], "offset", None) for i in spec.attention_layers}
    if len(offsets) > 1:
        raise InvalidInputError(f"the cache's attention layers disagree on length: {offsets}")
    offset = offsets.pop() if offsets else default
    return offset if isinstance(offset, int) else default
