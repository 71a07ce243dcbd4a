"""Where restores spend their time: one restore's parts (`RestoreTimings`, on its
`Hit`) and a bank's running sums of them in this process (`RestoreClock`, for a
runtime's metrics). Process-local: unlike the bank's counters, nothing here persists.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestoreTimings:
    """Where one restore's time went, in seconds (`Hit.timings`).

    `lookup_s`: the chain's hashes, the index reads (headers, end records, the shared
    tier) and the lease probe. `allocate_s`: the destination arrays (with room when
    asked for; 0 for a lease handed out). `fill_s`: reading, verifying and copying the
    payloads into them (or copying a lease), and the boundary state. `total_s`: the
    whole restore, including counting, the access record and evaluating the arrays
    handed out.
    """

    lookup_s: float
    allocate_s: float
    fill_s: float
    total_s: float


@dataclass(frozen=True, slots=True)
class RestoreTotals:
    """Sums of every restore's `RestoreTimings` since the bank opened (`restores` of
    them, misses included: a miss pays its lookup)."""

    restores: int = 0
    lookup_s: float = 0.0
    allocate_s: float = 0.0
    fill_s: float = 0.0
    total_s: float = 0.0


class RestoreClock:
    """Running sums of restore timings; thread-safe (restores run on many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = RestoreTotals()

    def add(self, t: RestoreTimings) -> None:
        with self._lock:
            s = self._totals
            self._totals = RestoreTotals(
                restores=s.restores + 1,
                lookup_s=s.lookup_s + t.lookup_s,
                allocate_s=s.allocate_s + t.allocate_s,
                fill_s=s.fill_s + t.fill_s,
                total_s=s.total_s + t.total_s,
            )

    def totals(self) -> RestoreTotals:
        with self._lock:
            return self._totals
