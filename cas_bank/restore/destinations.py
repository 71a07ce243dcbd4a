"""A restore's destination arrays: fresh MLX arrays and writable numpy views of their
memory (`Destination`), made unfilled (`unfilled`: no zero pass over memory every byte
of which a restore writes) or zeroed (`zeroed`: from any thread); and a serving
process's freed memory kept for the next restore (`keep_freed_memory`).

The dtypes and conversions they build on are `cas_bank.arrays`'.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any, BinaryIO, cast

import mlx.core as mx
import numpy as np

from cas_bank.arrays import DType, address_of, cpu_fillable, fill_stream, from_numpy
from cas_bank.errors import InvalidInputError

_BATCH_EVAL_BYTES = 16 << 20  # below this, one mx.eval allocates every destination
# An array below this is zeroed rather than left unfilled: `unfilled` costs ~85-115 us
# an array (MLX's load call), a zero fill ~7 GB/s (1 MiB: ~150 us) measured here.
UNFILLED_FROM = 1 << 20
# While `unfilled` loads, a thread that asks for the GIL waits at most this long before
# its holder is told to let it go (Python's default: 5 ms). MLX's I/O thread asks for it
# at each call into the stream, a few a load: beside any busy Python thread (a
# runtime's, the background writer's) a load of 0.3 ms took 21-25 ms at the default.
LOAD_SWITCH_INTERVAL = 1e-4
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


class Destination:
    """A fresh MLX array and a writable numpy view of its memory, or (`staged`) a numpy
    buffer the MLX array is copied from when handed out.

    Restore copies every block once, straight into memory MLX owns (docs/design.md,
    "Restore path"), where a CPU pointer can fill the device's arrays (`cpu_fillable`);
    elsewhere into the staging buffer, then once more by `mx.array`.
    Only valid for an array nobody else holds yet; `finish()` is what to hand out.
    """

    __slots__ = ("_dtype", "_storage", "address", "array", "fillable", "view")
    # Found once, with `view`: a restore reads them for each of its 24-56 arrays, and a
    # property a read cost a cold restore ~1 us an array.
    address: int  # where `view`'s first element is (`address_of`)
    # Whether `view` is plain CPU memory a payload read may fill (MLX's own, or the
    # staging buffer).
    fillable: bool

    @property
    def direct(self) -> bool:
        """Whether `view` is the MLX array's own memory (else a numpy buffer that
        `finish` copies)."""
        return self._storage is not None

    def __init__(
        self, shape: tuple[int, ...], dtype: DType, storage: mx.array | None = None
    ) -> None:
        self._dtype = dtype
        self._storage: mx.array | None = None
        self.array: mx.array | None = None
        if storage is None and not cpu_fillable():
            self._hold(np.zeros(shape, dtype=dtype.storage))  # `staged`
            return
        if storage is None:  # else: `_zeros(shape, dtype)`, evaluated by the caller
            storage = _zeros(shape, dtype)
            mx.eval(storage)
        view = np.asarray(storage)
        if not (view.flags.writeable and view.flags.c_contiguous and view.shape == shape):
            # MLX did not export a plain buffer: assemble in numpy and copy once more.
            self._hold(np.zeros(shape, dtype=dtype.storage))
            return
        self._storage = storage
        self._hold(view)
        self.array = storage.view(mx.bfloat16) if dtype.name == "bfloat16" else storage

    def _hold(self, view: np.ndarray) -> None:
        self.view = view
        self.address = address_of(view)
        self.fillable = bool(view.flags.writeable and view.flags.c_contiguous)

    @classmethod
    def made_ahead(cls, shape: tuple[int, ...], dtype: DType, storage: mx.array) -> Destination:
        """A destination over `storage` (evaluated, nobody else's), made on another
        thread than the one that fills it (`cas_bank.restore.spares`): the bf16 view of its bits
        is evaluated here, so nothing of it is bound to this thread's stream."""
        made = cls(shape, dtype, storage)
        if made.array is not None and made.array is not storage:
            mx.eval(made.array)
        return made

    @classmethod
    def allocate(
        cls,
        wanted: Sequence[tuple[tuple[int, ...], DType]],
        *,
        overwritten: bool = False,
        ready: Mapping[int, Destination] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> list[Destination]:
        """One destination per (shape, dtype); `ready`: destinations made ahead of
        arrays nobody else holds, by index, used as they are (spares: `cas_bank.restore.spares`).

        `overwritten`: the caller writes every byte it will read back, so the memory
        of each array from `UNFILLED_FROM` on need not be zeroed (`unfilled`): a large
        restore saves its zero-fill pass. The others are zeroed (MLX has no
        uninitialized allocation: `mx.empty` is `mx.zeros`): above
        `_BATCH_EVAL_BYTES` in all, each destination is evaluated on its own: one
        `mx.eval` of all of them, in a process that also reads payloads, makes the
        allocator hand memory back and fault it in again on every restore. Up to
        `_BATCH_EVAL_BYTES`, one `mx.eval` allocates them all: there the scheduling of
        an `mx.eval` per array costs more than its zero fill. The measurements behind
        both: docs/design.md, "Where each figure is measured". `sizes`: the bytes of
        each of `wanted`, where the caller has them.
        """
        if not cpu_fillable():  # no MLX memory a CPU pointer can fill: stage in numpy
            return [cls(shape, dtype) for shape, dtype in wanted]
        if sizes is None:
            sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in wanted]
        ready = ready or {}
        if len(ready) == len(wanted):  # a serving process's restore: all made ahead
            return [ready[i] for i in range(len(wanted))]
        storages: list[mx.array | None] = [None] * len(wanted)
        big = (
            [i for i, n in enumerate(sizes) if n >= UNFILLED_FROM and i not in ready]
            if overwritten
            else []
        )
        got = unfilled([wanted[i] for i in big]) if big else None
        for i, storage in zip(big, got or [], strict=False):
            storages[i] = storage
        rest = [i for i, storage in enumerate(storages) if storage is None and i not in ready]
        made = dict(zip(rest, zeroed([wanted[i] for i in rest]), strict=True))
        storages = [made.get(i, storage) for i, storage in enumerate(storages)]
        return [
            ready[i] if i in ready else cls(shape, dtype, storage)
            for i, ((shape, dtype), storage) in enumerate(zip(wanted, storages, strict=True))
        ]

    def finish(self) -> mx.array:
        """The filled MLX array (a staged one is copied once, at the first call)."""
        if self.array is None:
            self.array = from_numpy(self.view, self._dtype)
        return self.array


def addresses_of(dests: Sequence[Destination]) -> np.ndarray:
    """Each destination's `address`, as int64 (the native reader's and the lease
    copy's), read by a C-level map: one Python step per array cost a cold restore."""
    return np.fromiter(map(_ADDRESS, dests), np.int64, len(dests))


_ADDRESS = attrgetter("address")


def zeroed(wanted: Sequence[tuple[tuple[int, ...], DType]]) -> list[mx.array]:
    """New, evaluated zero arrays holding each dtype's bits (bf16 as uint16), each with
    a buffer of its own. Above `_BATCH_EVAL_BYTES` in all, each is evaluated on its own
    (see `Destination.allocate`), else one `mx.eval` makes them all.

    Unlike `unfilled`, nothing here calls back into Python from MLX's threads, so any
    thread may call it while others run MLX (`cas_bank.restore.spares`)."""
    arrays = [_zeros(shape, dtype) for shape, dtype in wanted]
    if sum(math.prod(shape) * dtype.itemsize for shape, dtype in wanted) > _BATCH_EVAL_BYTES:
        for array in arrays:
            mx.eval(array)
    elif arrays:
        mx.eval(*arrays)
    return arrays


def _zeros(shape: tuple[int, ...], dtype: DType) -> mx.array:
    """An unevaluated zero array holding `dtype`'s bits (bf16 as uint16), made where a
    restore fills it from the CPU (`arrays.fill_stream`)."""
    held = mx.uint16 if dtype.name == "bfloat16" else dtype.mx_dtype
    return mx.zeros(shape, dtype=held, stream=fill_stream())


_SAFETENSORS = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "U16",  # held as its bits, like everywhere else here
    "uint32": "U32",
    "int32": "I32",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int64": "I64",
    "float64": "F64",
    "bool": "BOOL",
}


