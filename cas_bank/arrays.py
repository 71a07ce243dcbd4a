"""MLX arrays <-> numpy storage arrays, bit-exact for every dtype a cache holds.

numpy has no bfloat16, so bf16 travels as its bits in uint16 (docs/design.md, "Payload
codec"). A dtype is named by a short string (`"bfloat16"`) everywhere it is recorded on
disk. A restore's destination arrays, made from these, are `cas_bank.restore.destinations`'.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import operator
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

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
    bf16 (which numpy lacks) is read as uint16 through the buffer's bytes where it is
    contiguous: ~1 us, where an MLX view evaluated first costs ~14 us an array.
    """
    bf16 = dtype_of(a).name == "bfloat16"  # refuses a dtype the bank does not know
    mx.eval(a)
    if not bf16:
        return np.asarray(a)
    try:
        raw = memoryview(cast(Any, a)).cast("B")  # C-contiguous buffers only
    except TypeError:
        view = a.view(mx.uint16)
        mx.eval(view)
        return np.asarray(view)
    return np.frombuffer(raw, dtype=np.uint16).reshape(a.shape)


def buffer_address(a: mx.array) -> int:
    """Where `a`'s first element is (its numpy view's, `to_numpy`), read through the
    buffer protocol where `a` is one contiguous buffer (~0.7 us; a numpy view first
    costs 1-14 us). Evaluates `a`."""
    mx.eval(a)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(cast(Any, a)))
    except (TypeError, ValueError, BufferError):
        return address_of(to_numpy(a))


def copied_rows(arrays: Sequence[mx.array], lo: int, hi: int) -> list[mx.array]:
    """Copies of rows `lo:hi` (axis -2) of each array, evaluated. Where the CPU reads
    MLX's memory (`mlx_backend()` "cpu" or "metal") and numpy holds the dtype, copied
    through numpy: an MLX array made from numpy needs no evaluation (~2 us an array,
    against an evaluation's ~20 us and ~4 us an array). Else (bf16, CUDA) by MLX."""
    if not arrays:
        return []
    if mlx_backend() in ("cpu", "metal") and all(a.dtype != mx.bfloat16 for a in arrays):
        mx.eval(list(arrays))
        return [mx.array(np.ascontiguousarray(np.asarray(a)[..., lo:hi, :])) for a in arrays]
    out = [mx.array(a[..., lo:hi, :]) for a in arrays]
    mx.eval(out)
    return out


def compacted(arrays: Sequence[mx.array]) -> list[mx.array]:
    """`arrays` evaluated, each one that is a view of part of a much larger buffer
    (`VIEW_SLACK`) replaced by a copy of its own: held as it is, such a view keeps that
    whole buffer alive, where whoever holds it counts its `nbytes` (a lease:
    `index.lease`). mlx-lm's conv states are such views in several models (the last
    rows of a forward pass's input: lfm2's, mamba2's), of up to a chunk of rows.

    Where the CPU reads MLX's memory, a view is told by the extent of its strides (~1 us
    an array, no MLX op for one that is not copied; rows at an offset with the strides
    of their own shape are not told); elsewhere (CUDA, where a CPU pointer would move a
    buffer into unified memory) by `mx.contiguous`, which copies such a view and shares
    any other buffer (an evaluation)."""
    if mlx_backend() not in ("cpu", "metal"):
        out = [mx.contiguous(a) for a in arrays]
        mx.eval(out)
        return out
    mx.eval(list(arrays))
    out = [mx.array(a) if _keeps_more(a) else a for a in arrays]
    copies = [c for c, a in zip(out, arrays, strict=True) if c is not a]
    if copies:
        mx.eval(copies)
    return out


VIEW_SLACK = 16384
"""Bytes a view's buffer may hold past its own before `compacted` copies it: MLX's own
(`mx.contiguous` shares a buffer up to this much larger), so that a view mlx-lm made
contiguous that way, of a few rows more, is not copied again."""


def _keeps_more(a: mx.array) -> bool:
    """Whether evaluated `a` spans more than `VIEW_SLACK` bytes past its own, by its
    strides (a size-1 axis keeps the stride of the buffer it was cut from)."""
    view = memoryview(cast(Any, a))
    strides, shape = view.strides or (), view.shape or ()
    extent = max(map(operator.mul, map(abs, strides), shape), default=0)
    return extent - view.nbytes > VIEW_SLACK


