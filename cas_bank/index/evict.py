"""Budget, last-use bookkeeping, and leaf-first eviction.

Last use
--------
A block's last use is the last time a store covered it (wrote it, or found it
already stored) or a restore returned it. A state's last use is the last time a
store wrote or offered it, or a restore resumed from it (its boundary was the
restore point). Times are kept in the `access` family, one f64 (seconds since the
epoch) per key: the chain hash for the block, the chain hash + b"s" for its state.
A store writes them for its whole chain in its own batch, so a block's written-time
is there from the start. A restore only records them in memory (`AccessLog`); they
are written in batches: riding along the next store, at most every
`access_flush_interval` seconds from a later restore, and at close. Never a write
per restore. A block with no access record (an older bank) counts as used at time 0.

Eviction order (`evict_to_budget`)
----------------------------------
While payload + state bytes exceed the budget, remove the first of these
candidates, ordered by (last use, states before blocks, chain hash):
1. every stored state, on its own: the block stays, only its restore point goes;
2. every leaf block (no stored child), together with its state if it has one.
So the least recently used thing goes first; a state is a candidate on its own
and goes before a block of the same age, and a state whose boundary is rarely
restored (intermediate boundaries, branch points nobody resumes from) ages out
long before the blocks it sits on, which restores keep touching. A block with a
stored child is never a candidate: only after its last child goes does it become a
leaf, with its own last use. So no chain ever has a hole. Evicting a state alone
also rewrites its block's header without the state flag. Every pass is one atomic
batch holding the deletes and the counters they change.

The leaf index
--------------
Eviction needs the leaves. `LeafIndex` is built on the first eviction of an open
bank by walking the headers and access families (small records, never the
payloads; never at open), and is kept current afterwards from every batch the bank
writes and every restore it records. Candidates sit in a heap with lazy updates: an
entry whose node was used since it was pushed is pushed again with the newer time
when it surfaces, so a restore costs a dict update per block and never a heap
operation.
"""

from __future__ import annotations

import heapq
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.index.chain import Header

if TYPE_CHECKING:
    from cas_bank.bank import Bank

_TIME = struct.Struct("<d")
STATE_SUFFIX = b"s"
_STATE, _BLOCK = 0, 1  # heap kinds: a state goes before a block of the same age


def access_key(chain_hash: bytes, state: bool = False) -> bytes:
    """The access-family key holding the last use of a block (or of its state)."""
    return chain_hash + STATE_SUFFIX if state else chain_hash


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
    ) -> None:
        self.flush_interval = flush_interval
        self.enabled = enabled
        self.clock = clock  # injectable: eviction-order tests use a fake clock
        self.index: LeafIndex | None = None
        self._pending: dict[bytes, float] = {}  # access key -> last use, not yet written
        self._lock = threading.Lock()
        self._last_flush = clock()

    def touch(self, blocks: Iterable[bytes], states: Iterable[bytes] = ()) -> None:
        """Record a use of `blocks` and of the states at the ends of `states`, now."""
        if not self.enabled:
            return
        now = self.clock()
        keys = [bytes(h) for h in blocks] + [access_key(h, True) for h in states]
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
        return [(Family.ACCESS, k, _TIME.pack(t)) for k, t in pending.items()]

    def pending(self, key: bytes) -> float | None:
        return self._pending.get(key)

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

    def leaf_index(self, store: BlockStore) -> LeafIndex:
        """The leaf index, built on first use by walking headers and access records."""
        if self.index is None:
            index = LeafIndex()
            index.load(store)
            self.index = index  # touches from now on reach it directly
            with self._lock:
                pending = list(self._pending.items())
            index.touch_each(pending)
        return self.index


def last_use(bank: Bank, hashes: Sequence[bytes], *, states: bool = False) -> list[float | None]:
    """Last use of each block (or of the state at its end), None where none is known.

    Uses recorded in memory and not yet written count; no scan, one multi-get.
    """
    keys = [access_key(h, states) for h in hashes]
    out = [bank.access.pending(k) for k in keys]
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:
        raw = bank.store.get_many(Family.ACCESS, [keys[i] for i in missing])
        for i, value in zip(missing, raw, strict=True):
            if value is not None and len(value) == _TIME.size:
                out[i] = _TIME.unpack(value)[0]
    return out


# -- the leaf index ----------------------------------------------------------------
@dataclass(slots=True)
class _Node:
    parent: bytes
    payload_size: int
    state_size: int
    has_state: bool
    children: int = 0
    used: float = 0.0
    state_used: float = 0.0
    queued: bool = False  # the block has an entry in the heap
    state_queued: bool = False


