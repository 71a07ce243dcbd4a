"""The hot tier: a byte-bounded, in-process LRU cache in front of any `BlockStore`, and
the byte budget it shares with the leases.

A wrapper store (docs/design.md, "Store interface and put_batch promise": cross-cutting
concerns wrap a store, they are not flags inside a backend). It caches the families a
restore reads: headers, block payloads, states, end records and chain records, and
remembers the end-record and chain-record keys it found absent (a restore looks up a
few candidates that mostly do not exist; a write of such a key drops the absence). A
restore of a prefix whose records and payloads are all hot reads nothing from the
store below.

Two levels per entry:
- the raw value (what `get_many` returns), filled on a read miss and on every put
  (write-through: a chain just stored is the chain most likely restored next);
- a decoded, digest-checked view of a payload (`lookup` / `keep_decoded`), so a hot
  hit skips both the read and the blake3 check. The views alias the immutable raw
  `bytes`, so they cost no memory beyond it (a compressed payload's inflated body
  is counted on top); and a parsed header (`get_parsed`): a hot restore
  of a 16k-token chain decoded 256 headers, 0.75 ms of Python, on every restore.
  Both are tied to the raw value they came from (the same object): a write of the
  key replaces that object, and what was made of the old one is never returned.

An end record the file tier keeps as a file is held by its head instead (`record_heads`:
its `PayloadFile`, the file named and its first 4 KiB, or its whole header where that
is longer): its write caches the head, and one cached whole by a `get_many` of a key
not held is turned into its head by the next `record_heads`. An end record's lookup
learns its header, and so the name of its lease, from the head, and a lease holds its
arrays decoded (`index.ends.stored_end`); held whole as well, a medium hybrid's end
record (4.9 MB at 1k tokens) was charged twice. A `get_many` of a key held by its
head reads it below and leaves the head in place.

Coherence: every write goes through `put_batch`, which drops the cached entries of
its keys, updates the inner store, and then caches the values it put. A read that
missed the cache inserts what it read only if no write touched a cached family in
the meantime and none is being applied (a generation counter and a count of writes
in flight), so a value read before a delete can never be cached after it, and while
a batch is applied its keys are read from the inner store: a reader sees all of the
batch or none of it whenever the inner store does. `refresh` (a secondary following
its writer) drops everything.

`MemoryBudget`: one byte bound shared by the bank's in-memory tiers.

The hot tier (raw and decoded payloads, headers) and the leases
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
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from cas_bank.blocks.codec import Decoded
from cas_bank.blocks.files import FileTier, PayloadFile
from cas_bank.blocks.store import BlockStore, Family, Write

CACHED_FAMILIES = frozenset(
    {Family.HEADERS, Family.BLOCKS, Family.STATES, Family.ENDS, Family.CHAINS, Family.PREFIXES}
)
# Families whose absent keys are remembered too: a restore looks up end records and
# chain and prefix records that mostly do not exist, and a hot restore must not read below
# (dropped by any write).
NEGATIVE_FAMILIES = frozenset({Family.ENDS, Family.CHAINS, Family.PREFIXES})
_ENTRY_OVERHEAD = 160  # bytes of bookkeeping per entry (key, tuple, slots object), roughly
# Answers of `around` on the children index kept (a restore seeks it once: a hot
# restore must not read below either); any write to that family drops them all.
AROUND_ENTRIES = 1024


@dataclass(slots=True)
class _Entry:
    raw: bytes
    size: int  # bytes charged against the bound
    tick: int  # the budget's clock at its last use (`blocks.hot.MemoryBudget`)
    decoded: Decoded | None = None
    digest: bytes | None = None  # the digest `decoded` was verified against
    absent: bool = False  # a remembered absence (NEGATIVE_FAMILIES): the key is not stored
    parsed: object | None = None  # what `get_parsed` made of `raw` (a decoded header)
    head: PayloadFile | None = None  # a record kept as a file, held by its head (`raw` empty)


class HotStore(BlockStore):
    """An LRU of at most `max_bytes` over `inner`'s headers, blocks, states and end
    records (and the end-record keys found absent), and the children index's recent
    `around` answers. `budget`: a `MemoryBudget` of `max_bytes` shared with other
    tiers (the bank's leases); its own by default."""

    def __init__(
        self, inner: BlockStore, max_bytes: int, *, budget: MemoryBudget | None = None
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"hot tier size must be >= 0 bytes, got {max_bytes}")
        self.inner = inner
        self._files = inner if isinstance(inner, FileTier) else None  # `record_heads`
        self.max_bytes = max_bytes
        self.budget = budget if budget is not None else MemoryBudget(max_bytes)
        self.budget.join(self)
        self.read_only = inner.read_only
        self.capabilities = inner.capabilities  # atomic over an atomic store (put_batch)
        self._entries: OrderedDict[tuple[Family, bytes], _Entry] = OrderedDict()
        self._bytes = 0
        self._generation = 0  # bumped by every write that touches a cached family
        self._writing = 0  # batches being applied below: nothing read meanwhile is cached
        self._around: OrderedDict[tuple[bytes, bytes], list[tuple[bytes, bytes]]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # raw lookups served from memory
        self.misses = 0  # raw lookups passed to the inner store

    # -- the decoded level ---------------------------------------------------------
    def lookup(self, family: Family, key: bytes, expected: bytes) -> Decoded | bytes | None:
        """A hot payload without touching the inner store: its verified arrays if it
        was decoded against `expected` before, else its raw bytes (to be verified),
        else None (not hot)."""
        with self._lock:
            entry = self._entries.get((family, key))
            if entry is None or entry.absent or entry.head is not None:
                return None
            self._use((family, key), entry)
            self.hits += 1
            if entry.decoded is not None and entry.digest == expected:
                return entry.decoded
            return entry.raw

    def keep_decoded(
        self, family: Family, key: bytes, raw: bytes, expected: bytes, block: Decoded
    ) -> None:
        """Remember `block`, decoded from `raw` and verified against `expected`.

        Kept only if `raw` is still the cached value of `key` (the same object): a
        write or an eviction in between wins.
        """
        with self._lock:
            entry = self._entries.get((family, key))
            if entry is None or entry.raw is not raw:
                return
            extra = _inflated_bytes(block)
            entry.decoded, entry.digest = block, expected
            entry.size += extra
            self._bytes += extra
            self._use((family, key), entry)
        self.budget.balance()

    # -- BlockStore ----------------------------------------------------------------
    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        if family not in CACHED_FAMILIES:
            return self.inner.get_many(family, keys)
        return self._read(family, keys, None)[0]

    def get_parsed(
        self,
        family: Family,
        keys: Sequence[bytes],
        parse: Callable[[bytes, bytes], object | None],
    ) -> tuple[list[bytes | None], list[object | None]]:
        """`BlockStore.get_parsed` in one pass: a cached value's parse is kept with it
        (charged as a second copy of the value: a header's fields are slices of it),
        so a hot restore of a 16k-token chain does not decode its 256 headers again,
        and a reopened one caches each header read below with its parse."""
        if family not in CACHED_FAMILIES:
            return super().get_parsed(family, keys, parse)
        return self._read(family, keys, parse)

    def _read(
        self,
        family: Family,
        keys: Sequence[bytes],
        parse: Callable[[bytes, bytes], object | None] | None,
    ) -> tuple[list[bytes | None], list[object | None]]:
        """The values of `keys` of a cached family, from memory where held, else read
        below and cached (unless a write came in between); with `parse`, each value's
        parse too, made once and kept with it."""
        n = len(keys)
        raws: list[bytes | None] = [None] * n
        out: list[object | None] = [None] * n
        missing: list[int] = []
        through: list[int] = []  # held by their heads only: read below, not cached whole
        unparsed: list[int] = []  # cached, not parsed yet
        with self._lock:
            generation = self._generation
            for i, key in enumerate(keys):
                k = (family, key)
                entry = self._entries.get(k)
                if entry is None or entry.head is not None:
                    (missing if entry is None else through).append(i)
                    continue
                self._use(k, entry)
                if not entry.absent:
                    raws[i] = entry.raw
                    if entry.parsed is not None:
                        out[i] = entry.parsed
                    elif parse is not None:
                        unparsed.append(i)
            self.hits += n - len(missing) - len(through)
            self.misses += len(missing) + len(through)
        if not missing and not unparsed and not through:
            return raws, out
        if missing or through:
            below = [*missing, *through]
            got = self.inner.get_many(family, [keys[i] for i in below])
            for i, value in zip(below, got, strict=True):
                raws[i] = value if value is None or type(value) is bytes else bytes(value)
        if parse is not None:
            for i in (*unparsed, *missing, *through):
                raw = raws[i]
                if raw is not None:
                    out[i] = parse(keys[i], raw)
        with self._lock:
            # A write since our look may have replaced or deleted what we just read.
            if missing and generation == self._generation and not self._writing:
                made = [out[i] for i in missing] if parse is not None else None
                self._insert_read(
                    family, [keys[i] for i in missing], [raws[i] for i in missing], made
                )
            for i in unparsed:
                self._keep_parsed((family, keys[i]), raws[i], out[i])
        self.budget.balance()
        return raws, out

    # -- records kept as files, held by their heads ----------------------------------
    def record_heads(
        self, family: Family, keys: Sequence[bytes]
    ) -> list[bytes | PayloadFile | None]:
        """`FileTier.record_heads` through this tier: a record kept as a file is held here
        by its head (its `PayloadFile`, with its first bytes), not whole, so an end record
        whose arrays a lease holds decoded is not charged twice (4.9 MB each for a
        medium hybrid's at 1k tokens: `index.ends.stored_end`). One held whole (cached by
        a write or a `get_many`) is answered whole this once, then held by its head
        where its file is there."""
        if family not in CACHED_FAMILIES:
            return record_heads(self.inner, family, keys)
        n = len(keys)
        out: list[bytes | PayloadFile | None] = [None] * n
        missing: list[int] = []
        whole: list[int] = []  # held whole and large enough to be a file
        with self._lock:
            generation = self._generation
            for i, key in enumerate(keys):
                k = (family, key)
                entry = self._entries.get(k)
                if entry is None:
                    missing.append(i)
                    continue
                self._use(k, entry)
                if not entry.absent:
                    out[i] = entry.head if entry.head is not None else entry.raw
                    if entry.head is None and self._may_be_file(family, len(entry.raw)):
                        whole.append(i)
            self.hits += n - len(missing)
            self.misses += len(missing)
        if missing:
            got = record_heads(self.inner, family, [keys[i] for i in missing])
            for i, value in zip(missing, got, strict=True):
                out[i] = value
        heads = [(i, self._head_of(family, keys[i], out[i])) for i in whole]
        with self._lock:
            if generation == self._generation and not self._writing:
                self._insert_heads(family, [keys[i] for i in missing], [out[i] for i in missing])
                for i, head in heads:
                    if head is not None:
                        self._hold_by_head((family, keys[i]), out[i], head)
        self.budget.balance()
        return out

    def _may_be_file(self, family: Family, size: int) -> bool:
        """Whether `family`'s record of `size` bytes is an end record kept as a file (a
        block's or state's payload file is held whole: the hot tier serves payloads)."""
        files = self._files
        return (
            family is Family.ENDS
            and files is not None
            and files.keeps_files(family)
            and files.stores_as_file(size)
        )

    def _head_of(self, family: Family, key: bytes, raw: object) -> PayloadFile | None:
        """`raw`'s head, where the file tier keeps it as a file and the file is there (a
        file is named by the record's digest: what it holds is `raw`)."""
        assert self._files is not None and isinstance(raw, bytes)
        head = self._files.head_of(family, key, raw)
        return head if head is not None and os.path.exists(head.path) else None

    def _insert_heads(
        self, family: Family, keys: list[bytes], values: list[bytes | PayloadFile | None]
    ) -> None:
        """Cache what `record_heads` read below: heads as head entries, the rest as
        `_insert_read` does. Under the lock."""
        filed = [i for i, v in enumerate(values) if type(v) is PayloadFile]
        if not filed:  # most lookups: an end's candidate keys, none of them a file
            self._insert_read(family, keys, cast("list[bytes | None]", values))
            return
        plain = [i for i, v in enumerate(values) if type(v) is not PayloadFile]
        if plain:
            got = cast("list[bytes | None]", [values[i] for i in plain])
            self._insert_read(family, [keys[i] for i in plain], got)
        for i in filed:
            head = cast(PayloadFile, values[i])
            name = keys[i] if type(keys[i]) is bytes else bytes(keys[i])
            size = len(head.head) + len(name) + _ENTRY_OVERHEAD
            if size <= self.budget.max_bytes:
                self._drop((family, name))
                entry = _Entry(b"", size, self.budget.tick(), head=head)
                self._entries[(family, name)] = entry
                self._bytes += size

    def _insert_written(self, family: Family, key: bytes, value: bytes) -> None:
        """Cache a value just written: an end record kept as a file by its head (its
        file is there: the write made it; a lease holds its arrays), the rest whole.
        Under the lock."""
        files, head = self._files, None
        if files is not None and self._may_be_file(family, len(value)):
            head = files.head_of(family, key, value)
        if head is None:
            self._insert(family, key, value)
        else:
            self._insert_heads(family, [key], [head])

    def _hold_by_head(self, k: tuple[Family, bytes], raw: object, head: PayloadFile) -> None:
        """Hold `k` by `head` in place of `raw`, if `raw` is still its value (the same
        object: a write in between wins). Under the lock."""
        entry = self._entries.get(k)
        if entry is None or entry.raw is not raw or entry.head is not None:
            return
        size = len(head.head) + len(k[1]) + _ENTRY_OVERHEAD
        self._bytes += size - entry.size
        entry.raw, entry.size, entry.head = b"", size, head
        entry.decoded = entry.digest = entry.parsed = None

    def _keep_parsed(self, k: tuple[Family, bytes], raw: bytes | None, made: object | None) -> None:
        """Keep `made` (parsed from `raw`) with `k`'s entry, if `raw` is still its value
        (the same object: a write in between wins). Under the lock."""
        entry = self._entries.get(k)
        if entry is None or raw is None or entry.raw is not raw or made is None or entry.parsed:
            return
        entry.parsed = made
        entry.size += len(raw) + _ENTRY_OVERHEAD
        self._bytes += len(raw) + _ENTRY_OVERHEAD

    def _insert_read(
        self,
        family: Family,
        keys: Sequence[bytes],
        values: Sequence[bytes | None],
        parsed: Sequence[object | None] | None = None,
    ) -> None:
        """Cache what a read below found (absences too, for NEGATIVE_FAMILIES), with
        what `get_parsed` made of it; under the lock. `_insert`'s steps, inline: a
        reopened 16k-token restore caches 256 headers here, and a method call per step
        cost ~3 us a key (0.8 ms). All take one stamp of the budget's clock (they are
        used at once) and the bytes are added up once: 2.29 -> 1.75 us a key (256
        headers, warm)."""
        negative = family in NEGATIVE_FAMILIES
        # `MemoryBudget.fits`, inline: a method call a key was a cold restore's ~1 us.
        entries, limit = self._entries, self.budget.max_bytes
        tick = self.budget.tick()  # one use, now, of all of them
        made_of = parsed if parsed is not None else [None] * len(keys)
        added = 0
        for key, value, made in zip(keys, values, made_of, strict=True):
            if value is None and not negative:
                continue
            raw = b"" if value is None else value if type(value) is bytes else bytes(value)
            name = key if type(key) is bytes else bytes(key)
            size = len(raw) + len(name) + _ENTRY_OVERHEAD
            if made is not None:
                size += len(raw) + _ENTRY_OVERHEAD  # the parse, as a second copy
            if size > limit:
                continue
            k = (family, name)
            old = entries.pop(k, None)
            if old is not None:
                added -= old.size
            entries[k] = _Entry(raw, size, tick, None, None, value is None, made)
            added += size
        self._bytes += added

    def put_batch(self, writes: Sequence[Write]) -> None:
        cached = [w for w in writes if w[0] in CACHED_FAMILIES]
        children = any(w[0] is Family.CHILDREN for w in writes)
        if not cached and not children:
            self.inner.put_batch(writes)
            return
        # Forget the keys first, and cache nothing read while the batch is applied:
        # reads of its keys go to the store below meanwhile and see what it shows
        # (all of the batch or none, over an atomic store).
        with self._lock:
            self._generation += 1
            self._writing += 1
            if children:
                self._around.clear()
            for family, key, _ in cached:
                self._drop((family, key))
        written = False
        try:
            self.inner.put_batch(writes)
            written = True
        finally:
            with self._lock:
                self._generation += 1
                self._writing -= 1
                for family, key, value in cached if written else ():
                    self._drop((family, key))
                    if value is not None:
                        self._insert_written(family, bytes(key), value)
            self.budget.balance()

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.iterate(family, values=values)

    def prefixed(self, family: Family, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.prefixed(family, prefix)

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        if family is not Family.CHILDREN:
            return self.inner.around(family, key, prefix)
        k = (bytes(key), bytes(prefix))
        with self._lock:
            generation = self._generation
            found = self._around.get(k)
            if found is not None:
                self._around.move_to_end(k)
                self.hits += 1
                return list(found)
            self.misses += 1
        got = self.inner.around(family, key, prefix)
        with self._lock:  # as `get_many`: nothing read while a write was under way
            if generation == self._generation and not self._writing:
                self._around[k] = list(got)
                while len(self._around) > AROUND_ENTRIES:
                    self._around.popitem(last=False)
        return got

    def refresh(self) -> None:
        """Catch up with the writer and forget everything: it may have deleted any of it."""
        self.inner.refresh()
        self.clear()

    @property
    def location(self) -> str:
        return self.inner.location

    def flush(self) -> None:
        self.inner.flush()

    def compact(self) -> None:
        self.inner.compact()

    def disk_bytes(self) -> int | None:
        return self.inner.disk_bytes()

    def degraded(self) -> str | None:
        return self.inner.degraded()

    def close(self) -> None:
        self.clear()
        self.inner.close()

    # -- the cache itself ----------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes currently charged against `max_bytes`."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: tuple[Family, bytes]) -> bool:
        return item in self._entries

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()
            self._around.clear()
            self._bytes = 0

    def _insert(self, family: Family, key: bytes, value: bytes, *, absent: bool = False) -> None:
        raw = value if type(value) is bytes else bytes(value)
        size = len(raw) + len(key) + _ENTRY_OVERHEAD
        if not self.budget.fits(size):
            return  # never cache what alone exceeds the bound
        self._drop((family, key))
        self._entries[(family, key)] = _Entry(raw, size, self.budget.tick(), absent=absent)
        self._bytes += size

    def _use(self, k: tuple[Family, bytes], entry: _Entry) -> None:
        """`entry` (under `k`) was used now: most recently used. Under the lock."""
        self._entries.move_to_end(k)
        entry.tick = self.budget.tick()

    def _drop(self, k: tuple[Family, bytes]) -> None:
        entry = self._entries.pop(k, None)
        if entry is not None:
            self._bytes -= entry.size

    # -- a tenant of the budget (`blocks.hot.MemoryBudget`) -------------------------------------
    def oldest_tick(self) -> int | None:
        with self._lock:
            return next(iter(self._entries.values())).tick if self._entries else None

    def evict_oldest(self) -> bool:
        with self._lock:
            if not self._entries:
                return False
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.size
            return True


def _inflated_bytes(block: Decoded) -> int:
    """Memory a decoded payload holds beyond its raw bytes (an lz4 body, inflated)."""
    if not block.compressed:
        return 0
    return sum(int(a.nbytes) for a in block.arrays)


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


def record_heads(
    store: BlockStore, family: Family, keys: Sequence[bytes]
) -> list[bytes | PayloadFile | None]:
    """`store.get_many`, except that a record kept as a file is its `PayloadFile` (with
    its head) where `store` is the hot tier or the file tier (`record_heads` of either)."""
    if isinstance(store, (HotStore, FileTier)):
        return store.record_heads(family, keys)
    return list(store.get_many(family, keys))
