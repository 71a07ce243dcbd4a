"""MLX arrays <-> numpy storage arrays, bit-exact for every dtype a cache holds.

numpy has no bfloat16, so bf16 travels as its bits in uint16 (docs/design.md, "Payload
codec"). A dtype is named by a short string (`"bfloat16"`) everywhere it is recorded on
disk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cas_bank.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    code: int  # one byte in the codec's array descriptor; never reuse a code
    mx_dtype: mx.Dtype
    storage: np.dtype[np.generic]  # how numpy holds the bits

    @property
    def itemsize(self) -> int:
        return int(self.storage.itemsize)


_ALL = [
    DType("float32", 1, mx.float32, np.dtype(np.float32)),
    DType("float16", 2, mx.float16, np.dtype(np.float16)),
    DType("bfloat16", 3, mx.bfloat16, np.dtype(np.uint16)),
    DType("uint32", 4, mx.uint32, np.dtype(np.uint32)),
    DType("int32", 5, mx.int32, np.dtype(np.int32)),
    DType("uint8", 6, mx.uint8, np.dtype(np.uint8)),
    DType("int8", 7, mx.int8, np.dtype(np.int8)),
    DType("uint16", 8, mx.uint16, np.dtype(np.uint16)),
    DType("int64", 9, mx.int64, np.dtype(np.int64)),
    DType("float64", 10, mx.float64, np.dtype(np.float64)) if hasattr(mx, "float64") else None,
    DType("bool", 11, mx.bool_, np.dtype(np.bool_)),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL if d is not None}
DTYPES_BY_CODE: dict[int, DType] = {d.code: d for d in DTYPES.values()}
_BY_MX: dict[mx.Dtype, DType] = {d.mx_dtype: d for d in DTYPES.values()}


def dtype_of(a: mx.array) -> DType:
    try:
        return _BY_MX[a.dtype]
    except KeyError:
        raise InvalidInputError(f"unsupported array dtype {a.dtype}") from None


def dtype_named(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidInputError(
            f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPES))}"
        ) from None


def to_numpy(a: mx.array) -> np.ndarray:
    """A numpy view of `a`'s bits (zero-copy where MLX allows). Evaluates `a`.

    The view aliases MLX memory that a cache may update in place: copy what you keep.
    """
    d = dtype_of(a)
    if d.name == "bfloat16":
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a)


def from_numpy(a: np.ndarray, dtype: DType) -> mx.array:
    """A new MLX array holding a copy of `a`'s bits, typed `dtype`."""
    out = mx.array(a)
    if dtype.name == "bfloat16":
        out = out.view(mx.bfloat16)
    return out


_BATCH_EVAL_BYTES = 16 << 20  # below this, one mx.eval allocates every destination


class Destination:
    """A fresh MLX array and a writable numpy view of its memory.

    Restore copies every block once, straight into memory MLX owns (docs/design.md,
    "Restore path").
    Only valid for an array nobody else holds yet; `array` is what to hand out.
    """

    __slots__ = ("_dtype", "_storage", "array", "view")

    def __init__(
        self, shape: tuple[int, ...], dtype: DType, storage: mx.array | None = None
    ) -> None:
        if storage is None:  # else: `_zeros(shape, dtype)`, evaluated by the caller
            storage = _zeros(shape, dtype)
            mx.eval(storage)
        view = np.asarray(storage)
        if not (view.flags.writeable and view.flags.c_contiguous and view.shape == shape):
            # MLX did not export a plain buffer: assemble in numpy and copy once more.
            view = np.zeros(shape, dtype=dtype.storage)
            self._storage: mx.array | None = None
        else:
            self._storage = storage
        self.view = view
        self.array = storage.view(mx.bfloat16) if dtype.name == "bfloat16" else storage
        self._dtype = dtype

    @classmethod
    def allocate(cls, wanted: Sequence[tuple[tuple[int, ...], DType]]) -> list[Destination]:
        """One destination per (shape, dtype), each allocated and zero-filled in turn.

        MLX has no uninitialized allocation (`mx.empty` is `mx.zeros`), so the zero
        fill stays. Above `_BATCH_EVAL_BYTES` in all, each destination is evaluated on
        its own: one `mx.eval` of all of them, in a process that also reads payloads,
        makes the allocator hand memory back and fault it in again on every restore.
        Up to `_BATCH_EVAL_BYTES`, one `mx.eval` allocates them all: there the
        scheduling of an `mx.eval` per array costs more than its zero fill. The
        measurements behind both: docs/design.md, "Where each figure is measured".
        """
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in wanted)
        if total > _BATCH_EVAL_BYTES:
            return [cls(shape, dtype) for shape, dtype in wanted]
        storages = [_zeros(shape, dtype) for shape, dtype in wanted]
        mx.eval(*storages)
        return [
            cls(shape, dtype, storage)
            for (shape, dtype), storage in zip(wanted, storages, strict=True)
        ]

    def finish(self) -> mx.array:
        """The filled MLX array."""
        if self._storage is None:
            return from_numpy(self.view, self._dtype)
        return self.array


def _zeros(shape: tuple[int, ...], dtype: DType) -> mx.array:
    """An unevaluated zero array holding `dtype`'s bits (bf16 as uint16)."""
    return mx.zeros(shape, dtype=mx.uint16 if dtype.name == "bfloat16" else dtype.mx_dtype)
