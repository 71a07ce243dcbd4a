"""A model's cache layers: what makes two caches compatible (`ModelSpec`, `LayerSpec`,
its fingerprint), and what the bank does with each kind of layer (`LayerKind`): the
caller's arrays checked against the spec, cut into block payloads, and grouped back
into layers (a restore's arrays are assembled by `restore.assemble`).

An attention layer's arrays all carry tokens on axis -2 (`[1, kv_heads, T, dim]`, also
for the packed/scales/biases arrays of quantized KV); `ArraySpec.shape` is the shape
without that axis. A recurrent (GDN) layer's arrays have no token axis; `shape` is full.

A block payload holds, for every attention layer in order, that layer's arrays sliced
to the block's tokens. A state payload holds, for every recurrent layer in order, its
state arrays. Both go through `blocks.codec`.

What the bank does with each kind of layer is one small class per kind (`LayerKind`),
picked by `kind_of(layer_spec)` (from `LayerSpec.per_block` and its quantization). A
layer is given and restored as a tuple (its `layer` form); the bank stores it as flat
arrays in spec order (its `flat` form):

- `per_block`: its arrays carry tokens on axis -2 and are cut into every block
  payload (attention KV, plain or quantized); restorable at any token. Otherwise its
  arrays are one state, stored only at block boundaries and in end records (a
  recurrent layer), never cut;
- `flat(layer)`: the layer's arrays in spec order (mlx-lm's `state`, flattened);
- `group(arrays)`: the layer's tuple from its flat arrays (mlx-lm's `from_state`).

The mlx-lm cache objects of each kind: `cas_bank.runtime.cache_io`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from itertools import islice
from typing import Any, Literal

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cas_bank.arrays import DTYPES, DType, dtype_named, dtype_of, from_numpy, to_numpy
from cas_bank.blocks.codec import Compression, Decoded, encode
from cas_bank.blocks.hashing import SPEC_CONTEXT, Check, digest
from cas_bank.errors import CorruptDataError, InvalidInputError

TOKEN_AXIS = -2


class ArraySpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, ...]
    dtype: str

    def model_post_init(self, _: object) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"unknown dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise InvalidInputError(f"negative dimension in shape {self.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of the array (per token, for an attention array)."""
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def with_tokens(self, n: int) -> tuple[int, ...]:
        """The full shape of this attention array holding `n` tokens."""
        return (*self.shape[:-1], n, self.shape[-1])


class Quantization(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int
    bits: int


class LayerSpec(BaseModel):
    """One layer's cache layout. Build with `attention`, `quantized_attention`, `recurrent`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["attention", "recurrent"]
    arrays: tuple[ArraySpec, ...]
    quantization: Quantization | None = None

    @classmethod
    def attention(
        cls, kv_heads: int, head_dim: int, dtype: str, v_head_dim: int | None = None
    ) -> LayerSpec:
        v_dim = head_dim if v_head_dim is None else v_head_dim
        return cls(
            kind="attention",
            arrays=(
                ArraySpec(shape=(1, kv_heads, head_dim), dtype=dtype),
                ArraySpec(shape=(1, kv_heads, v_dim), dtype=dtype),
            ),
        )

    @classmethod
    def quantized_attention(
        cls,
        kv_heads: int,
        head_dim: int,
        dtype: str,
        group_size: int,
        bits: int,
        v_head_dim: int | None = None,
    ) -> LayerSpec:
        """mlx-lm `QuantizedKVCache`: (packed uint32, scales, biases) for keys, then values."""
        per_word = 32 // bits
        arrays: list[ArraySpec] = []
        for dim in (head_dim, head_dim if v_head_dim is None else v_head_dim):
            arrays += [
                ArraySpec(shape=(1, kv_heads, dim // per_word), dtype="uint32"),
                ArraySpec(shape=(1, kv_heads, dim // group_size), dtype=dtype),
                ArraySpec(shape=(1, kv_heads, dim // group_size), dtype=dtype),
            ]
        return cls(
            kind="attention",
            arrays=tuple(arrays),
            quantization=Quantization(group_size=group_size, bits=bits),
        )

    @classmethod
    def recurrent(cls, arrays: list[tuple[tuple[int, ...], str]]) -> LayerSpec:
        return cls(
            kind="recurrent",
            arrays=tuple(ArraySpec(shape=tuple(s), dtype=d) for s, d in arrays),
        )

    @property
    def per_block(self) -> bool:
        """Whether this layer's arrays carry tokens (attention KV, plain or quantized):
        cut into every block, restorable at any token; else (a recurrent state) they are
        one state, stored only at boundaries. What a bank does with each kind of layer:
        `LayerKind` below."""
        return self.kind == "attention"

    @property
    def token_bytes(self) -> int:
        """Bytes this layer's KV takes per token (0 for a recurrent layer)."""
        return sum(a.nbytes for a in self.arrays) if self.per_block else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of this layer's recurrent state (0 for an attention layer)."""
        return 0 if self.per_block else sum(a.nbytes for a in self.arrays)


class ModelSpec(BaseModel):
    """Everything that makes two caches incompatible; its `fingerprint` roots the chain.

    `tokenizer` is recorded for tools (decoding a block's tokens) and is not part of
    the fingerprint: KV depends on token ids, not on how text became them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    layers: tuple[LayerSpec, ...]
    weights_digest: str = Field(min_length=1)
    config_digest: str = ""
    tokenizer: str | None = None

    def model_post_init(self, _: object) -> None:
        if not self.layers:
            raise InvalidInputError("a ModelSpec needs at least one layer")

    @cached_property
    def fingerprint(self) -> str:
        """Hex blake3 of the canonical JSON of the spec (less `tokenizer`)."""
        body = self.model_dump(mode="json", exclude={"tokenizer"})
        canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return digest(canon, context=SPEC_CONTEXT).hex()

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.per_block]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if not layer.per_block]

    @cached_property
    def block_arrays(self) -> tuple[ArraySpec, ...]:
        """The arrays a block payload holds: every attention layer's, in layer order."""
        return tuple(s for layer in self.layers if layer.per_block for s in layer.arrays)

    @cached_property
    def state_arrays(self) -> tuple[ArraySpec, ...]:
        """The arrays a state payload holds: every recurrent layer's, in layer order."""
        return tuple(s for layer in self.layers if not layer.per_block for s in layer.arrays)

    @cached_property
    def is_hybrid(self) -> bool:
        """Whether any layer is recurrent (asked several times a restore: found once)."""
        return bool(self.recurrent_layers)

    @property
    def token_bytes(self) -> int:
        return sum(layer.token_bytes for layer in self.layers)

    @property
    def state_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers)


