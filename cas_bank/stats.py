"""Counters of a bank: what is stored (kept exact with every write batch) and what
happened (hits, misses, corrupt reads), persisted in the meta family so that tools
see them after the writer is gone. Loading them is a few gets: no scan at open.

Where restores spend their time: one restore's parts (`RestoreTimings`, on its `Hit`)
and a bank's running sums of them in this process (`RestoreClock`, for a runtime's
metrics). Process-local: unlike the bank's counters, nothing of them persists.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from cas_bank.blocks.store import BlockStore, Family, Write

_PREFIX = b"counter/"
_U64 = struct.Struct("<Q")
ROOT_PREFIX = b"counter/root/"
"""Per-namespace hit counters (a tenant's are its roots', `evict.tenants`): the key
`counter/root/<root hex>/hits` or `.../hit_tokens`, a `<u8` like every counter."""
ROOT_NAMES = ("hits", "hit_tokens")

STORED = (
    "blocks",
    "states",
    "payload_bytes",
    "state_bytes",
    "logical_tokens",
    "ends",
    "end_bytes",
)
REMOTE = (
    "remote_hits",
    "remote_hit_blocks",
    "remote_hit_tokens",
    "remote_bytes_fetched",
    "remote_publishes",
    "remote_published_bytes",
    "remote_dropped",
    "remote_errors",
    "remote_timeouts",
    "remote_skipped",
    "remote_rejected",
    "remote_adopted_blocks",
    "remote_adopt_dropped",
)
"""Counters of the shared (Valkey) tier; zero on a bank that never had one."""
ACTIVITY = (
    "stores",
    "restores",
    "hits",
    "misses",
    "queried_tokens",
    "hit_tokens",
    "hot_hits",
    "blocks_written",
    "blocks_deduplicated",
    "states_written",
    "blocks_evicted",
    "states_evicted",
    "bytes_evicted",
    "corrupt_reads",
    "bytes_written",
    "blocks_deferred",
    "ends_written",
    "ends_evicted",
    "exact_hits",
    "end_hits",
    "partial_hits",
    "partial_tokens",
    "live_hits",
    *REMOTE,
)
NAMES = STORED + ACTIVITY


class BankStats(BaseModel):
    """A snapshot of a bank's counters (`Bank.stats()`)."""

    model_config = ConfigDict(frozen=True)

    block_size: int
    namespaces: int
    blocks: int
    states: int
    payload_bytes: int
    state_bytes: int
    logical_tokens: int  # full-block tokens of every store (found or written), and of
    # the blocks imports added (a repeated import adds none)
    unique_tokens: int
    stores: int
    restores: int
    hits: int
    misses: int
    queried_tokens: int
    hit_tokens: int
    hot_hits: int
    blocks_written: int
    blocks_deduplicated: int
    states_written: int
    blocks_evicted: int
    states_evicted: int
    bytes_evicted: int
    corrupt_reads: int
    bytes_written: int = 0  # payload and state bytes written by stores
    blocks_deferred: int = 0  # new blocks a store left out (BankConfig.admit)
    ends: int = 0  # end records stored (index.ends)
    end_bytes: int = 0  # their bytes (headers and payloads)
    ends_written: int = 0
    ends_evicted: int = 0
    exact_hits: int = 0  # restores that covered the whole prompt from an end record
    end_hits: int = 0  # restores that resumed from an end record short of the prompt's end
    partial_hits: int = 0  # restores that took the first tokens of a partial block
    partial_tokens: int = 0  # tokens restored from partial blocks (in hit_tokens too)
    live_hits: int = 0  # restores that took a conversation's live cache back, no copy
    disk_bytes: int | None = None
    # Memory of this process (not persisted): what the hot tier and the leases hold now,
    # and the one bound they share (BankConfig.hot_bytes).
    hot_tier_bytes: int = 0
    leased_bytes: int = 0
    live_bytes: int = 0  # of leased_bytes: conversations' live caches (`index.lease`)
    hot_bytes: int = 0
    # Destination arrays made ahead of the next restores, held now, and their bound
    # (BankConfig.spare_bytes).
    spare_held_bytes: int = 0
    spare_bytes: int = 0
    # The copy-run tables of small payloads kept now, and their bound
    # (BankConfig.run_table_bytes).
    run_table_held_bytes: int = 0
    run_table_bytes: int = 0
    remote: str | None = None  # the shared tier's URL (password hidden), when open with one
    remote_hits: int = 0  # restores that took at least one block from the shared tier
    remote_hit_blocks: int = 0
    remote_hit_tokens: int = 0
    remote_bytes_fetched: int = 0  # entries read from the shared tier (headers, payloads)
    remote_publishes: int = 0  # blocks and states written to the shared tier
    remote_published_bytes: int = 0
    remote_dropped: int = 0  # publishes dropped because the queue was full
    remote_errors: int = 0
    remote_timeouts: int = 0
    remote_skipped: int = 0  # calls not made while the circuit breaker was open
    remote_rejected: int = 0  # entries whose MAC, digest or chain link failed
    remote_adopted_blocks: int = 0  # fetched blocks written into this bank
    remote_adopt_dropped: int = 0

    @property
    def dedup_ratio(self) -> float:
        """Logical tokens stored per unique token kept (1.0 when nothing is shared)."""
        return self.logical_tokens / self.unique_tokens if self.unique_tokens else 1.0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that were restored."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def stored_bytes(self) -> int:
        """Bytes of stored payloads, states and end records together."""
        return self.payload_bytes + self.state_bytes + self.end_bytes


