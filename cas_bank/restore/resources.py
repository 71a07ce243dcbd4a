"""`Resources`: what one bank's restores use beside their own arrays, owned by the bank.

`Bank.open` makes one and `Bank.close` stops it; the restore path is handed it (the
`Assembler` of each restore), never a module global, so a library caller gets what a
server gets:

- `spares`: destination arrays made ahead of the next restore of the same shapes, and
  a lease restored again copied ahead into them (`cas_bank.restore.spares`,
  `restore.lease_copy`), by one background thread, started by the first refill and
  joined by `close`; at most `BankConfig.spare_bytes` (`Bank.stats().spare_held_bytes`
  says what it holds). The thread's measurements: with servers' settings, a hot
  restore with room 14.8-15.7 -> 5.0-8.8 ms, `allocate_s` 2.3-4.0 -> 0.36-0.49 ms
  (docs/measurements.md); with library defaults, a second restore in one bank of
  100 MB (fp32, 4k tokens) 69-83 -> 27-31 ms against the code before this module
  (`benchmarks.library_restore`, a loaded 2-core machine), though `spare_bytes=0`
  against the default in one process measured within noise (37.7 against 42.5 ms).
  A reopened bank starts with the spares its last session ended with: their shapes
  are kept in its meta at `close` and made by the same thread from its open on
  (`Spares.make_ahead`, `cas_bank.bank`), which took a reopened restore of that
  layout from 22.5 to 10.2 ms (the file 12.7/9.4; fresh pages faulted in were the
  difference) in the same benchmark.
- `gpu`: the CUDA prefetch of restored arrays (`GpuPrefetch`, below), on until it
  fails once for this bank;
- `shapes`: what a restore of one spec, block size and capacity allocates and checks,
  made once (`restore.assemble`: rebuilding it cost ~0.1 ms a restore), the 64 most
  recent;
- `run_tables`: the copy-run tables of small payloads kept in RocksDB
  (`restore.row_runs.RunTables`: a layout's runs of 2^k blocks at address 0, made once,
  up to 13.5 MiB for one layout of 4-bit KV at 16-token blocks and 4096 blocks), the
  most recently used within `BankConfig.run_table_bytes` (8 MiB by default;
  `Bank.stats().run_table_held_bytes` says what they hold), released by `close`;
- `scratch`: each reading thread's reused buffer of the reader without the native
  helper (`restore.file_read`);
- `workers`: the Python helper threads a restore's heavy loops share (`restore.workers`:
  the pool of the reader without the native helper, the partner of the copies of
  decoded blocks), made by the first restore that wants them and joined by `close`.
  They are off by default (`CAS_BANK_RESTORE_THREADS=1`: every loop runs on the
  restoring thread alone; 2 turns them on), because they did not earn their place.
  Measured, on against off (4k-token prompts, medians of 9-11
  interleaved rounds, a shared 2-vCPU machine, on/off in ms): with the native reader
  and payload files (the default) they never start, its own partner doing that work;
  without the native helper (`CAS_BANK_PURE_PYTHON=1`), a reopened restore tiny-qwen3
  13.4/7.5, medium-qwen3 65.1/54.0, the hot one 7.6/5.4 and 45.7/38.9; payloads in
  records (`file_min_bytes=None`), the hot restore 6.0/3.4 and 27.4/25.8. Starting them
  costs a bank ~3.3 ms once; a `together` call warm, ~5 us.

The native reader's and row copy's own partner thread (cas_bank/_native/pair.h: one a
process, started by the native module, no Python on its side) stays C-level and is not
here: it holds no bank's buffers, only the half of a call it is handed.

What stays process-wide is a runtime's choice, not the library's: glibc's `mallopt`
(`destinations.keep_freed_memory`) and MLX's allocator settings, set by the servers
(`cas_bank.runtime.process.server_settings`). Pure functions of shapes
(`functools.lru_cache`s of layouts and row templates) are memos, not resources: they
hold no threads and no buffer worth counting (measured with their keys: a row
template 11-17 KiB for medium-qwen3, 97-163 KiB for a 7B layout of 4-bit KV;
`restore.row_runs` keeps 8 of each kind, ~0.2 and ~2 MiB at most; one view's runs, at
most 192 bytes, 256 of them). The copy-run tables made from them are not memos but
`run_tables`, above.

`GpuPrefetch`: restored arrays moved to the GPU in one go, on MLX's CUDA build.

On CUDA a restore fills arrays made on MLX's CPU stream, which MLX allocates in unified
(managed) memory, through their CPU pointers (`arrays.fill_stream`): their pages are
then on the host. Left there, the first forward pass reads them on the GPU by page
faults, the driver moving a few pages at a time: on an H200 the first token after a
reopened restore came at 0.80x mlx-lm's file at medium-qwen3 4k, whose load lands in
device memory (benchmarks/RESULTS.md, "MLX's CUDA build"). `prefetch` asks the CUDA
driver to move them all at once (`cuMemPrefetchAsync`), at the link's speed, and waits
until they are there: the restore then hands out arrays already on the GPU.

Through the driver library MLX itself loads (`libcuda.so.1`, with ctypes): MLX links
the CUDA runtime statically, so there is no runtime library of its to call. The moves
go on the legacy default stream and the call waits for them; MLX's streams are
non-blocking, so MLX's own work neither waits for them nor holds them up. Best
effort: where the driver, the call or the memory does not allow it (no managed memory
on this system: MLX uses pinned host memory instead), the first failure is logged and
turns it off for the bank (each bank has its own `GpuPrefetch`, in its `Resources`);
a restore never fails for it. `CAS_BANK_GPU_PREFETCH=0` turns it off.
The driver library, loaded once, is the process's (MLX's own context).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from cas_bank import arrays
from cas_bank.config import BankConfig
from cas_bank.restore.row_runs import RunTables
from cas_bank.restore.spares import Spares
from cas_bank.restore.workers import THREADS, Workers

_SHAPES_KEPT = 64
_RUN_TABLE_BYTES: int = BankConfig.model_fields["run_table_bytes"].default
THREADS_ENV = "CAS_BANK_RESTORE_THREADS"  # 1 (default): no helper threads; 2: with them


def restore_threads() -> int:
    """The threads a restore's loops run on, the restoring one counted: 1 or 2
    (`CAS_BANK_RESTORE_THREADS`, 1 if unset); anything else is an error naming it."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw == "2":
        return 2
    if raw in ("", "1"):
        return 1
    raise ValueError(f"{THREADS_ENV} must be 1 or 2, got {raw!r}")