class LeafIndex:
    """Every stored block's parent, child count, sizes and last uses; a candidate heap."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, _Node] = {}
        self.payload_bytes = 0
        self.state_bytes = 0
        self._heap: list[tuple[float, int, bytes]] = []

    @property
    def total(self) -> int:
        return self.payload_bytes + self.state_bytes

    def load(self, store: BlockStore) -> None:
        for key, raw in store.iterate(Family.HEADERS):
            try:
                header = Header.decode(key, raw)
            except CorruptDataError:
                continue  # `cas-bank verify` reports it; eviction cannot place it
            self._add(key, header)
        for key, raw in store.iterate(Family.ACCESS):
            if len(raw) == _TIME.size:
                self._touch_one(key, _TIME.unpack(raw)[0])
        for node in self.nodes.values():
            parent = self.nodes.get(node.parent)
            if parent is not None:
                parent.children += 1
        for key, node in self.nodes.items():
            self._queue(key, node)

    # -- keeping it current ----------------------------------------------------
    def touch(self, keys: Sequence[bytes], now: float) -> None:
        for k in keys:
            self._touch_one(k, now)

    def touch_each(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        for k, t in pairs:
            self._touch_one(k, t)

    def _touch_one(self, key: bytes, t: float) -> None:
        if len(key) > 32:
            node = self.nodes.get(key[:32])
            if node is not None and t > node.state_used:
                node.state_used = t
        else:
            node = self.nodes.get(key)
            if node is not None and t > node.used:
                node.used = t

    def observe(self, writes: Sequence[Write]) -> None:
        """Apply a written batch: headers added, changed or deleted; access times."""
        for family, key, value in writes:
            if family is not Family.HEADERS:
                continue
            if value is None:
                self.remove(key)
                continue
            try:
                header = Header.decode(key, value)
            except CorruptDataError:
                continue
            node = self.nodes.get(key)
            if node is None:
                node = self._add(key, header)
                parent = self.nodes.get(node.parent)
                if parent is not None:
                    parent.children += 1
            else:
                self.payload_bytes += header.payload_size - node.payload_size
                self.state_bytes += header.state_size - node.state_size
                node.payload_size, node.state_size = header.payload_size, header.state_size
                node.has_state = header.has_state
            self._queue(key, node)
        for family, key, value in writes:
            if family is Family.ACCESS and value is not None and len(value) == _TIME.size:
                self._touch_one(key, _TIME.unpack(value)[0])

    def _add(self, key: bytes, header: Header) -> _Node:
        node = _Node(header.parent, header.payload_size, header.state_size, header.has_state)
        self.nodes[bytes(key)] = node
        self.payload_bytes += header.payload_size
        self.state_bytes += header.state_size
        return node

    def remove(self, key: bytes) -> _Node | None:
        """Forget a block (and its state); its parent may become a leaf."""
        node = self.nodes.pop(key, None)
        if node is None:
            return None
        self.payload_bytes -= node.payload_size
        self.state_bytes -= node.state_size
        parent = self.nodes.get(node.parent)
        if parent is not None:
            parent.children -= 1
            self._queue(node.parent, parent)
        return node

    def drop_state(self, key: bytes) -> None:
        node = self.nodes[key]
        self.state_bytes -= node.state_size
        node.state_size, node.has_state = 0, False

    def _queue(self, key: bytes, node: _Node) -> None:
        if node.has_state and not node.state_queued:
            node.state_queued = True
            heapq.heappush(self._heap, (node.state_used, _STATE, key))
        if node.children == 0 and not node.queued:
            node.queued = True
            heapq.heappush(self._heap, (node.used, _BLOCK, key))

    # -- choosing ----------------------------------------------------------------
    def pop_victim(self) -> tuple[Literal["block", "state"], bytes, _Node] | None:
        """The next candidate in eviction order (not yet removed), or None."""
        heap = self._heap
        while heap:
            t, kind, key = heapq.heappop(heap)
            node = self.nodes.get(key)
            if node is None:
                continue
            if kind == _STATE:
                node.state_queued = False
                if not node.has_state:
                    continue
                if node.state_used > t:  # used since it was queued: requeue at its new age
                    self._queue(key, node)
                    continue
                return "state", key, node
            node.queued = False
            if node.children:
                continue  # no longer a leaf; queued again when its last child goes
            if node.used > t:
                self._queue(key, node)
                continue
            return "block", key, node
        return None


# -- eviction ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Evicted:
    """One removal: a state on its own, or a leaf block (with its state, if any)."""

    kind: Literal["block", "state"]
    chain_hash: BlockHash
    payload_bytes: int  # 0 for a state on its own
    state_bytes: int  # the state's bytes, alone or with its block
    last_use: float  # of the block, or of the state for a state on its own

    @property
    def size(self) -> int:
        """Bytes removed: the payload and/or the state."""
        return self.payload_bytes + self.state_bytes

    @property
    def with_state(self) -> bool:
        """A block that took its state with it."""
        return self.kind == "block" and self.state_bytes > 0


@dataclass(frozen=True, slots=True)
class EvictionReport:
    """What one `evict_to_budget` removed, in eviction order."""

    max_bytes: int
    bytes_before: int
    bytes_after: int
    evicted: list[Evicted]

    @property
    def blocks_evicted(self) -> int:
        return sum(1 for e in self.evicted if e.kind == "block")

    @property
    def states_evicted(self) -> int:
        return sum(1 for e in self.evicted if e.state_bytes > 0)

    @property
    def bytes_evicted(self) -> int:
        return sum(e.size for e in self.evicted)


def evict_to_budget(bank: Bank, max_bytes: int) -> EvictionReport:
    """Evict in the documented order until payload + state bytes <= `max_bytes`.

    Used after a store when `BankConfig.max_bytes` is exceeded, and offline by
    `cas-bank gc`. One atomic batch for all the deletes and the counters.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidInputError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
    if bank.read_only:
        raise RuntimeError(f"bank at {bank.path} is open read-only: it cannot evict")
    with bank.write_lock:
        index = bank.access.leaf_index(bank.store)
        before = index.total
        evicted: list[Evicted] = []
        writes: list[Write] = []
        while index.total > max_bytes:
            victim = index.pop_victim()
            if victim is None:
                break
            kind, key, node = victim
            h = BlockHash(key)
            if kind == "state":
                writes += _state_deletes(bank.store, key)
                evicted.append(Evicted("state", h, 0, node.state_size, node.state_used))
                index.drop_state(key)
            else:
                writes += [
                    (Family.HEADERS, key, None),
                    (Family.BLOCKS, key, None),
                    (Family.ACCESS, key, None),
                ]
                if node.has_state:
                    writes += [
                        (Family.STATES, key, None),
                        (Family.ACCESS, access_key(key, True), None),
                    ]
                evicted.append(Evicted("block", h, node.payload_size, node.state_size, node.used))
                index.remove(key)
        if evicted:
            _commit(bank, writes, evicted)
        return EvictionReport(max_bytes, before, index.total, evicted)


