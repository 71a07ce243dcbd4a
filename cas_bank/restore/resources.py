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
  helper (`restore.file_read`).

What stays process-wide is a runtime's choice, not the library's: glibc's `mallopt`
(`destinations.keep_freed_memory`) and MLX's allocator settings, set by the servers
(`cas_bank.runtime.process.server_settings`). Pure functions of shapes
(`functools.lru_cache`s of layouts and row templates) are memos, not resources: they
hold no buffers and no threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from cas_bank.restore.gpu_prefetch import GpuPrefetch
from cas_bank.restore.spares import Spares

_SHAPES_KEPT = 64


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
    """One bank's spares, GPU prefetch state, shape memo and scratch buffers.

    `spare_bytes`: the spares' bound (0: no spares and no thread). `close` stops the
    spares' thread (joined) and releases every buffer; a closed one restores as a
    bank without spares does."""

    def __init__(self, spare_bytes: int, *, copy_ahead: bool = True) -> None:
        self.spares = Spares(spare_bytes, copy_ahead=copy_ahead)
        self.gpu = GpuPrefetch()
        self.shapes = ShapeMemo()
        self.scratch = threading.local()
        self.closed = False

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
        """Stop the spares' thread (joined) and release the buffers. Idempotent."""
        self.closed = True
        self.spares.close()
        self.shapes.clear()
        self.scratch = threading.local()  # other threads' buffers go with the old one
