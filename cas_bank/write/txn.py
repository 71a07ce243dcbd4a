"""One transaction: every change to what a bank holds, and to its bookkeeping, at once.

A `Transaction` gathers a batch of writes with what goes with them in memory: counter
deltas, last uses of the blocks and states it covers (`touch`), pending last uses of
what it removes (`forget`), suspect marks it clears (the records it rewrites or
removes), and undo steps of its own (`on_abort`, e.g. an eviction's leaf index that
ran ahead of the disk). `commit` writes the batch (carrying the changed counters and
the pending last uses) in one `put_batch`, then applies the in-memory effects. If the
batch fails, no in-memory effect has happened: the counters, the suspect marks and
the last uses are what they were (last uses drained for the batch go back to the
pending set), and the undo steps run.

`Bank.transaction()` opens one under the bank's write lock, commits it when the
`with` block ends (aborts it on an exception) and then enforces the budget. Stores,
eviction, bundle imports and `verify --fix` all write through it; nothing else
changes the stored-content counters, persists last uses or clears suspect marks.
Reads only record: activity counters (`Counters.count`), uses (`AccessLog.touch`)
and suspect marks (`Suspects.mark`), persisted by the next transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.evict.access import AccessLog
from cas_bank.evict.evicted import EvictionMemory, Reason, record_key
from cas_bank.index.records import TIME, access_key, end_access_key
from cas_bank.stats import NAMES, Counters, counter_writes


class Suspects:
    """Chain hashes whose block payload (or state) failed to verify on a read.

    The next store (or import) of such a block rewrites the record even though its
    header says it is there. A read marks; only a transaction that rewrote or removed
    the record clears.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: set[bytes] = set()
        self._states: set[bytes] = set()

    def mark(self, key: bytes, *, state: bool = False) -> None:
        with self._lock:
            (self._states if state else self._blocks).add(bytes(key))

    def block(self, key: bytes) -> bool:
        return key in self._blocks

    def state(self, key: bytes) -> bool:
        return key in self._states

    def blocks(self) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._blocks)

    def states(self) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._states)

    def _clear(self, blocks: Iterable[bytes], states: Iterable[bytes]) -> None:
        with self._lock:
            self._blocks.difference_update(blocks)
            self._states.difference_update(states)


