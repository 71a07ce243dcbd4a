"""`ModelSpec` and `LayerSpec`: what makes two caches compatible, and its fingerprint.

An attention layer's arrays all carry tokens on axis -2 (`[1, kv_heads, T, dim]`, also
for the packed/scales/biases arrays of quantized KV); `ArraySpec.shape` is the shape
without that axis. A recurrent (GDN) layer's arrays have no token axis; `shape` is full.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cas_bank.arrays import DTYPES
from cas_bank.blocks.hashing import SPEC_CONTEXT, digest
from cas_bank.errors import InvalidInputError

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
        `cas_bank.index.layout`."""
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
