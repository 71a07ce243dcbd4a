"""`MemoryBudget`: one byte bound shared by the bank's in-memory tiers.

The hot tier (`blocks.hot`: raw and decoded payloads, headers) and the leases
(`index.lease`: MLX arrays of stored and restored chains) each keep their entries in
least-recently-used order. Both charge the same budget (`BankConfig.hot_bytes`), so
what they hold together stays within it (each alone could take all of it, and memory
reached twice the setting). When an insert goes over, the least recently used entry
of either goes first: every use stamps its entry with a tick of this budget's one
clock, and `balance` evicts the older of the two least recently used entries until
the sum fits.

Each tier has its own lock; `balance` takes one at a time (never both), so the
bound holds once an insert returns (for a moment inside it the tier may be over by
the entry it just took).
"""

from __future__ import annotations

import itertools
import threading
from typing import Protocol


class Tenant(Protocol):
    """A tier charged against a `MemoryBudget`."""

    @property
    def used_bytes(self) -> int: ...

    def oldest_tick(self) -> int | None:
        """The tick of its least recently used entry; None when it holds nothing."""
        ...

    def evict_oldest(self) -> bool:
        """Drop its least recently used entry; False if it held none."""
        ...


class MemoryBudget:
    """At most `max_bytes` held by all tenants together (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"a memory budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._clock = itertools.count(1)
        self._tenants: list[Tenant] = []
        self._lock = threading.Lock()  # only for joining

    def tick(self) -> int:
        """A stamp for a use now (later uses get larger ones)."""
        return next(self._clock)

    def join(self, tenant: Tenant) -> None:
        with self._lock:
            self._tenants = [*self._tenants, tenant]

    @property
    def used_bytes(self) -> int:
        return sum(t.used_bytes for t in self._tenants)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` may be held at all (alone within the bound)."""
        return nbytes <= self.max_bytes

    def balance(self) -> None:
        """Evict least recently used entries, from whichever tenant holds the older
        one, until all tenants together fit. Call without holding a tenant's lock."""
        tenants = self._tenants
        while sum(t.used_bytes for t in tenants) > self.max_bytes:
            ticks = [(t.oldest_tick(), i) for i, t in enumerate(tenants)]
            ticks = [(tick, i) for tick, i in ticks if tick is not None]
            if not ticks:
                return
            if not tenants[min(ticks)[1]].evict_oldest():
                return
