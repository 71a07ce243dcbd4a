"""The store interface every backend meets, and `MemoryStore`, the plain-dict one.

A store holds raw bytes under byte keys in a few named families (docs/design.md, "Record
families"). It knows nothing of blocks or chains: the index above it does. Cross-cutting
concerns (the hot tier) wrap a store and meet the same interface. What a backend must do is
written on `BlockStore` and checked by `cas_bank.testing` (run it on a new backend).

What the bank relies on from `put_batch`
-----------------------------------------
- Every write of the batch applies, in order (a later write of a key wins), and is
  readable by this process once `put_batch` returns; it is durable as the store's
  own durability says (RocksDB `wal`: it survives a crash).
- A store that declares `Capability.ATOMIC_BATCHES` (RocksDB, `MemoryStore`, and
  `HotStore` over either) applies a batch whole or not at all, across families:
  readers never see part of it, a crash keeps all or none of it, and a batch that
  raises applied nothing. The bank's transactions assume this to undo their
  in-memory effects exactly.
- A store without it (a remote or file tier that cannot write across families
  atomically) must apply a batch in the phases of `batch_phases`, each whole before
  the next starts: (1) puts of payloads, states and namespace records, (2) header
  writes, (3) deletes of payloads and states, (4) the rest (counters, last uses).
  So no reader and no crash ever sees a header without the payload and state it
  names: lookups and restores stay correct. A batch cut part-way (a crash, or a
  raise after a phase landed) leaves what a crash leaves: payloads no header claims
  (`verify --fix` removes them), counters that disagree with the headers (`verify`
  reports them), last uses lost (counted as used at time 0). Reopen the bank after
  such a failure: its in-memory counters assume the batch failed whole.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from types import TracebackType

from cas_bank.errors import CorruptDataError


class Family(str, Enum):
    """Kinds of record, one RocksDB column family each."""

    META = "meta"
    NAMESPACES = "namespaces"
    HEADERS = "headers"
    BLOCKS = "blocks"
    STATES = "states"
    ACCESS = "access"
    ENDS = "ends"
    EVICTED = "evicted"
    CHILDREN = "children"
    CHAINS = "chains"
    PREFIXES = "prefixes"


PAYLOAD_FAMILIES = (Family.BLOCKS, Family.STATES)

Write = tuple[Family, bytes, bytes | None]
"""One write of a batch: (family, key, value), a value of None deletes the key."""


class Capability(str, Enum):
    """What a store can do beyond the required interface; it declares these in
    `BlockStore.capabilities` (callers ask there, never look at its class)."""

    ATOMIC_BATCHES = "atomic_batches"
    """`put_batch` applies whole or not at all, across families (see the module)."""
    FLUSH = "flush"
    """`flush()` makes everything written so far durable now."""
    COMPACT = "compact"
    """`compact()` gives the space of deleted records back (to the disk)."""
    DISK_BYTES = "disk_bytes"
    """`disk_bytes()` says how many bytes the store takes (else it returns None)."""
    READ_ONLY = "read_only"
    """It can be opened read-only (a frozen view) beside a live writer."""
    SECONDARY = "secondary"
    """It can be opened as a follower of a live writer; `refresh()` catches up."""


def batch_phases(writes: Sequence[Write]) -> list[list[Write]]:
    """`writes` in the phases a store without atomic batches applies one after the
    other (see the module): payload, state and namespace puts; header writes;
    payload and state deletes; the rest. Order within a phase is kept."""
    phases: list[list[Write]] = [[], [], [], []]
    for w in writes:
        family, _, value = w
        if family is Family.HEADERS:
            phases[1].append(w)
        elif family in PAYLOAD_FAMILIES or family is Family.NAMESPACES:
            phases[0 if value is not None else 2].append(w)
        else:
            phases[3].append(w)
    return [p for p in phases if p]


class BlockStore(ABC):
    """Bytes under keys, in families; thread-safe (any thread may read or write).

    Required: `get_many`, `put_batch` (see the module for what it promises),
    `iterate` (key order: bytes compared as unsigned; a walk may or may not see
    writes made during it), `close` (idempotent; afterwards every call raises
    `RuntimeError` naming the store closed). Optional, as `capabilities` declares:
    `flush`, `compact`, `disk_bytes`, `refresh`, and opening read-only or as a
    secondary (`cas_bank.blocks.backends.open_store`). A store opened read-only or as
    a secondary sets `read_only` and refuses `put_batch` with `RuntimeError`.
    """

    read_only: bool = False
    capabilities: frozenset[Capability] = frozenset()

    @property
    def location(self) -> str:
        """Where the store lives, for messages (a path, a URL)."""
        return type(self).__name__

    @abstractmethod
    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of `keys` in order, None where a key is absent."""

    def get(self, family: Family, key: bytes) -> bytes | None:
        return self.get_many(family, [key])[0]

    @abstractmethod
    def put_batch(self, writes: Sequence[Write]) -> None:
        """Apply every write; atomically if the store declares `ATOMIC_BATCHES`, else
        in `batch_phases` order (the module says what the bank relies on)."""

    @abstractmethod
    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs in key order; with `values=False` the value is b""."""

    def keys(self, family: Family) -> Iterator[bytes]:
        for k, _ in self.iterate(family, values=False):
            yield k

    def prefixed(self, family: Family, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The (key, value) pairs whose keys start with `prefix`, in key order. This
        walks the family from its start; a backend that can seek overrides it."""
        for k, v in self.iterate(family):
            if k.startswith(prefix):
                yield k, v
            elif k > prefix:
                return

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The pairs next to `key` (which starts with `prefix`) among those whose keys
        start with `prefix`: the last one before it and the first one at or after it
        (0 to 2 pairs, in key order).
        A backend that can seek overrides it (two positionings, however many records)."""
        below: tuple[bytes, bytes] | None = None
        for k, v in self.prefixed(family, prefix):
            if k >= key:
                return [p for p in (below, (k, v)) if p is not None]
            below = (k, v)
        return [below] if below is not None else []

    def readable(
        self,
        family: Family,
        *,
        values: bool = True,
        damaged: Callable[[CorruptDataError], object] | None = None,
    ) -> Iterator[tuple[bytes, bytes]]:
        """`iterate` as far as the store can read: a walk that a damaged file ends
        (`CorruptDataError`) ends there, and `damaged` is told why. For what can go on
        without the rest (eviction, salvage, finding keys to read one by one)."""
        try:
            yield from self.iterate(family, values=values)
        except CorruptDataError as e:
            if damaged is not None:
                damaged(e)

    def get_parsed(
        self,
        family: Family,
        keys: Sequence[bytes],
        parse: Callable[[bytes, bytes], object | None],
    ) -> tuple[list[bytes | None], list[object | None]]:
        """`get_many` of `keys`, and `parse(key, value)` of each value found (None where
        absent, or where `parse` could not read it and returned None). `parse` must make
        an immutable object of the value alone: a store that keeps values in memory
        (`blocks.hot`) keeps it beside the value and parses a value once while it is
        kept (a write of the key drops both); the rest parse every read."""
        raws = self.get_many(family, keys)
        parsed = [None if raw is None else parse(k, raw) for k, raw in zip(keys, raws, strict=True)]
        return raws, parsed

    def refresh(self) -> None:
        """Catch up with the writer (secondary opens); a no-op elsewhere."""
        return None

    def flush(self) -> None:
        """Make everything written durable now (`Capability.FLUSH`); else a no-op."""
        return None

    def compact(self) -> None:
        """Give deleted records' space back (`Capability.COMPACT`); else a no-op."""
        return None

    def disk_bytes(self) -> int | None:
        """Bytes the store takes on disk (`Capability.DISK_BYTES`); else None."""
        return None

    def degraded(self) -> str | None:
        """Why writes are refused right now (a full disk), or None: reads still work."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release everything; the store is unusable afterwards."""

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class MemoryStore(BlockStore):
    """A dict per family: the reference model in tests, and a throwaway bank."""

    capabilities = frozenset({Capability.ATOMIC_BATCHES})

    def __init__(self) -> None:
        self._data: dict[Family, dict[bytes, bytes]] = {f: {} for f in Family}
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")

    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        self._check()
        d = self._data[family]
        with self._lock:  # a batch is applied under the lock: never seen half-done
            return [d.get(k) for k in keys]

    def put_batch(self, writes: Sequence[Write]) -> None:
        self._check()
        with self._lock:
            for family, key, value in writes:
                if value is None:
                    self._data[family].pop(key, None)
                else:
                    self._data[family][bytes(key)] = bytes(value)

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        self._check()
        with self._lock:
            items = sorted(self._data[family].items())
        for k, v in items:
            yield k, (v if values else b"")

    @property
    def location(self) -> str:
        return "memory"

    def close(self) -> None:
        self._closed = True
