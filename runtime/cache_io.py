"""mlx-lm cache objects <-> the per-layer arrays a `Namespace` stores and restores.

Layer formats (aligned with `ModelSpec.layers`, see `cas_bank.index.layout`):
- `KVCache` -> `(keys, values)`, each `[1, kv_heads, T, dim]`;
- `QuantizedKVCache` -> `((kq, ks, kb), (vq, vs, vb))`, tokens on axis -2;
- `ArraysCache` -> no KV (`None`); its state `(conv, recurrent)` is stored only at
  block boundaries, captured with `snapshot_states`.

A cache handed in from outside is checked against the spec before anything runs on
it: layer count, classes, quantization, shapes, dtypes, offsets. A cache made by a
`PrefixCache` also carries its spec's fingerprint, which catches a cache of another
model with the very same layout (same architecture, other weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from cas_bank.arrays import dtype_named
from cas_bank.errors import InvalidInputError
from cas_bank.spec import ArraySpec, LayerSpec, ModelSpec

from .model_spec import cache_layer_counts, check_cache_class

# Attribute set on every cache object a PrefixCache makes: the fingerprint of its spec.
_TAG = "_cas_bank_fingerprint"


def tag_cache(cache: Sequence[Any], spec: ModelSpec) -> None:
    for entry in cache:
        setattr(entry, _TAG, spec.fingerprint)


def vouch_for(spec: ModelSpec, cache: Sequence[Any], this_model: bool) -> None:
    """Refuse a cache the bank cannot vouch for: one not made by a `PrefixCache` of
    this model (`new_cache`, `restore`, `prefill` from empty), unless the caller says
    it is this model's (`this_model=True`). A raw `make_prompt_cache` filled by other
    weights of the same layout would otherwise be stored under this model's name."""
    if this_model:
        tag_cache(cache, spec)
        return
    if not all(getattr(entry, _TAG, None) == spec.fingerprint for entry in cache):
        raise InvalidInputError(
            f"this cache was not made by a PrefixCache of {spec.name!r} (new_cache, restore "
            "or a prefill from empty), so the bank cannot vouch that its KV is this "
            "model's; pass this_model=True if it is"
        )


def check_cache(spec: ModelSpec, cache: Any, start: int) -> None:
    """Raise `InvalidInputError` unless `cache` is a cache of `spec`'s model at `start`."""
    if not isinstance(cache, (list, tuple)):
        raise InvalidInputError(
            f"cache must be the list mlx-lm's make_prompt_cache returns, got {type(cache).__name__}"
        )
    if len(cache) != len(spec.layers):
        raise InvalidInputError(
            f"the cache has {len(cache)} layers ({cache_layer_counts(cache)}) but model "
            f"{spec.name!r} has {len(spec.layers)}: it was made for another model"
        )
    for i, (entry, ls) in enumerate(zip(cache, spec.layers, strict=True)):
        check_cache_class(entry, i)
        tag = getattr(entry, _TAG, None)
        if tag is not None and tag != spec.fingerprint:
            raise InvalidInputError(
                f"layer {i} of the cache was made for another model (spec {tag[:12]}), "
                f"not for {spec.name!r} (spec {spec.fingerprint[:12]})"
            )
        if ls.kind == "attention":
            _check_attention(entry, ls, i, start)
        else:
            _check_recurrent(entry, ls, i, start)


def _check_attention(entry: Any, ls: LayerSpec, i: int, start: int) -> None:
    if not isinstance(entry, KVCache | QuantizedKVCache):
        raise InvalidInputError(
            f"layer {i} is an attention layer but the cache holds {type(entry).__name__}"
        )
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
    if entry.offset != start:
        raise InvalidInputError(
            f"layer {i}: the cache holds {entry.offset} tokens but start={start}"
        )
    if entry.keys is not None:
        for j, (a, s) in enumerate(zip(_flat_kv(entry), ls.arrays, strict=True)):
            _check_array(a, s.with_tokens(a.shape[-2]), s, f"layer {i} array {j}")
            if a.shape[-2] < start:
                raise InvalidInputError(f"layer {i}: buffer shorter than its offset")
    elif start:
        raise InvalidInputError(f"layer {i}: the cache is empty but start={start}")