def enforce_budget(bank: Bank) -> EvictionReport | None:
    """After a store: evict if the counters say the bank is over `config.max_bytes`."""
    limit = bank.config.max_bytes
    if limit is None:
        return None
    v = bank.counters.values()
    if v["payload_bytes"] + v["state_bytes"] <= limit:
        return None
    return evict_to_budget(bank, limit)


def _state_deletes(store: BlockStore, key: bytes) -> list[Write]:
    """The writes that remove a block's state and clear its header's state flag."""
    raw = store.get(Family.HEADERS, key)
    assert raw is not None, "the leaf index lists only stored headers"
    header = Header.decode(key, raw).with_state(None)
    return [
        (Family.STATES, key, None),
        (Family.ACCESS, access_key(key, True), None),
        (Family.HEADERS, key, header.encode()),
    ]


def _commit(bank: Bank, writes: list[Write], evicted: list[Evicted]) -> None:
    blocks = sum(1 for e in evicted if e.kind == "block")
    states = sum(1 for e in evicted if e.state_bytes > 0)
    payload_bytes = sum(e.payload_bytes for e in evicted)
    state_bytes = sum(e.state_bytes for e in evicted)
    bank.counters.add(
        blocks=-blocks,
        states=-states,
        payload_bytes=-payload_bytes,
        state_bytes=-state_bytes,
        blocks_evicted=blocks,
        states_evicted=states,
        bytes_evicted=payload_bytes + state_bytes,
    )
    gone = [e.chain_hash for e in evicted]
    bank.access.forget([access_key(h, s) for h in gone for s in (False, True)])
    try:
        bank.write(writes)
    except BaseException:
        bank.access.index = None  # no longer mirrors the disk: rebuild on next use
        raise
    bank.suspect.difference_update(gone)