class Counters:
    """Thread-safe counters and the values last persisted.

    Two ways to change them: `count` for activity a read observes (restores, hits,
    corrupt reads: no batch of its own, persisted with the next transaction), and a
    transaction (`write.txn.Transaction`), the only writer of the stored-content
    counters: it `stage`s the records its batch carries and, once the batch is
    written, `commit`s its deltas. A failed batch changes nothing.
    """

    def __init__(self, store: BlockStore) -> None:
        self._lock = threading.Lock()
        self._store = store
        self._values = dict.fromkeys(NAMES, 0)
        self._persisted = dict.fromkeys(NAMES, 0)
        # Per-namespace hits (`root_hit`): by counter name (`root_name`), read with the
        # others (one prefix seek of `meta`: a few per namespace), so that a restore's
        # count reads nothing (a hot restore reads nothing below the hot tier).
        self._roots: dict[str, int] = {}
        self._names: dict[bytes, tuple[str, str]] = {}  # a root's two counter names
        self.reload(store)

    def reload(self, store: BlockStore) -> None:
        raw = store.get_many(Family.META, [_PREFIX + n.encode() for n in NAMES])
        roots = {
            key[len(_PREFIX) :].decode(errors="replace"): _U64.unpack(value)[0]
            for key, value in store.prefixed(Family.META, ROOT_PREFIX)
            if len(value) == _U64.size
        }
        with self._lock:
            for name, value in zip(NAMES, raw, strict=True):
                self._values[name] = _U64.unpack(value)[0] if value else 0
            self._persisted = dict(self._values) | roots
            self._roots = dict(roots)
            self._store = store

    def root_hit(self, root: bytes, tokens: int) -> None:
        """A restore in the namespace `root` that covered `tokens` (0: a miss, not
        counted). Reads nothing."""
        if tokens <= 0:
            return
        names = self._names.get(root)
        if names is None:
            names = (root_name(root, ROOT_NAMES[0]), root_name(root, ROOT_NAMES[1]))
            self._names[bytes(root)] = names
        with self._lock:
            for name, d in ((names[0], 1), (names[1], tokens)):
                if name not in self._roots:  # its first hit ever (else read at load)
                    self._roots[name] = self._persisted[name] = 0
                self._roots[name] += d

    def root_hits(self, store: BlockStore) -> dict[bytes, tuple[int, int]]:
        """Hits and hit tokens by namespace root: the persisted ones (a walk of `meta`)
        with this process's on top."""
        values: dict[str, int] = {}
        for key, raw in store.iterate(Family.META):
            if key.startswith(ROOT_PREFIX) and len(raw) == _U64.size:
                values[key[len(_PREFIX) :].decode(errors="replace")] = _U64.unpack(raw)[0]
        with self._lock:
            values.update(self._roots)
        out: dict[bytes, tuple[int, int]] = {}
        for root_hex in {n.split("/")[1] for n in values if n.count("/") == 2}:
            try:
                root = bytes.fromhex(root_hex)
            except ValueError:
                continue
            out[root] = (
                values.get(root_name(root, "hits"), 0),
                values.get(root_name(root, "hit_tokens"), 0),
            )
        return out

    def count(self, **deltas: int) -> None:
        """Add to activity counters (only those: stored content changes in transactions)."""
        stored = set(deltas) - set(ACTIVITY)
        if stored:
            raise ValueError(f"{sorted(stored)} change only in a transaction")
        with self._lock:
            for name, d in deltas.items():
                self._values[name] = max(0, self._values[name] + d)

    def stage(self, deltas: Mapping[str, int]) -> dict[str, int]:
        """The values, `deltas` applied, of every counter that differs from its persisted
        value: what a batch carries. Changes nothing."""
        with self._lock:
            after = {n: max(0, v + deltas.get(n, 0)) for n, v in self._values.items()}
            after.update(self._roots)
            return {n: v for n, v in after.items() if v != self._persisted[n]}

    def commit(self, deltas: Mapping[str, int], written: Mapping[str, int]) -> None:
        """After a batch carrying `written` (from `stage`) was written: apply `deltas`."""
        with self._lock:
            for name, d in deltas.items():
                self._values[name] = max(0, self._values[name] + d)
            self._persisted.update(written)

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def root_name(root: bytes, name: str) -> str:
    """The counter name of `name` (`ROOT_NAMES`) for the namespace `root`."""
    return f"root/{bytes(root).hex()}/{name}"


def counter_writes(values: Mapping[str, int]) -> list[Write]:
    """The meta records that persist `values` (name -> value)."""
    return [(Family.META, _PREFIX + n.encode(), _U64.pack(v)) for n, v in values.items()]


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