def _check_recurrent(entry: Any, ls: LayerSpec, i: int, start: int) -> None:
    if not isinstance(entry, ArraysCache):
        raise InvalidInputError(
            f"layer {i} is a recurrent layer but the cache holds {type(entry).__name__}"
        )
    if entry.lengths is not None or entry.left_padding is not None:
        raise InvalidInputError(f"layer {i}: a padded (batched) ArraysCache is not supported")
    arrays = list(entry.cache)
    if len(arrays) != len(ls.arrays):
        raise InvalidInputError(
            f"layer {i}: ArraysCache holds {len(arrays)} arrays, the model's spec {len(ls.arrays)}"
        )
    if start == 0:
        if any(a is not None for a in arrays):
            raise InvalidInputError(f"layer {i}: start=0 but the recurrent state is not empty")
        return
    for j, (a, s) in enumerate(zip(arrays, ls.arrays, strict=True)):
        if a is None:
            raise InvalidInputError(f"layer {i}: start={start} but its state {j} is unset")
        _check_array(a, s.shape, s, f"layer {i} state {j}")


def _check_array(a: Any, shape: tuple[int, ...], s: ArraySpec, where: str) -> None:
    if not isinstance(a, mx.array):
        raise InvalidInputError(f"{where}: expected an mlx array, got {type(a).__name__}")
    if tuple(a.shape) != shape or a.dtype != dtype_named(s.dtype).mx_dtype:
        raise InvalidInputError(
            f"{where}: {a.dtype} {tuple(a.shape)} but the model's spec says {s.dtype} {shape}: "
            f"the cache was made for another model"
        )


def _flat_kv(entry: Any) -> list[mx.array]:
    e: Any = entry  # mlx-lm declares these None until the first update
    if isinstance(entry, QuantizedKVCache):
        return [*e.keys, *e.values]
    return [e.keys, e.values]


def cache_layers(spec: ModelSpec, cache: Sequence[Any], n_tokens: int) -> list[Any]:
    """The attention layers' arrays (whole buffers) for `Namespace.store`; None elsewhere."""
    out: list[Any] = []
    entry: Any
    for i, (entry, ls) in enumerate(zip(cache, spec.layers, strict=True)):
        if ls.kind != "attention":
            out.append(None)
            continue
        if entry.offset < n_tokens:
            raise InvalidInputError(
                f"layer {i} of the cache holds {entry.offset} tokens, fewer than the "
                f"{n_tokens} tokens to store"
            )
        e: Any = entry  # mlx-lm declares these None until the first update
        if isinstance(entry, QuantizedKVCache):
            out.append((tuple(e.keys), tuple(e.values)))
        else:
            out.append((e.keys, e.values))
    return out


def snapshot_states(spec: ModelSpec, cache: Sequence[Any]) -> list[Any]:
    """Copies of every recurrent layer's state, evaluated; None for attention layers.

    `mx.array(a)` makes a new array: a later in-place update of the cache's arrays
    (slice assignment mutates an mx.array object) cannot reach the snapshot.
    """
    out: list[Any] = []
    for entry, ls in zip(cache, spec.layers, strict=True):
        out.append(tuple(mx.array(a) for a in entry.cache) if ls.kind == "recurrent" else None)
    mx.eval([s for s in out if s is not None])
    return out


def fill_cache(spec: ModelSpec, cache: Sequence[Any], layers: Sequence[Any], n: int) -> None:
    """Load restored per-layer arrays covering `n` tokens into a fresh cache.

    The KV arrays hold `n` tokens and, from a restore with room (`room_for`), room for
    more: the cache then keeps the whole buffer at `offset` = `n` and mlx-lm's next
    update writes into it in place (MLX copies it first where something else holds it);
    arrays of exactly `n` tokens are replaced by a larger buffer on that update.
    Recurrent states are replaced, never written in place.
    """
    entry: Any
    for i, (entry, ls, layer) in enumerate(zip(cache, spec.layers, layers, strict=True)):
        assert layer is not None, f"restore returned nothing for layer {i}"
        if ls.kind == "attention":
            keys, values = layer
            e: Any = entry  # mlx-lm declares these None until the first update
            if isinstance(entry, QuantizedKVCache):
                e.keys, e.values = tuple(keys), tuple(values)
            else:
                e.keys, e.values = keys, values
            e.offset = n
        else:
            entry.cache = list(layer)
