"""Last-use bookkeeping: when each block and state was last used, kept cheaply.

A block's last use is the last time a store covered it (wrote it, or found it
already stored) or a restore returned it. A state's last use is the last time a
store wrote or offered it, or a restore resumed from it (its boundary was the
restore point). Times live in the `access` family, one little-endian f64 (seconds
since the epoch) per key: the chain hash for the block, the chain hash + b"s" for
its state. A store writes them for its whole chain in its own batch, so a block's
written-time is there from the start. A restore only records them in memory
(`AccessLog`); they are written in batches: riding along the next store, at most
every `access_flush_interval` seconds from a later restore, and at close. Never a
write per restore. Eviction (`evict.eviction`) orders by these times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.config import EvictionPolicy
from cas_bank.index.records import TIME, access_key, end_access_key, read_times

if TYPE_CHECKING:
    from cas_bank.evict.leaves import LeafIndex


# -- last-use bookkeeping ----------------------------------------------------------
class AccessLog:
    """Last-use times recorded in memory and handed out as batched writes.

    `enabled=False` (a read-only or secondary open) records nothing: such a bank
    cannot write, and its readers' uses are not the writer's to keep.
    """

    def __init__(
        self,
        flush_interval: float,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
        policy: EvictionPolicy,
    ) -> None:
        self.flush_interval = flush_interval
        self.enabled = enabled
        self.policy: EvictionPolicy = policy  # the order of the leaf index it builds
        self.clock = clock  # injectable: eviction-order tests use a fake clock
        self.index: LeafIndex | None = None
        self._pending: dict[bytes, float] = {}  # access key -> last use, not yet written
        self._lock = threading.Lock()
        self._last_flush = clock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Use `clock` from now on (tests order uses with a fake one); restarts the interval."""
        self.clock = clock
        self._last_flush = clock()

    def touch(
        self, blocks: Iterable[bytes], states: Iterable[bytes] = (), ends: Iterable[bytes] = ()
    ) -> None:
        """Record a use of `blocks`, of the states at the ends of `states` and of the end
        records under the parents `ends`, now."""
        if not self.enabled:
            return
        now = self.clock()
        keys = [bytes(h) for h in blocks] + [access_key(h, True) for h in states]
        keys += [end_access_key(p) for p in ends]
        with self._lock:
            for k in keys:
                self._pending[k] = now
        index = self.index
        if index is not None:
            index.touch(keys, now)

    def due(self) -> bool:
        """Whether pending uses are older than the flush interval (a restore then writes)."""
        return bool(self._pending) and self.clock() - self._last_flush >= self.flush_interval

    def drain(self) -> list[Write]:
        """Pending uses as access-family writes; they count as written from now."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush = self.clock()
        return [(Family.ACCESS, k, TIME.pack(t)) for k, t in pending.items()]

    def requeue(self, writes: Sequence[Write]) -> None:
        """Put drained uses back after their batch failed (newer uses win)."""
        with self._lock:
            for _family, key, value in writes:
                if value is not None:
                    t = TIME.unpack(value)[0]
                    if self._pending.get(key, -1.0) < t:
                        self._pending[key] = t

    def pending(self, key: bytes) -> float | None:
        return self._pending.get(key)

    def pending_items(self) -> list[tuple[bytes, float]]:
        with self._lock:
            return list(self._pending.items())

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop pending uses of evicted keys, so no access record outlives its block."""
        with self._lock:
            for k in keys:
                self._pending.pop(k, None)

    def observe(self, writes: Sequence[Write]) -> None:
        """Keep the leaf index (if built) in step with a batch just written."""
        index = self.index
        if index is not None:
            index.observe(writes)


def last_use(
    store: BlockStore, access: AccessLog, hashes: Sequence[bytes], *, states: bool = False
) -> list[float | None]:
    """Last use of each block (or of the state at its end), None where none is known.

    Uses recorded in memory (`access`) and not yet written count; no scan, one
    multi-get from `store` (`records.read_times`: one it cannot read is not known).
    """
    keys = [access_key(h, states) for h in hashes]
    out = [access.pending(k) for k in keys]
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:
        for i, t in zip(missing, read_times(store, [keys[i] for i in missing]), strict=True):
            out[i] = t
    return out