class Transaction:
    """A batch of writes and the in-memory effects that follow it; see the module."""

    def __init__(
        self,
        store: BlockStore,
        counters: Counters,
        access: AccessLog,
        suspects: Suspects,
        memory: EvictionMemory | None = None,
        follow: Callable[[BlockStore, list[Write]], list[Write]] | None = None,
    ) -> None:
        """`follow`: the writes that keep an index in step with a batch (the bank's
        children index, `index.children.index_writes`), added to it at commit."""
        self.store = store
        self._counters = counters
        self._access = access
        self._suspects = suspects
        self._memory = memory
        self._follow = follow
        self._removed: list[tuple[bytes, Reason]] = []
        self.writes: list[Write] = []
        self.deltas: dict[str, int] = {}
        self._uses: dict[bytes, float] = {}
        self._forget: set[bytes] = set()
        self._clear_blocks: set[bytes] = set()
        self._clear_states: set[bytes] = set()
        self._undo: list[Callable[[], None]] = []
        self.done = False

    # -- gathering -----------------------------------------------------------------
    def put(self, family: Family, key: bytes, value: bytes) -> None:
        self.writes.append((family, key, value))

    def delete(self, family: Family, key: bytes) -> None:
        self.writes.append((family, key, None))

    def extend(self, writes: Iterable[Write]) -> None:
        self.writes.extend(writes)

    def add(self, **deltas: int) -> None:
        """Counter deltas, applied once the batch is written."""
        unknown = set(deltas) - set(NAMES)
        if unknown:
            raise ValueError(f"no counters named {sorted(unknown)}")
        for name, d in deltas.items():
            self.deltas[name] = self.deltas.get(name, 0) + d

    def touch(
        self, blocks: Iterable[bytes], states: Iterable[bytes] = (), ends: Iterable[bytes] = ()
    ) -> None:
        """A use of `blocks`, of the states at the ends of `states` and of the end records
        under the parents `ends`, now; written with the batch (nothing is recorded if it
        fails)."""
        if not self._access.enabled:
            return
        now = self._access.clock()
        keys = [bytes(h) for h in blocks] + [access_key(h, True) for h in states]
        for k in keys + [end_access_key(p) for p in ends]:
            self._uses[k] = now

    def forget(
        self, blocks: Iterable[bytes] = (), states: Iterable[bytes] = (), ends: Iterable[bytes] = ()
    ) -> None:
        """The last uses of removed blocks (their states and end records), of removed
        states and of the end records removed under the parents `ends`: none is written
        with or after the batch."""
        for h in blocks:
            self._forget.update((bytes(h), access_key(h, True), end_access_key(h)))
        self._forget.update(access_key(h, True) for h in states)
        self._forget.update(end_access_key(h) for h in ends)

    def clear_suspect(self, blocks: Iterable[bytes] = (), states: Iterable[bytes] = ()) -> None:
        """Records this batch rewrites or removes: no longer suspect once it is written."""
        self._clear_blocks.update(blocks)
        self._clear_states.update(states)

    def removed(
        self, blocks: Iterable[bytes] = (), states: Iterable[bytes] = (), *, reason: Reason
    ) -> None:
        """Blocks (with their states) and states on their own this batch removes, and
        why: their removal records go into the batch (`evict.evicted`)."""
        self._removed += [(record_key(h), reason) for h in blocks]
        self._removed += [(record_key(h, True), reason) for h in states]

    def on_abort(self, undo: Callable[[], None]) -> None:
        """Run `undo` if the batch fails (an in-memory effect taken ahead of it)."""
        self._undo.append(undo)

    # -- ending ----------------------------------------------------------------------
    def commit(self) -> None:
        """Write the batch, then apply the in-memory effects; on failure, undo all."""
        if self.done:
            raise RuntimeError("transaction already ended")
        self.done = True
        drained = self._access.drain()
        uses, keep = self._live_uses(drained)
        values = self._counters.stage(self.deltas)
        batch = self.writes + uses + counter_writes(values)
        remember: Callable[[], None] | None = None
        try:
            # The children index follows every header and end record written or removed.
            if self._follow is not None:
                batch += self._follow(self.store, self.writes)
            if self._memory is not None:  # removal records, and clears of what is stored again
                extra, remember = self._memory.writes(
                    self.store, self.writes, self._removed, self._access.clock
                )
                batch += extra
            if batch:  # nothing to write: no batch (a flush with nothing pending)
                self.store.put_batch(batch)
        except BaseException:
            self._access.requeue(keep)  # those uses happened; they go with a later batch
            self._run_undo()
            raise
        if remember is not None:
            remember()
        self._counters.commit(self.deltas, values)
        self._suspects._clear(self._clear_blocks, self._clear_states)
        self._access.forget(self._forget)  # uses recorded meanwhile of what went
        self._access.observe(batch)

    def abort(self) -> None:
        """End without writing: nothing happened (the undo steps run)."""
        if not self.done:
            self.done = True
            self._run_undo()

    def _run_undo(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def _live_uses(self, drained: list[Write]) -> tuple[list[Write], list[Write]]:
        """The last-use writes of the batch, and the drained ones to give back if it fails.

        Drained (pending) uses of what this batch removes are left out, and given back
        on failure; so are uses of blocks evicted since they were recorded (a restore
        records without the write lock, so it may record a block an eviction has just
        removed: that record would outlive its block), which are dropped for good.
        """
        index = self._access.index  # built by the first eviction; none before, none evicted
        written = {k for family, k, value in self.writes if family is Family.HEADERS and value}
        uses = dict(self._uses)
        keep: list[Write] = []
        for w in drained:
            key = w[1]
            gone = (
                index is not None
                and key[:32] not in index.nodes
                and key[:32] not in index.ends
                and key[:32] not in written
            )
            if gone and key not in self._forget:
                continue  # stale: its block was evicted after the use was recorded
            keep.append(w)
            if key in self._forget or w[2] is None:
                continue
            t = TIME.unpack(w[2])[0]
            if uses.get(key, -1.0) < t:
                uses[key] = t
        return [(Family.ACCESS, k, TIME.pack(t)) for k, t in uses.items()], keep
