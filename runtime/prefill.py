"""A prefill (`PrefixCache.prefill`): its start checked against the cache, the states
it captures planned, where its chunks end, the forward passes themselves with the
states they capture, its store (`cache_stores.store_prefill`), and what it reports (or
raises when cancelled).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cas_bank.errors import InvalidInputError
from cas_bank.spec import ModelSpec
from cas_bank.write.storing import StoreReport

from .cache_io import check_cache, snapshot_states, tag_cache, vouch_for
from .cache_stores import StoringCache, store_prefill

DEFAULT_CHUNK_SIZE = 512


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """What the last `prefill` did (`PrefixCache.last_prefill`)."""

    start: int
    tokens: int
    chunk_ends: list[int]  # absolute end of every forward pass, ascending
    captured: list[int]  # boundaries whose states were captured
    forward_s: float  # wall time of the forward passes (evaluated)
    store_s: float  # wall time of the store (0 when not stored)
    stored: StoreReport | None = field(default=None, repr=False)


class PrefillCancelled(Exception):
    """`prefill` stopped early because its `cancelled` callback said so. `tokens`: how
    many went through the model; stored so that the next attempt restores all of them
    (`resume_point`)."""

    def __init__(self, tokens: int, total: int) -> None:
        super().__init__(f"prefill cancelled after {tokens} of {total} tokens")
        self.tokens = tokens
        self.total = total


def chunk_ends(n_tokens: int, start: int, chunk_size: int, boundaries: Sequence[int]) -> list[int]:
    """Ends of the forward passes over tokens[start:n_tokens]: the multiples of
    `chunk_size` (counted from token 0, so a restored prefill keeps the grid of the
    prefill that stored it), the capture boundaries, and the end."""
    ends = set(range((start // chunk_size + 1) * chunk_size, n_tokens, chunk_size))
    ends.update(b for b in boundaries if start < b < n_tokens)
    ends.add(n_tokens)
    return sorted(ends)


def resume_point(
    spec: ModelSpec,
    block_size: int,
    cache: list[Any],
    pos: int,
    states: dict[int, list[Any]],
) -> bool:
    """What a prefill cancelled at `pos` (its cache holds exactly the `pos` tokens it
    finished) stores besides its full blocks, so that the next attempt restores all
    `pos`: on a block boundary, a hybrid model's recurrent state there (added to
    `states`); between two, an end record of the `pos` tokens (the KV after the last
    full block and, hybrid, the state at `pos`). Returns whether the end record is due.
    A state lives only on a boundary or in an end record (`cas_bank.index.chain`,
    `cas_bank.index.ends`)."""
    if pos % block_size:
        return True
    if spec.is_hybrid and pos not in states:
        states[pos] = snapshot_states(spec, cache)
    return False


Body = Callable[[mx.array, list[Any]], mx.array]
Head = Callable[[mx.array], mx.array]


def hidden_parts(model: nn.Module) -> tuple[Body, Head] | None:
    """The model's body (tokens -> the hidden state its LM head reads, after the final
    norm: what a multi-token-prediction head drafts from) and its head, where it
    exposes them as mlx-lm's models do (`model.model`, then `lm_head` or the tied
    embeddings; a multimodal model's `language_model`); None where it does not. `head(
    body(x, cache))` is the model's own `model(x, cache)`, the same operations."""
    inner = getattr(model, "language_model", model)
    body, args = getattr(inner, "model", None), getattr(inner, "args", None)
    if not isinstance(body, nn.Module) or args is None:
        return None
    if getattr(args, "tie_word_embeddings", False):
        embed = getattr(body, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    else:
        head = getattr(inner, "lm_head", None)
    if head is None:
        return None
    return (lambda x, cache: body(x, cache)), head


def exact_parts(model: nn.Module, make_cache: Callable[[], list[Any]]) -> tuple[Body, Head] | None:
    """`hidden_parts`, where `head(body(x))` is bit for bit the model's own `model(x)`
    on a two-token probe; None otherwise (a model that scales or caps its logits after
    the head, as granite, minicpm or gemma2 do in mlx-lm)."""
    parts = hidden_parts(model)
    if parts is None:
        return None
    x = mx.array([[1, 2]])
    whole = model(x, cache=make_cache())
    split = parts[1](parts[0](x, make_cache()))
    same = whole.shape == split.shape and bool(mx.array_equal(whole, split).item())
    return parts if same else None


def forward_chunks(
    model: nn.Module,
    spec: ModelSpec,
    toks: np.ndarray,
    cache: list[Any],
    start: int,
    ends: Sequence[int],
    boundaries: Sequence[int],
    cancelled: Callable[[], bool] | None,
    parts: tuple[Body, Head] | None = None,
) -> tuple[dict[int, list[Any]], mx.array, int, mx.array | None]:
    """The forward passes of `model` over `toks[start:]` into `cache`, one chunk to each
    of `ends`: the states snapshotted at `boundaries`, the last chunk's logits, where
    it stopped (before the end when `cancelled` said so) and, with `parts`
    (`hidden_parts`), the last token's hidden state (its last pass through them)."""
    states: dict[int, list[Any]] = {}
    logits: mx.array | None = None
    hidden: mx.array | None = None
    pos, n = start, len(toks)
    for stop in ends:
        x = mx.array(toks[pos:stop])[None]
        if parts is not None and stop == ends[-1]:
            h = parts[0](x, cache)
            logits, hidden = parts[1](h), h[0, -1]
        else:
            logits = model(x, cache=cache)
        if stop in boundaries:
            states[stop] = snapshot_states(spec, cache)  # evaluates the chunk
        else:
            mx.eval([c.state for c in cache])
        pos = stop
        if pos < n and cancelled is not None and cancelled():
            break
    assert logits is not None
    return states, logits, pos, hidden if pos == n else None


class PrefillingCache(StoringCache, Protocol):
    """What a prefill needs of a `PrefixCache` (which meets it; a protocol, so that
    this module does not import the one that imports it)."""

    model: nn.Module
    chunk_size: int
    hidden_parts: tuple[Body, Head] | None
    last_prefill: PrefillReport | None


def run_prefill(
    pc: PrefillingCache,
    tokens: Any,
    cache: list[Any],
    start: int,
    store: bool,
    hints: Sequence[int] | None,
    this_model: bool,
    end: bool,
    cancelled: Callable[[], bool] | None,
) -> mx.array:
    """`PrefixCache.prefill`'s work (it releases the held refill whatever happens
    here; its docstring says what a prefill does)."""
    toks = pc.tokens(tokens)
    start = _prefill_start(pc, toks, cache, start, this_model)
    boundaries = pc.namespace.plan_states(toks, start, hints=hints) if pc.spec.is_hybrid else []
    ends = chunk_ends(len(toks), start, pc.chunk_size, boundaries)
    t0 = time.perf_counter()
    parts = pc.hidden_parts if store and end else None
    states, logits, pos, hidden = forward_chunks(
        pc.model, pc.spec, toks, cache, start, ends, boundaries, cancelled, parts
    )
    total = len(toks)
    last = logits[0, -1]
    mx.eval(last)
    kept: mx.array | None = last
    if pos < total:  # cancelled: stored so that the next attempt resumes at `pos`
        toks, ends, kept = toks[:pos], ends[: ends.index(pos) + 1], None
        end = resume_point(pc.spec, pc.block_size, cache, pos, states)
    t1 = time.perf_counter()
    storing = store and not pc.bank.read_only
    report = store_prefill(pc, toks, cache, states, kept, end, hidden) if storing else None
    pc.last_prefill = PrefillReport(
        start=start,
        tokens=len(toks),
        chunk_ends=ends,
        captured=sorted(states),
        forward_s=t1 - t0,
        store_s=time.perf_counter() - t1 if storing else 0.0,
        stored=report,
    )
    if len(toks) < total:
        raise PrefillCancelled(len(toks), total)
    return last


def _prefill_start(
    pc: PrefillingCache, toks: np.ndarray, cache: list[Any], start: Any, this_model: bool
) -> int:
    """`start` checked against the tokens and the cache (which is tagged as this
    model's when empty, or vouched for); InvalidInputError names a bad one."""
    n = len(toks)
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise InvalidInputError(f"start must be an int, got {start!r}")
    at = int(start)
    if not 0 <= at < n:
        raise InvalidInputError(f"start={at} must leave at least one of the {n} tokens to prefill")
    check_cache(pc.spec, cache, at)
    if at == 0:
        tag_cache(cache, pc.spec)  # empty: what it will hold comes from this model
    else:
        vouch_for(pc.spec, cache, this_model)
    return at
