"""mlx-lm's cache objects of each kind of layer: one small class per kind.

Each says, for one mlx-lm cache object of its kind:

- `check(entry, ls, i, start)`: that it fits the layer `ls` at `start` tokens (else
  `InvalidInputError` naming the problem);
- `blocks(entry, i, n_tokens)`: the arrays a store cuts into blocks (the whole
  buffers), or None for a kind stored only at boundaries;
- `snapshot(entry)`: copies of its state for a boundary, or None for a kind with no
  boundary state;
- `fill(entry, layer, n)`: a fresh cache object filled from a restore's arrays
  covering `n` tokens (mlx-lm's `from_state`, into the object the model made);
- `describe(entry)`: the `LayerSpec` of an object that has seen a token.

`cache_kind(ls)` picks the class for a layer of a spec, `cache_kind_of(entry)` for a
cache object; what the bank does with the arrays: `cas_bank.index.layer_kinds`.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from cas_bank.arrays import dtype_named, dtype_of
from cas_bank.errors import InvalidInputError
from cas_bank.index.layer_kinds import (
    ATTENTION_KV,
    QUANTIZED_KV,
    RECURRENT_STATE,
    LayerKind,
    kind_of,
)
from cas_bank.spec import ArraySpec, LayerSpec


class CacheKind(Protocol):
    """What the runtime does with an mlx-lm cache object of one kind (the module's list)."""

    layer: LayerKind  # what the bank does with its arrays

    def check(self, entry: Any, ls: LayerSpec, i: int, start: int) -> None: ...
    def blocks(self, entry: Any, i: int, n_tokens: int) -> tuple[Any, ...] | None: ...
    def snapshot(self, entry: Any) -> tuple[mx.array, ...] | None: ...
    def fill(self, entry: Any, layer: tuple[Any, ...], n: int) -> None: ...
    def describe(self, entry: Any, i: int) -> LayerSpec: ...


class KVCacheKind:
    """`KVCache`: keys and values `[1, kv_heads, T, dim]`, `offset` tokens valid."""

    layer: LayerKind = ATTENTION_KV

    def check(self, entry: Any, ls: LayerSpec, i: int, start: int) -> None:
        if not isinstance(entry, KVCache | QuantizedKVCache):
            raise InvalidInputError(
                f"layer {i} is an attention layer but the cache holds {type(entry).__name__}"
            )
        _check_quantization(entry, ls, i)
        if entry.offset != start:
            raise InvalidInputError(
                f"layer {i}: the cache holds {entry.offset} tokens but start={start}"
            )
        e: Any = entry  # mlx-lm declares these None until the first update
        if e.keys is None:
            if start:
                raise InvalidInputError(f"layer {i}: the cache is empty but start={start}")
            return
        for j, (a, s) in enumerate(
            zip(self.layer.flat((e.keys, e.values)), ls.arrays, strict=True)
        ):
            check_array(a, s.with_tokens(a.shape[-2]), s, f"layer {i} array {j}")
            if a.shape[-2] < start:
                raise InvalidInputError(f"layer {i}: buffer shorter than its offset")

    def blocks(self, entry: Any, i: int, n_tokens: int) -> tuple[Any, ...] | None:
        if entry.offset < n_tokens:
            raise InvalidInputError(
                f"layer {i} of the cache holds {entry.offset} tokens, fewer than the "
                f"{n_tokens} tokens to store"
            )
        return (entry.keys, entry.values)

    def snapshot(self, entry: Any) -> tuple[mx.array, ...] | None:
        return None

    def fill(self, entry: Any, layer: tuple[Any, ...], n: int) -> None:
        entry.keys, entry.values = layer
        entry.offset = n

    def describe(self, entry: Any, i: int) -> LayerSpec:
        keys, values = entry.keys, entry.values
        return LayerSpec.attention(
            kv_heads=keys.shape[1],
            head_dim=keys.shape[-1],
            dtype=dtype_of(keys).name,
            v_head_dim=values.shape[-1],
        )


class QuantizedKVCacheKind(KVCacheKind):
    """`QuantizedKVCache`: keys and values each `(packed, scales, biases)`."""

    layer: LayerKind = QUANTIZED_KV

    def blocks(self, entry: Any, i: int, n_tokens: int) -> tuple[Any, ...] | None:
        super().blocks(entry, i, n_tokens)
        return (tuple(entry.keys), tuple(entry.values))

    def fill(self, entry: Any, layer: tuple[Any, ...], n: int) -> None:
        keys, values = layer
        entry.keys, entry.values = tuple(keys), tuple(values)
        entry.offset = n

    def describe(self, entry: Any, i: int) -> LayerSpec:
        kq, ks, _ = entry.keys
        vq, _, _ = entry.values
        per_word = 32 // entry.bits
        return LayerSpec.quantized_attention(
            kv_heads=kq.shape[1],
            head_dim=kq.shape[-1] * per_word,
            dtype=dtype_of(ks).name,
            group_size=entry.group_size,
            bits=entry.bits,
            v_head_dim=vq.shape[-1] * per_word,
        )


class ArraysCacheKind:
    """`ArraysCache` (and Mamba's subclass): its state arrays in `cache`, no tokens."""

    layer: LayerKind = RECURRENT_STATE

    def check(self, entry: Any, ls: LayerSpec, i: int, start: int) -> None:
        if not isinstance(entry, ArraysCache):
            raise InvalidInputError(
                f"layer {i} is a recurrent layer but the cache holds {type(entry).__name__}"
            )
        if entry.lengths is not None or entry.left_padding is not None:
            raise InvalidInputError(f"layer {i}: a padded (batched) ArraysCache is not supported")
        arrays = list(entry.cache)
        if len(arrays) != len(ls.arrays):
            raise InvalidInputError(
                f"layer {i}: ArraysCache holds {len(arrays)} arrays, the model's spec "
                f"{len(ls.arrays)}"
            )
        if start == 0:
            if any(a is not None for a in arrays):
                raise InvalidInputError(f"layer {i}: start=0 but the recurrent state is not empty")
            return
        for j, (a, s) in enumerate(zip(arrays, ls.arrays, strict=True)):
            if a is None:
                raise InvalidInputError(f"layer {i}: start={start} but its state {j} is unset")
            check_array(a, s.shape, s, f"layer {i} state {j}")

    def blocks(self, entry: Any, i: int, n_tokens: int) -> tuple[Any, ...] | None:
        return None

    def snapshot(self, entry: Any) -> tuple[mx.array, ...] | None:
        """New arrays: a later in-place update of the cache's cannot reach them."""
        return tuple(mx.array(a) for a in entry.cache)

    def fill(self, entry: Any, layer: tuple[Any, ...], n: int) -> None:
        entry.cache = list(layer)  # replaced, never written in place

    def describe(self, entry: Any, i: int) -> LayerSpec:
        arrays = list(entry.cache)
        if any(a is None for a in arrays):
            raise InvalidInputError(f"layer {i}: {type(entry).__name__} left a state unset")
        return LayerSpec.recurrent([(tuple(a.shape), dtype_of(a).name) for a in arrays])


KV, QUANTIZED_KV_CACHE, ARRAYS = KVCacheKind(), QuantizedKVCacheKind(), ArraysCacheKind()
_BY_LAYER: dict[LayerKind, CacheKind] = {
    ATTENTION_KV: KV,
    QUANTIZED_KV: QUANTIZED_KV_CACHE,
    RECURRENT_STATE: ARRAYS,
}


def cache_kind(ls: LayerSpec) -> CacheKind:
    """The class for the cache objects of a layer `ls` describes."""
    return _BY_LAYER[kind_of(ls)]


def cache_kind_of(entry: Any) -> CacheKind:
    """The class for a cache object (one `check_cache_class` accepted)."""
    if isinstance(entry, QuantizedKVCache):
        return QUANTIZED_KV_CACHE
    return KV if isinstance(entry, KVCache) else ARRAYS


def check_array(a: Any, shape: tuple[int, ...], s: ArraySpec, where: str) -> None:
    if not isinstance(a, mx.array):
        raise InvalidInputError(f"{where}: expected an mlx array, got {type(a).__name__}")
    if tuple(a.shape) != shape or a.dtype != dtype_named(s.dtype).mx_dtype:
        raise InvalidInputError(
            f"{where}: {a.dtype} {tuple(a.shape)} but the model's spec says {s.dtype} {shape}: "
            f"the cache was made for another model"
        )


def _check_quantization(entry: Any, ls: LayerSpec, i: int) -> None:
    q = ls.quantization
    if isinstance(entry, QuantizedKVCache):
        if q is None or (q.bits, q.group_size) != (entry.bits, entry.group_size):
            want = "unquantized KV" if q is None else f"{q.bits}-bit KV, group {q.group_size}"
            raise InvalidInputError(
                f"layer {i}: the cache holds {entry.bits}-bit KV (group {entry.group_size}) "
                f"but this PrefixCache stores {want}"
            )
    elif q is not None:
        raise InvalidInputError(
            f"layer {i}: the cache holds unquantized KV but this PrefixCache stores "
            f"{q.bits}-bit KV (group {q.group_size})"
        )
