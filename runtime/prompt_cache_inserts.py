"""What a `BankPromptCache` insert stores: the full blocks of the tokens mlx-lm's cache
holds, the end record of exactly those tokens, for a hybrid model the recurrent states
captured by prefilling the new part of the prompt again (and the end record a repeat
of the last fetched prompt restores), and a draft model's part in its own namespace
(`BankPromptCache.insert_cache`, `insert_stopped`).

Why each step is there (mlx-lm prefills on its own, so the states inside a prompt are
never seen; its sequential path inserts a prompt with its answer; a hybrid draft
model's cache cannot be trimmed) is said in `prompt_cache_adapter`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mlx_lm.models.cache import QuantizedKVCache

from cas_bank.errors import InvalidInputError
from cas_bank.write.storing import StoreReport
from cas_bank.write.writer import PendingStore

from .cache_io import check_cache_class, snapshot_states
from .draft_cache import held as tokens_held
from .prefix_cache import PrefixCache

QuantKey = tuple[int, int] | None  # (bits, group size) of quantized KV, None for plain


class InsertingCache(Protocol):
    """What an insert needs of a `BankPromptCache` (which meets it; a protocol, so that
    this module does not import the one that imports it)."""

    keep_end: bool
    _fetched: list[int] | None  # the tokens of the last fetch
    _draft: dict[QuantKey, PrefixCache] | None  # the draft model's, by KV kind

    @property
    def prefix_cache(self) -> PrefixCache: ...

    def _prefix_for(self, key: QuantKey, *, draft: bool = False) -> PrefixCache: ...

    def _count(
        self, cache_type: str, blocks: int, nbytes: int, *, end: bool = False, draft: bool = False
    ) -> None: ...

    def _count_recomputed(self, tokens: int) -> None: ...


def store_insert(
    adapter: InsertingCache,
    tokens: Sequence[int],
    cache: list[Any],
    cache_type: str,
    capture: bool,
) -> None:
    """Store what `cache` holds of `tokens` (an insert of cache type `cache_type`;
    `capture`: a hybrid model's states captured by prefilling again), each store
    counted once written."""
    for i, entry in enumerate(cache):
        check_cache_class(entry, i)  # refuses what the bank cannot hold, by name
    cache, draft = _split(adapter, cache)
    pc = adapter._prefix_for(_quant_key(cache))
    held = tokens_held(pc, cache)
    n = min(held, len(tokens))
    if draft is not None:
        _store_draft(adapter, tokens, draft, n, cache_type)
    repeat = _repeat_point(adapter, pc, tokens, n) if capture and adapter.keep_end else None
    if n >= pc.block_size or repeat is not None:
        stored = _store_blocks(adapter, pc, tokens, cache, n, held, capture, repeat, cache_type)
        for pending in stored:
            pending.when_written(
                lambda r: adapter._count(cache_type, r.blocks_written, r.bytes_written)
            )
    if n == held and n > 0 and adapter.keep_end:
        # The cache holds exactly tokens[:held]: its end record (KV of the partial
        # block, the recurrent state right there) lets a longer prompt resume here.
        _store_end(adapter, pc, tokens[:held], cache, cache_type)


def _quant_key(cache: Sequence[Any]) -> QuantKey:
    quant = next((c for c in cache if isinstance(c, QuantizedKVCache)), None)
    return None if quant is None else (quant.bits, quant.group_size)


def _split(adapter: InsertingCache, cache: list[Any]) -> tuple[list[Any], list[Any] | None]:
    """The model's caches and the draft model's (None: no draft part)."""
    if adapter._draft is None:
        return cache, None
    n, d = len(adapter.prefix_cache.spec.layers), len(adapter._draft[None].spec.layers)
    if len(cache) == n + d:
        return cache[:n], cache[n:]
    if len(cache) == n:  # the model's alone (no speculative decoding in this one)
        return cache, None
    raise InvalidInputError(
        f"a cache of {len(cache)} layers is neither the model's {n} nor the model's "
        f"and the draft model's {n} + {d}"
    )


def _store_draft(
    adapter: InsertingCache,
    tokens: Sequence[int],
    cache: list[Any],
    model_n: int,
    cache_type: str,
) -> None:
    """The draft model's part of an insert: its blocks and end record up to the tokens
    it holds; a hybrid draft model's prefilled again up to `model_n`, the tokens the
    model's part holds, so that both end there (see `prompt_cache_adapter`)."""
    pc = adapter._prefix_for(_quant_key(cache), draft=True)
    if pc.spec.is_hybrid:
        if model_n > 0:
            _prefill_draft(adapter, pc, list(tokens), model_n, cache_type)
        return
    n = min(tokens_held(pc, cache), len(tokens))
    if n == 0:
        return
    pc.last_end_pending = None
    pending = pc.store(list(tokens[:n]), cache, end=adapter.keep_end, this_model=True)
    pending.when_written(
        lambda r: adapter._count(cache_type, r.blocks_written, r.bytes_written, draft=True)
    )
    end = pc.last_end_pending
    if end is not None:
        end.when_written(lambda nbytes: adapter._count(cache_type, 0, nbytes, end=True, draft=True))


def _prefill_draft(
    adapter: InsertingCache, pc: PrefixCache, tokens: list[int], n: int, cache_type: str
) -> None:
    """A hybrid draft model's cache after speculative decoding may hold rejected draft
    tokens (mlx-lm cannot trim its recurrent state): prefill the draft model over
    the tokens of `tokens[:n]` the bank does not restore yet, and store that (blocks,
    the planned states, the end record at `n`, and, as for a hybrid model, the one
    a repeat of the last fetched prompt restores: `_repeat_point`)."""
    repeat = _repeat_point(adapter, pc, tokens, n) if adapter.keep_end else None
    if repeat is None and pc.match([*tokens[:n], 0]) >= n:
        return  # stored already
    stops = [n] if repeat is None else [repeat, n]
    cache, start = pc.restore(tokens[: stops[0] + 1])  # at most the first stop
    for stop in stops:
        if start >= stop:
            continue
        for pending in _prefill(adapter, pc, tokens[:stop], cache, start):
            pending.when_written(
                lambda r: adapter._count(cache_type, r.blocks_written, r.bytes_written, draft=True)
            )
        if adapter.keep_end:
            _store_end(adapter, pc, tokens[:stop], cache, cache_type, draft=True)
        start = stop


def _store_end(
    adapter: InsertingCache,
    pc: PrefixCache,
    tokens: Sequence[int],
    cache: list[Any],
    cache_type: str,
    *,
    draft: bool = False,
) -> None:
    """The end record of `tokens`, which `cache` holds exactly, counted once written."""
    end_bytes = pc.store_end(list(tokens), cache, this_model=True)
    end = pc.last_end_pending if pc.background else None
    if end is not None:
        end.when_written(
            lambda nbytes: adapter._count(cache_type, 0, nbytes, end=True, draft=draft)
        )
    else:
        adapter._count(cache_type, 0, end_bytes, end=True, draft=draft)


def _repeat_point(
    adapter: InsertingCache, pc: PrefixCache, tokens: Sequence[int], n: int
) -> int | None:
    """For a hybrid model: the last fetch's prompt less its last token, when the
    cache of `tokens` goes past it (mlx-lm's sequential path inserts the prompt and
    its answer) and the bank cannot yet restore that far: what a repeat of the
    prompt restores once an end record sits there (see `prompt_cache_adapter`)."""
    prompt = adapter._fetched
    if not pc.spec.is_hybrid or prompt is None or not 2 <= len(prompt) <= n:
        return None
    if list(tokens[: len(prompt)]) != prompt or pc.match(prompt) >= len(prompt) - 1:
        return None
    return len(prompt) - 1


def _store_blocks(
    adapter: InsertingCache,
    pc: PrefixCache,
    tokens: Sequence[int],
    cache: list[Any],
    n: int,
    held: int,
    capture: bool,
    repeat: int | None,
    cache_type: str,
) -> list[PendingStore[StoreReport]]:
    """Store the full blocks of `tokens[:n]` (and for a hybrid model, the states and
    the end record at `repeat`: `_repeat_point`); what each store will write."""
    states = None
    boundary = (n // pc.block_size) * pc.block_size
    stored: list[PendingStore[StoreReport]] = []
    if pc.spec.is_hybrid:
        on_boundary = n == held and n % pc.block_size == 0
        if repeat is not None or (capture and not on_boundary):
            go_on = None if on_boundary else boundary  # on a boundary: its own state
            stored = _capture(adapter, pc, tokens, go_on, repeat, cache_type)
            if go_on is not None:
                return stored
        if on_boundary:
            states = {n: snapshot_states(pc.spec, cache)}  # the cache ends on a boundary
        else:
            # The recurrent state is at `held`; without a boundary there, a hybrid
            # restore of these blocks needs the end record stored next.
            n = boundary
    # mlx-lm made this cache for the model the adapter serves (`_accepts`); its end
    # record is `store_insert`'s (counted there).
    return [*stored, pc.store(list(tokens[:n]), cache, states, end=False, this_model=True)]


def _capture(
    adapter: InsertingCache,
    pc: PrefixCache,
    tokens: Sequence[int],
    boundary: int | None,
    repeat: int | None,
    cache_type: str,
) -> list[PendingStore[StoreReport]]:
    """Prefill the tokens again from the deepest stored state: to `repeat` (and store
    the end record there), then on to `boundary`, stopping on the boundaries where
    states are due (`PrefixCache.prefill`); store it all, blocks and states of one
    computation. Runs only over what the bank does not yet cover."""
    first = repeat if repeat is not None else boundary
    assert first is not None
    cache, start = pc.restore(list(tokens[: first + 1]))  # restores at most `first`
    stored: list[PendingStore[StoreReport]] = []
    if repeat is not None and start < repeat:
        stored += _prefill(adapter, pc, tokens[:repeat], cache, start)
        _store_end(adapter, pc, tokens[:repeat], cache, cache_type)
        start = repeat
    if boundary is not None and start < boundary:
        # One token past the boundary: prefill states no boundary at its very end.
        stored += _prefill(adapter, pc, tokens[: boundary + 1], cache, start)
    return stored


def _prefill(
    adapter: InsertingCache, pc: PrefixCache, tokens: Sequence[int], cache: list[Any], start: int
) -> list[PendingStore[StoreReport]]:
    """`pc.prefill` of `tokens[start:]` into `cache`, stored; what it will write."""
    pc.last_pending = None
    pc.prefill(list(tokens), cache, start=start, end=False)  # end records: `store_insert`'s
    adapter._count_recomputed(len(tokens) - start)
    report = pc.last_prefill.stored if pc.last_prefill is not None else None
    if report is None:  # queued (or not stored: a full disk)
        return [pc.last_pending] if pc.last_pending is not None else []
    done: PendingStore[StoreReport] = PendingStore()
    done._set(report, None)
    return [done]