class ShapeMemo:
    """Values made from a key alone, the `kept` most recently used (thread-safe)."""

    def __init__(self, kept: int = _SHAPES_KEPT) -> None:
        self._kept = kept
        self._made: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value of `key`, made by `make` the first time (two threads at once may
        both make it: either is right)."""
        with self._lock:
            found = self._made.get(key)
            if found is not None:
                self._made.move_to_end(key)
                return found
        made = make()
        with self._lock:
            self._made[key] = made
            while len(self._made) > self._kept:
                self._made.popitem(last=False)
        return made

    def clear(self) -> None:
        with self._lock:
            self._made.clear()

    def __len__(self) -> int:
        return len(self._made)


class Resources:
    """One bank's spares, GPU prefetch state, shape memo, copy-run tables, scratch buffers
    and helper threads.

    `spare_bytes`: the spares' bound (0: no spares and no thread). `threads`: 2, a
    restore's loops shared with helper threads, or 1, none (default: `restore_threads()`).
    `run_table_bytes`: the copy-run tables' bound (0: made for each restore, none kept).
    `close` stops the spares' thread and the helpers (joined) and releases every
    buffer; a closed one restores as a bank without spares or helpers does."""

    def __init__(
        self,
        spare_bytes: int,
        *,
        copy_ahead: bool = True,
        threads: int | None = None,
        run_table_bytes: int = _RUN_TABLE_BYTES,
    ) -> None:
        if threads is None:
            threads = restore_threads()
        elif threads not in (1, 2) or isinstance(threads, bool):
            raise ValueError(f"threads must be 1 or 2, got {threads!r}")
        self.spares = Spares(spare_bytes, copy_ahead=copy_ahead)
        self.gpu = GpuPrefetch()
        self.shapes = ShapeMemo()
        self.run_tables = RunTables(run_table_bytes)
        self.scratch = threading.local()
        self.threads = threads
        self._workers: Workers | None = None
        self._making = threading.Lock()
        self.closed = False

    @property
    def workers(self) -> Workers:
        """The helper threads (`restore.workers`), this object made by the first call,
        their threads by the first loop that shares its work; once closed, none (every
        loop runs on its caller)."""
        workers = self._workers
        if workers is None:
            with self._making:
                if self._workers is None:
                    helpers = THREADS if self.threads > 1 and not self.closed else 0
                    self._workers = Workers(helpers)
                workers = self._workers
        return workers

    @property
    def held_bytes(self) -> int:
        """Bytes of arrays held now for later restores (spares and copies ahead)."""
        return self.spares.bytes

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Around a restore that the caller's forward pass follows: its refill waits
        for `release` (`Spares.holding`)."""
        with self.spares.holding():
            yield

    def release(self) -> None:
        """The caller's forward pass is done: a held refill starts."""
        self.spares.release()

    def settle(self) -> None:
        """Release, and wait until every refill asked for is made (tests, benchmarks)."""
        self.spares.settle()

    def close(self) -> None:
        """Stop the spares' thread and the helpers (joined) and release the buffers.
        Idempotent."""
        self.closed = True
        with self._making:
            workers = self._workers
        if workers is not None:
            workers.close()
        self.spares.close()
        self.shapes.clear()
        self.run_tables.clear()
        self.scratch = threading.local()  # other threads' buffers go with the old one