def _check_array(a: Any, want_shape: tuple[int, ...], want: DType, where: str) -> None:
    if not isinstance(a, mx.array):
        raise InvalidInputError(f"{where}: expected an mlx array, got {type(a).__name__}")
    if a.dtype != want.mx_dtype:
        raise InvalidInputError(f"{where}: dtype {a.dtype} but the spec says {want.name}")
    if tuple(a.shape) != want_shape:
        raise InvalidInputError(f"{where}: shape {tuple(a.shape)} but the spec says {want_shape}")


def check_layers(spec: ModelSpec, layers: Sequence[Any], n_tokens: int) -> list[list[mx.array]]:
    """The attention layers' arrays, flat, after checking them against the spec.

    An attention array may hold more than `n_tokens` tokens (a padded cache buffer);
    recurrent layers must be None here (their states come at boundaries).
    """
    if len(layers) != len(spec.layers):
        raise InvalidInputError(
            f"{len(layers)} layers given but the spec of {spec.name!r} has {len(spec.layers)}"
        )
    out: list[list[mx.array]] = []
    for i, (layer, ls) in enumerate(zip(layers, spec.layers, strict=True)):
        if not ls.per_block:
            if layer is not None:
                raise InvalidInputError(
                    f"layer {i} is recurrent: pass None in layers and its state in states"
                )
            continue
        if layer is None:
            raise InvalidInputError(f"layer {i} is an attention layer but None was given")
        arrays = kind_of(ls).flat(layer)
        if len(arrays) != len(ls.arrays):
            raise InvalidInputError(
                f"layer {i}: {len(arrays)} arrays given, the spec expects {len(ls.arrays)}"
            )
        width = None
        for j, (a, s) in enumerate(zip(arrays, ls.arrays, strict=True)):
            if not isinstance(a, mx.array) or a.ndim != len(s.shape) + 1:
                got = getattr(a, "shape", type(a).__name__)
                raise InvalidInputError(f"layer {i} array {j}: got {got}, spec {s.shape}")
            t = a.shape[-2]
            if t < n_tokens:
                raise InvalidInputError(
                    f"layer {i} array {j} holds {t} tokens, fewer than the {n_tokens} given"
                )
            width = t if width is None else width
            _check_array(a, s.with_tokens(t), dtype_named(s.dtype), f"layer {i} array {j}")
            if t != width:
                raise InvalidInputError(f"layer {i}: arrays disagree on the token axis")
        out.append(arrays)
    return out