@functools.lru_cache(maxsize=256)
def lead_offsets(lead: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """Byte offsets (int64, read only) of every leading index of a view whose leading
    axes have these sizes and strides, in C order: where each [T, D] slice starts."""
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(lead, strides, strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).ravel()
    offsets.flags.writeable = False
    return offsets


def address_of(view: np.ndarray) -> int:
    """Where `view`'s first element is: through the buffer protocol where it is one
    contiguous writable buffer (~0.7 us, against ~3.5 us for `__array_interface__`,
    which builds a dict: 0.1 ms over a hybrid model's 36 state arrays)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(cast(Any, view)))
    except (TypeError, ValueError, BufferError):
        return int(view.__array_interface__["data"][0])


_HELD_SERIALS = itertools.count()


class HeldArrays(list[mx.array]):
    """Evaluated MLX arrays that nobody updates in place (a lease's), which keep their
    numpy views (`to_numpy`) once asked for: a restore that copies from them asks again
    and again, and making the views cost ~10 us an array (a bf16 one is an MLX view
    evaluated first): 0.5 ms of a 56-array hot restore."""

    __slots__ = ("_addresses", "_views", "memo", "serial")

    def __init__(self, arrays: Sequence[mx.array]) -> None:
        super().__init__(arrays)
        self.serial = next(_HELD_SERIALS)  # these arrays' own number, never reused
        self._views: list[np.ndarray] | None = None
        self._addresses: np.ndarray | None = None
        # What a caller derives from these arrays alone and asks for again (the plan of
        # a copy out of them: `restore.assemble.Assembler`), by its key.
        self.memo: dict[Hashable, Any] = {}

    def numpy_views(self) -> list[np.ndarray]:
        """`to_numpy` of each array, made once (read only: the arrays are held, not
        written). Two threads asking at once both make them; either result is right."""
        views = self._views
        if views is None:
            views = [to_numpy(a) for a in self]
            for v in views:
                v.flags.writeable = False
            self._views = views
        return views

    def addresses(self) -> np.ndarray:
        """Where each numpy view's first element is (int64), found once (from the
        arrays' own buffers: no numpy view is made for it)."""
        found = self._addresses
        if found is None:
            found = np.fromiter(map(buffer_address, self), dtype=np.int64, count=len(self))
            self._addresses = found
        return found


def from_numpy(a: np.ndarray, dtype: DType) -> mx.array:
    """A new MLX array holding a copy of `a`'s bits, typed `dtype`."""
    out = mx.array(a)
    if dtype.name == "bfloat16":
        out = out.view(mx.bfloat16)
    return out


FILL_COPY_ENV = "CAS_BANK_FILL_COPY"
"""Set (not empty, not `0`): restores fill numpy staging buffers and hand out copies
made by `mx.array`, as on a device whose arrays a CPU pointer cannot fill."""


def mlx_backend() -> str:
    """Where MLX's default device keeps arrays: "cpu", "metal" (unified memory) or
    "cuda" (device memory, with unified memory for what a CPU pointer reaches)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "gpu"


def cpu_fillable() -> bool:
    """Whether a restore may write the default device's fresh MLX arrays through a CPU
    pointer (their numpy view): on MLX's CPU device, Metal's unified memory and CUDA.

    On CUDA an array GPU work produced lives in device memory, but MLX hands out a CPU
    pointer to it only after moving its buffer into unified memory (managed, or pinned
    host memory where managed memory is not supported: `Buffer::raw_ptr` in MLX's CUDA
    allocator, since MLX 0.30; before that every buffer was managed). The pointer is
    then the array's own storage, what the GPU reads next. Destinations there are made
    on the CPU stream (`fill_stream`), so they start in unified memory, host-resident.
    Not on a GPU backend not known here, nor when `CAS_BANK_FILL_COPY` asks for the copy.
    """
    if os.environ.get(FILL_COPY_ENV, "") not in ("", "0"):
        return False
    return mlx_backend() in ("cpu", "metal", "cuda")


def fill_stream() -> mx.Device | None:
    """Where a restore's destination arrays are made (None: the default device).

    On CUDA, the CPU: MLX places what its CPU stream makes in unified memory that the
    restore's CPU writes reach without a move, where an array made on the GPU would be
    in device memory and copied into unified memory at its first CPU pointer. Once
    filled, the restore moves them to the GPU in one go (`cas_bank.restore.resources`).
    """
    return mx.Device(mx.cpu) if mlx_backend() == "cuda" else None


# Moved to `cas_bank.restore.destinations` (with the rest of a restore's destination arrays);
# still importable from here, with a DeprecationWarning, for code written before.
_MOVED = frozenset({"Destination", "UNFILLED_FROM", "keep_freed_memory", "unfilled", "zeroed"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib
        import warnings

        # Imported by name, when asked: `cas_bank.restore.destinations` imports this module.
        destinations = importlib.import_module("cas_bank.restore.destinations")
        warnings.warn(
            f"cas_bank.arrays.{name} moved to cas_bank.restore.destinations.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(destinations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