class _Unfilled(io.RawIOBase):
    """A safetensors stream whose tensor bytes are never written: `mx.load` reads it
    into memory MLX allocates, and finds that memory as the allocator left it."""

    def __init__(self, wanted: Sequence[tuple[tuple[int, ...], DType]]) -> None:
        meta: dict[str, object] = {}
        at = 0
        for i, (shape, dtype) in enumerate(wanted):
            n = math.prod(shape) * dtype.itemsize
            meta[str(i)] = {
                "dtype": _SAFETENSORS[dtype.name],
                "shape": list(shape),
                "data_offsets": [at, at + n],
            }
            at += n
        header = json.dumps(meta).encode()
        header += b" " * (-len(header) % 8)
        self._head = struct.pack("<Q", len(header)) + header
        self._size = len(self._head) + at
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        n = len(view) if view.ndim == 1 and view.itemsize == 1 else view.nbytes
        if self._pos < len(self._head):
            k = min(n, len(self._head) - self._pos)
            view.cast("B")[:k] = self._head[self._pos : self._pos + k]
        self._pos += n
        return n


def unfilled(wanted: Sequence[tuple[tuple[int, ...], DType]]) -> list[mx.array] | None:
    """New, evaluated MLX arrays whose contents are undefined (bf16 as uint16), each
    with a buffer of its own; None where MLX cannot make them this way.

    MLX has no uninitialized allocation (`mx.empty` is `mx.zeros`), but `mx.load` of a
    file-like object fills the memory it allocated by calling `readinto`: a stream that
    serves only the header leaves the tensors unwritten. A restore that overwrites
    every byte it hands out then skips a pass over the memory (the zero fill); bytes
    beyond a cache's offset (its room) are never read.

    Only on a thread that is the one running MLX at the time (a restore's own): MLX's
    I/O thread calls `readinto` and so waits for the GIL, while `mx.clear_cache()` (which
    mlx-lm calls during prefill) holds the GIL as it waits for every CPU stream, this
    load's too. Called from a second thread beside such a call, the two deadlock (it
    hung mlx-lm's server: tests/test_spares.py). Background threads use `zeroed`.
    """
    if not wanted:
        return []
    stream = _Unfilled(wanted)
    with short_gil_waits():  # the load runs in `mx.eval`, calling back into the stream
        try:
            # On the CPU stream everywhere: on CUDA `mx.load` would otherwise load on the
            # GPU, into device memory a CPU pointer does not reach (`arrays.fill_stream`).
            loaded = mx.load(cast(BinaryIO, stream), format="safetensors", stream=mx.cpu)
        except Exception:  # an MLX without file-like loads: the caller zero-fills
            return None
        finally:
            del stream  # not left to the collector: a late one aborted at exit once
        assert isinstance(loaded, dict)
        out = [loaded[str(i)] for i in range(len(wanted))]
        mx.eval(out)
    return out