def check_state(spec: ModelSpec, state: Sequence[Any], where: str) -> list[mx.array]:
    """The recurrent layers' state arrays, flat, after checking them against the spec."""
    if len(state) != len(spec.layers):
        raise InvalidInputError(
            f"{where}: {len(state)} entries but the spec has {len(spec.layers)} layers"
        )
    out: list[mx.array] = []
    for i, (entry, ls) in enumerate(zip(state, spec.layers, strict=True)):
        if ls.per_block:
            if entry is not None:
                raise InvalidInputError(f"{where}: layer {i} is attention; give None")
            continue
        if entry is None or len(entry) != len(ls.arrays):
            raise InvalidInputError(
                f"{where}: layer {i} needs {len(ls.arrays)} state arrays, got "
                f"{'None' if entry is None else len(entry)}"
            )
        for j, (a, s) in enumerate(zip(entry, ls.arrays, strict=True)):
            _check_array(a, s.shape, dtype_named(s.dtype), f"{where}: layer {i} array {j}")
            out.append(a)
    return out


class BlockCutter:
    """Cuts block payloads out of the attention layers' arrays (views, no copies)."""

    def __init__(self, spec: ModelSpec, arrays: list[list[mx.array]], block_size: int) -> None:
        self.block_size = block_size
        self.dtypes = [dtype_named(s.dtype) for s in spec.block_arrays]
        # One evaluation and one zero-copy numpy view of each buffer; blocks are slices.
        flat = [a for layer in arrays for a in layer]
        mx.eval(*flat)
        self.views = [to_numpy(a) for a in flat]

    def payload(self, index: int, compression: Compression, check: Check) -> bytes:
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        return encode([v[..., lo:hi, :] for v in self.views], self.dtypes, compression, check)


def encode_state(state_arrays: list[mx.array], compression: Compression, check: Check) -> bytes:
    mx.eval(*state_arrays)
    views = [to_numpy(a) for a in state_arrays]
    return encode(views, [dtype_of(a) for a in state_arrays], compression, check)


def group_layers(
    spec: ModelSpec, attention: list[mx.array] | None, recurrent: list[mx.array] | None
) -> list[tuple[Any, ...] | None]:
    """Flat arrays back into per-layer tuples aligned with spec.layers (each kind's
    `group`): attention layers' from `attention`, recurrent layers' from `recurrent`;
    None for a layer whose list is None.

    Attention layers get (keys, values), or for quantized KV ((kq, ks, kb), (vq, vs, vb)).
    """
    out: list[tuple[Any, ...] | None] = []
    att = iter(attention or [])
    rec = iter(recurrent or [])
    for ls in spec.layers:
        per_block = ls.per_block
        if (attention if per_block else recurrent) is None:
            out.append(None)
            continue
        n = len(ls.arrays)
        # islice: C-level, where a generator a layer cost a cold restore ~1 us each.
        arrs = tuple(islice(att if per_block else rec, n))
        if len(arrs) != n:
            raise ValueError(f"fewer arrays than {spec.name}'s layers hold")
        out.append(kind_of(ls).group(arrs))
    return out


def flat_attention(spec: ModelSpec, layers: Sequence[tuple[Any, ...] | None]) -> list[mx.array]:
    """The attention arrays of per-layer tuples, flat, in spec order (`group_layers`'s inverse)."""
    return [
        a
        for ls, layer in zip(spec.layers, layers, strict=True)
        if layer is not None
        for a in kind_of(ls).flat(layer)
    ]


def merge_layers(
    kv: list[tuple[Any, ...] | None], states: list[tuple[Any, ...] | None]
) -> list[tuple[Any, ...] | None]:
    return [a if a is not None else b for a, b in zip(kv, states, strict=True)]


def decode_state(spec: ModelSpec, block: Decoded) -> list[mx.array]:
    specs = spec.state_arrays
    if len(block.arrays) != len(specs):
        raise CorruptDataError("state payload does not fit the spec")
    out = []
    for a, s in zip(block.arrays, specs, strict=True):
        d = dtype_named(s.dtype)
        if a.shape != s.shape or a.dtype != d.storage:
            raise CorruptDataError("state payload does not fit the spec")
        out.append(from_numpy(a, d))
    return out


def boundary_states(
    spec: ModelSpec, states: Mapping[int, Sequence[Any]] | None, n_tokens: int, block_size: int
) -> dict[int, list[mx.array]]:
    """Checked states by boundary: each a multiple of block_size in (0, n_tokens]."""
    out: dict[int, list[mx.array]] = {}
    for b, state in (states or {}).items():
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise InvalidInputError(f"state boundary {b!r} is not an int")
        b = int(b)
        if b <= 0 or b % block_size:
            raise InvalidInputError(
                f"state at {b} is not at a block boundary (a positive multiple of {block_size})"
            )
        if b > n_tokens:
            raise InvalidInputError(f"state at {b} is beyond the {n_tokens} tokens given")
        if not spec.is_hybrid:
            raise InvalidInputError(f"states given but {spec.name!r} has no recurrent layers")
        out[b] = check_state(spec, state, f"state at {b}")
    return out


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
