"""What a bank does with each kind of cache layer: one small class per kind.

A layer is given and restored as a tuple (its `layer` form); the bank stores it as
flat arrays in spec order (its `flat` form). Each kind says which it is:

- `per_block`: its arrays carry tokens on axis -2 and are cut into every block
  payload (attention KV, plain or quantized); restorable at any token. Otherwise its
  arrays are one state, stored only at block boundaries and in end records (a
  recurrent layer), never cut;
- `flat(layer)`: the layer's arrays in spec order (mlx-lm's `state`, flattened);
- `group(arrays)`: the layer's tuple from its flat arrays (mlx-lm's `from_state`).

`kind_of(layer_spec)` picks a layer's class (from `LayerSpec.per_block` and its
quantization); the mlx-lm cache objects of each kind: `cas_bank.runtime.cache_io`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from cas_bank.spec import LayerSpec


class LayerKind:
    """The shared base: a layer is a flat tuple of arrays, stored per block."""

    per_block = True

    def flat(self, layer: Any) -> list[Any]:
        """The layer's arrays in spec order; nested tuples are flattened (a bad layout is
        then refused by the count and shape checks with the arrays named)."""
        out: list[Any] = []
        for part in layer:
            if isinstance(part, (tuple, list)):
                out.extend(part)
            else:
                out.append(part)
        return out

    def group(self, arrays: Sequence[mx.array]) -> tuple[Any, ...]:
        return tuple(arrays)


class AttentionKV(LayerKind):
    """mlx-lm `KVCache`: `(keys, values)`, each `[1, kv_heads, T, dim]`."""


class QuantizedKV(LayerKind):
    """mlx-lm `QuantizedKVCache`: `((kq, ks, kb), (vq, vs, vb))`, tokens on axis -2."""

    def group(self, arrays: Sequence[mx.array]) -> tuple[Any, ...]:
        return (tuple(arrays[:3]), tuple(arrays[3:]))


class RecurrentState(LayerKind):
    """mlx-lm `ArraysCache` (Gated DeltaNet, Mamba): its state arrays, no token axis."""

    per_block = False


ATTENTION_KV = AttentionKV()
QUANTIZED_KV = QuantizedKV()
RECURRENT_STATE = RecurrentState()


def kind_of(ls: LayerSpec) -> LayerKind:
    """The kind of the layer `ls` describes."""
    if not ls.per_block:
        return RECURRENT_STATE
    return ATTENTION_KV if ls.quantization is None else QUANTIZED_KV