@contextmanager
def short_gil_waits() -> Iterator[None]:
    """Python's switch interval at most `LOAD_SWITCH_INTERVAL` inside the block, put back
    when the last of the threads inside leaves, unless someone set another meanwhile.
    Process-wide, as the interval is, and only for the ~0.3 ms of a load: the other
    threads then hand the GIL over sooner, and lose nothing else."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if _switch_saved > LOAD_SWITCH_INTERVAL:
                sys.setswitchinterval(LOAD_SWITCH_INTERVAL)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                _put_interval_back()


def _put_interval_back() -> None:
    """The interval saved by the first thread in, unless it was no longer than ours or
    someone set another meanwhile. (`getswitchinterval` gives back the interval as
    held: in microseconds.)"""
    still_ours = abs(sys.getswitchinterval() - LOAD_SWITCH_INTERVAL) < 1e-9
    if _switch_saved > LOAD_SWITCH_INTERVAL and still_ours:
        sys.setswitchinterval(_switch_saved)


def _short_waits_after_fork() -> None:
    """In a forked child: no thread of the parent's is inside `short_gil_waits` here, so
    none would put the interval back (a child forked during a load kept 0.1 ms for
    good), and its lock may have been copied held. Start over: a new lock, no thread
    inside, the interval put back as the last thread out would have."""
    global _switch_lock, _switch_users
    _switch_lock = threading.Lock()
    if _switch_users:
        _switch_users = 0
        _put_interval_back()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_short_waits_after_fork)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Let a serving process reuse the memory of freed caches instead of faulting in
    fresh pages for every restore; True if the C library took the setting.

    MLX allocates arrays with `malloc`. glibc serves an allocation above its mmap
    threshold with a fresh `mmap` and unmaps it when freed; the threshold grows with
    what a process frees, but never past 32 MiB. So every array of 32 MiB or more (one
    layer's keys of a 16k-token prompt: 1 x 4 heads x 16384 x 128 fp32) arrives as
    untouched pages, and the restore that fills it pays a page fault every 4 KiB:
    measured here, 400 MB of such arrays took ~280 ms to fill against ~28 ms once the
    memory is reused (a reopened 16k-token restore's time, almost all of it). This
    raises the threshold to `threshold` bytes and keeps freed memory in the process
    (the trim threshold to twice it): the price is a resident size that stays at its
    peak, as with most servers' allocators. Process-wide, so only a runtime calls it
    (`cas-bank serve`, `cas-bank mlx-lm-server`, the benchmarks), never the library on
    its own. A no-op (False) where the C library has no `mallopt` (not glibc).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
        raise InvalidInputError(f"threshold must be a positive int of bytes, got {threshold!r}")
    threshold = min(threshold, (1 << 31) - 1)  # mallopt takes an int
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    trim = min(2 * threshold, (1 << 31) - 1)
    return bool(ok and mallopt(_M_TRIM_THRESHOLD, trim) == 1)
