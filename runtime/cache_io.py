"""mlx-lm cache objects: made, checked, read and filled, one small class per kind.

A cache handed in from outside is checked against the spec before anything runs on
it: layer count, classes, quantization, shapes, dtypes, offsets. A cache made by a
`PrefixCache` (`new_cache`) also carries its spec's fingerprint, which catches a cache
of another model with the very same layout (same architecture, other weights).

Layer formats (aligned with `ModelSpec.layers`):
- `KVCache` -> `(keys, values)`, each `[1, kv_heads, T, dim]`;
- `QuantizedKVCache` -> `((kq, ks, kb), (vq, vs, vb))`, tokens on axis -2;
- `ArraysCache` -> no KV (`None`); its state `(conv, recurrent)` is stored only at
  block boundaries, captured with `snapshot_states`.

Each kind's class says, for one mlx-lm cache object of its kind:

- `check(entry, ls, i, start)`: that it fits the layer `ls` at `start` tokens (else
  `InvalidInputError` naming the problem);
- `blocks(entry, i, n_tokens)`: the arrays a store cuts into blocks (the whole
  buffers), or None for a kind stored only at boundaries;
- `snapshot(entry)`: its state for a boundary (new objects over its arrays, no copy),
  or None for a kind with no boundary state;
- `fill(entry, layer, n)`: a fresh cache object filled from a restore's arrays
  covering `n` tokens (mlx-lm's `from_state`, into the object the model made);
- `describe(entry)`: the `LayerSpec` of an object that has seen a token.

`cache_kind(ls)` picks the class for a layer of a spec, `cache_kind_of(entry)` for a
cache object; what the bank does with the arrays: `cas_bank.spec`'s kinds.
Supported classes: `SUPPORTED_CACHES` (`check_cache_class` names any other).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

from cas_bank.arrays import compacted, dtype_named, dtype_of
from cas_bank.errors import InvalidInputError
from cas_bank.spec import (
    ATTENTION_KV,
    QUANTIZED_KV,
    RECURRENT_STATE,
    ArraySpec,
    LayerKind,
    LayerSpec,
    ModelSpec,
    kind_of,
)

# Attribute set on every cache object a PrefixCache makes: the fingerprint of its spec.
_TAG = "_cas_bank_fingerprint"


SUPPORTED_CACHES: tuple[type, ...] = (KVCache, QuantizedKVCache, ArraysCache)


def check_cache_class(entry: Any, index: int) -> None:
    """Refuse a cache object whose layout the bank cannot store, naming its class."""
    cls = type(entry)
    if cls in SUPPORTED_CACHES:
        return
    # Subclasses of ArraysCache (Mamba's) keep the same `cache` list; Batch ones do not.
    if isinstance(entry, ArraysCache) and not cls.__name__.startswith("Batch"):
        return
    raise InvalidInputError(
        f"layer {index} uses {cls.__name__}, which cas_bank cannot store: supported cache "
        f"classes are {', '.join(c.__name__ for c in SUPPORTED_CACHES)} "
        f"(a sliding-window, chunked, batched or nested cache is not a function of the "
        f"token prefix alone, or holds more than one sequence)"
    )


def new_cache(model: nn.Module, kv_bits: int | None, kv_group_size: int) -> list[Any]:
    """A fresh prompt cache for `model`; with `kv_bits`, attention layers are quantized.

    Quantized from the first token on (mlx-lm's `quantized_kv_start=0`), so every
    attention read sees the same quantized KV whether it was restored or computed.
    """
    cache = make_prompt_cache(model)
    classes = tuple(map(type, cache))
    if classes not in _CHECKED_CLASSES:  # a restore's every new cache: checked once
        for i, entry in enumerate(cache):
            check_cache_class(entry, i)
        _CHECKED_CLASSES.add(classes)
    if kv_bits is not None:
        for i, entry in enumerate(cache):
            if type(entry) is KVCache:
                cache[i] = QuantizedKVCache(group_size=kv_group_size, bits=kv_bits)
    return cache


# The layer classes of caches `new_cache` checked: a model makes the same ones each time.
_CHECKED_CLASSES: set[tuple[type, ...]] = set()


def cache_layer_counts(cache: Sequence[Any]) -> str:
    """A short description of a cache list, for error messages."""
    names: dict[str, int] = {}
    for c in cache:
        names[type(c).__name__] = names.get(type(c).__name__, 0) + 1
    return ", ".join(f"{n}×{k}" for k, n in names.items())


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
        cache_kind(ls).check(entry, ls, i, start)


def cache_layers(spec: ModelSpec, cache: Sequence[Any], n_tokens: int) -> list[Any]:
    """The attention layers' arrays (whole buffers) for `Namespace.store`; None elsewhere."""
    return [
        kind.blocks(entry, i, n_tokens)
        for i, (entry, kind) in enumerate(zip(cache, cache_kinds(spec), strict=True))
    ]


def cache_kinds(spec: ModelSpec) -> tuple[CacheKind, ...]:
    """`cache_kind` of each of the spec's layers, found once per spec (a prefill's store
    asks for every layer's: ~1 us a layer of a 60-layer model's, each time)."""
    kinds = _KINDS.get(spec.fingerprint)
    if kinds is None:
        kinds = _KINDS[spec.fingerprint] = tuple(cache_kind(ls) for ls in spec.layers)
    return kinds


_KINDS: dict[str, tuple[CacheKind, ...]] = {}  # by spec fingerprint


def snapshot_states(spec: ModelSpec, cache: Sequence[Any]) -> list[Any]:
    """Every recurrent layer's state, evaluated, as new array objects of our own over
    the same arrays (no copy); None for attention layers. An array that is a view of
    part of a larger buffer (a model's conv state: the last rows of its pass's input)
    is copied (`arrays.compacted`): held as a view, it would keep that whole buffer
    alive for as long as a lease or a queued store holds the state, charged for its
    own few rows.

    A later in-place update of the cache's arrays (slice assignment rebinds the mx.array
    object it is applied to) cannot reach the snapshot: it rebinds the cache's objects,
    never these, and MLX copies a buffer that another array holds before it writes into
    it (as for the KV a lease holds: `index.lease`). A copy of every array (`mx.array`)
    cost an MLX evaluation on the caller's thread, ~20 us, at every boundary and every
    end record.
    """
    out = [cache_kind(ls).snapshot(entry) for entry, ls in zip(cache, spec.layers, strict=True)]
    flat = compacted([a for s in out if s is not None for a in s])
    at = 0
    for i, s in enumerate(out):
        if s is not None:
            out[i], at = tuple(flat[at : at + len(s)]), at + len(s)
    return out


def fill_cache(spec: ModelSpec, cache: Sequence[Any], layers: Sequence[Any], n: int) -> None:
    """Load restored per-layer arrays covering `n` tokens into a fresh cache.

    The KV arrays hold `n` tokens and, from a restore with room (`room_for`), room for
    more: the cache then keeps the whole buffer at `offset` = `n` and mlx-lm's next
    update writes into it in place (MLX copies it first where something else holds it);
    arrays of exactly `n` tokens are replaced by a larger buffer on that update.
    Recurrent states are replaced, never written in place.
    """
    for i, (entry, ls, layer) in enumerate(zip(cache, spec.layers, layers, strict=True)):
        assert layer is not None, f"restore returned nothing for layer {i}"
        cache_kind(ls).fill(entry, layer, n)


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
        """New objects over its arrays: a later in-place update of the cache's cannot
        reach them (`snapshot_states`)."""
        return tuple(a.reshape(a.shape) for a in entry.cache)

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
