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
- `gpu`: the CUDA prefetch of restored arrays, on until it fails once for this bank
  (`cas_bank.restore.gpu_prefetch`);
- `shapes`: what a restore of one spec, block size and capacity allocates and checks,
  made once (`restore.assemble`: rebuilding it cost ~0.1 ms a restore), the 64 most
  recent;
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
hold no buffers and no threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from cas_bank.restore.gpu_prefetch import GpuPrefetch
from cas_bank.restore.spares import Spares
from cas_bank.restore.workers import THREADS, Workers

_SHAPES_KEPT = 64
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
    """One bank's spares, GPU prefetch state, shape memo, scratch buffers and helper
    threads.

    `spare_bytes`: the spares' bound (0: no spares and no thread). `threads`: 2, a
    restore's loops shared with helper threads, or 1, none (default: `restore_threads()`).
    `close` stops the spares' thread and the helpers (joined) and releases every
    buffer; a closed one restores as a bank without spares or helpers does."""

    def __init__(
        self, spare_bytes: int, *, copy_ahead: bool = True, threads: int | None = None
    ) -> None:
        if threads is None:
            threads = restore_threads()
        elif threads not in (1, 2) or isinstance(threads, bool):
            raise ValueError(f"threads must be 1 or 2, got {threads!r}")
        self.spares = Spares(spare_bytes, copy_ahead=copy_ahead)
        self.gpu = GpuPrefetch()
        self.shapes = ShapeMemo()
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
        self.scratch = threading.local()  # other threads' buffers go with the old one