log = logging.getLogger("cas_bank")

PREFETCH_ENV = "CAS_BANK_GPU_PREFETCH"
"""Set to `0`: restored arrays stay where the CPU filled them (the GPU faults them in)."""

_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


class _Location(ctypes.Structure):
    """CUmemLocation: where `cuMemPrefetchAsync_v2` moves the pages."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The few CUDA driver calls a prefetch makes, on device `ordinal`."""

    def __init__(self, lib: ctypes.CDLL, ordinal: int) -> None:
        self.lib = lib
        self.ordinal = ordinal
        self.device = ctypes.c_int()
        self._check(lib.cuInit(0), "cuInit")
        self._check(lib.cuDeviceGet(ctypes.byref(self.device), ordinal), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.device),
            "cuDevicePrimaryCtxRetain",
        )
        self._v2 = getattr(lib, "cuMemPrefetchAsync_v2", None)
        if self._v2 is not None:
            self._v2.argtypes = [
                ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p,
            ]  # fmt: skip
        else:  # a driver before CUDA 12.2: (pointer, bytes, device, stream)
            lib.cuMemPrefetchAsync.argtypes = [
                ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
            ]  # fmt: skip

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise OSError(f"{call} returned CUDA error {code}")

    def prefetch(self, runs: Sequence[tuple[int, int]]) -> None:
        """Move each (address, bytes) run to the device and wait until they are there."""
        lib = self.lib
        # The calling thread may never have made a CUDA call: MLX's primary context.
        self._check(lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        where = _Location(_LOCATION_DEVICE, self.ordinal)
        for address, size in runs:
            if self._v2 is not None:
                code = self._v2(address, size, where, 0, None)
            else:
                code = lib.cuMemPrefetchAsync(address, size, self.device, None)
            self._check(code, "cuMemPrefetchAsync")
        self._check(lib.cuStreamSynchronize(None), "cuStreamSynchronize")


@functools.cache
def _driver() -> _Driver | None:
    """The driver on MLX's default GPU; None where it cannot be loaded (logged)."""
    import mlx.core as mx

    # MLX's Device shows its index only in its repr: "Device(gpu, 0)".
    found = re.search(r"(\d+)\)$", repr(mx.default_device()))
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"), int(found.group(1)) if found else 0)
    except (OSError, AttributeError) as e:
        log.warning("cas_bank: restored arrays stay in host memory (no CUDA prefetch): %s", e)
        return None


class GpuPrefetch:
    """One bank's prefetch of restored arrays: on until it fails once (logged)."""

    def __init__(self) -> None:
        self.failed = False
        self._lock = threading.Lock()

    def prefetcher(self) -> Callable[[Sequence[tuple[int, int]]], None] | None:
        """`prefetch` where it applies (MLX's CUDA build, not turned off), else None."""
        if self.failed or os.environ.get(PREFETCH_ENV, "") == "0":
            return None
        return self.prefetch if arrays.mlx_backend() == "cuda" else None

    def prefetch(self, runs: Sequence[tuple[int, int]]) -> None:
        """Move the (address, bytes) runs of unified memory to MLX's GPU, waiting for
        them; nothing once a prefetch failed here, or the driver could not be loaded
        (the first failure is logged; `prefetcher` then answers None)."""
        driver = None if self.failed else _driver()
        if driver is None:
            self.failed = True
            return
        if not runs:
            return
        try:
            with self._lock:
                driver.prefetch(runs)
        except OSError as e:
            self.failed = True
            log.warning("cas_bank: CUDA prefetch of restored arrays turned off: %s", e)
