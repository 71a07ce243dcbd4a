"""The per-kind protocols: each kind's arrays round-trip through flat/group, and a real
mlx-lm cache object of each kind through blocks-or-snapshot/fill, checked by the same
class (`cas_bank.spec`, `cas_bank.runtime.cache_io`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime.cache_io import cache_kind, cache_kind_of, cache_layers, new_cache
from cas_bank.runtime.model_spec import probe_model
from runtime_helpers import wide

from cas_bank.spec import (
    ATTENTION_KV,
    QUANTIZED_KV,
    RECURRENT_STATE,
    flat_attention,
    group_layers,
    kind_of,
)

TOKENS = 5


def _filled(kv_bits: int | None) -> tuple[Any, list[Any]]:
    """The spec of tiny-hybrid (head_dim 32) and a cache that has seen TOKENS tokens."""
    model = wide("tiny-hybrid")
    spec = probe_model(model, kv_bits=kv_bits, kv_group_size=32).spec
    cache = new_cache(model, kv_bits, 32)
    mx.eval(model(mx.arange(TOKENS)[None], cache=cache))
    return spec, cache


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(np.array(x), np.array(y))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_each_kind_is_picked_and_groups_what_it_flattens(kv_bits: int | None) -> None:
    spec, cache = _filled(kv_bits)
    kinds = {kind_of(ls) for ls in spec.layers}
    assert kinds == {RECURRENT_STATE, ATTENTION_KV if kv_bits is None else QUANTIZED_KV}
    for i, (entry, ls) in enumerate(zip(cache, spec.layers, strict=True)):
        kind = cache_kind(ls)
        layer = kind.blocks(entry, i, TOKENS) or kind.snapshot(entry)
        assert layer is not None and kind.layer.per_block == ls.per_block
        flat = kind.layer.flat(layer)
        assert len(flat) == len(ls.arrays)
        again = kind.layer.group(flat)
        assert kind.layer.flat(again) == flat and type(again) is tuple and len(again) == len(layer)
    layers = cache_layers(spec, cache, TOKENS)
    flat = flat_attention(spec, layers)
    assert len(flat) == len(spec.block_arrays)
    assert flat_attention(spec, group_layers(spec, flat, None)) == flat


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_each_cache_object_is_read_and_filled_back(kv_bits: int | None) -> None:
    spec, cache = _filled(kv_bits)
    fresh = new_cache(wide("tiny-hybrid"), kv_bits, 32)
    for i, (entry, new, ls) in enumerate(zip(cache, fresh, spec.layers, strict=True)):
        kind = cache_kind(ls)
        assert kind is cache_kind_of(entry) and kind.describe(entry, i) == ls
        kind.check(entry, ls, i, TOKENS)
        kind.check(new, ls, i, 0)
        layer = kind.blocks(entry, i, TOKENS) or kind.snapshot(entry)
        assert layer is not None
        kind.fill(new, layer, TOKENS)
        kind.check(new, ls, i, TOKENS)
        back = kind.blocks(new, i, TOKENS) or kind.snapshot(new)
        assert back is not None and _same(kind.layer.flat(back), kind.layer.flat(layer))
    # A snapshot is a copy: the source's state updated in place does not reach it.
    i = spec.recurrent_layers[0]
    before = np.array(cache[i].cache[0])
    snap = cache_kind(spec.layers[i]).snapshot(cache[i])
    assert snap is not None and before.any()
    cache[i].cache[0][:] = 0
    assert np.array_equal(np.array(snap[0]), before)
