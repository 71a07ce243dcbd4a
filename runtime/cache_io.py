"""mlx-lm cache objects <-> the per-layer arrays a `Namespace` stores and restores.

Layer formats (aligned with `ModelSpec.layers`; each kind's class in
`cas_bank.runtime.cache_kinds` checks, reads and fills its cache objects):
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

from cas_bank.errors import InvalidInputError
from cas_bank.spec import ModelSpec

from .cache_kinds import cache_kind
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
        cache_kind(ls).check(entry, ls, i, start)


def cache_layers(spec: ModelSpec, cache: Sequence[Any], n_tokens: int) -> list[Any]:
    """The attention layers' arrays (whole buffers) for `Namespace.store`; None elsewhere."""
    return [
        cache_kind(ls).blocks(entry, i, n_tokens)
        for i, (entry, ls) in enumerate(zip(cache, spec.layers, strict=True))
    ]


def snapshot_states(spec: ModelSpec, cache: Sequence[Any]) -> list[Any]:
    """Copies of every recurrent layer's state, evaluated; None for attention layers.

    `mx.array(a)` makes a new array: a later in-place update of the cache's arrays
    (slice assignment mutates an mx.array object) cannot reach the snapshot.
    """
    out = [cache_kind(ls).snapshot(entry) for entry, ls in zip(cache, spec.layers, strict=True)]
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
    for i, (entry, ls, layer) in enumerate(zip(cache, spec.layers, layers, strict=True)):
        assert layer is not None, f"restore returned nothing for layer {i}"
        cache_kind(ls).fill(entry, layer, n)
