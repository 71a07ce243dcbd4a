"""A tenant's entries removed in eviction order: its own heap of the leaf index's
candidates under its roots (`TenantHeap`), and `evict_tenant`, one transaction of
removals down to a byte limit or a count. `evict.tenants` calls it to enforce a quota
(and a revocation, with pinned entries too and no removal records).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cas_bank.evict.eviction import Evicted, _count_evicted, _evict, leaf_index
from cas_bank.evict.leaves import EndGroup, LeafIndex, Node
from cas_bank.owner import Writer

# Heap kinds, as the leaf index orders them.
_STATE, _ENDS, _BLOCK = 0, 1, 2

# A candidate: what it is, its key, and its entry in the leaf index.
Victim = tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup]


class TenantHeap:
    """The leaf index's candidates under some roots, in its order: a heap of their own,
    built once (linear in their entries) and kept complete by the index, which pushes
    every candidate it queues under those roots (`LeafIndex.watchers`) until `close`.
    Entries are checked when they surface, as the index's own are."""

    def __init__(self, index: LeafIndex, roots: set[bytes], *, pinned: bool = False) -> None:
        self.index, self.roots, self.pinned = index, frozenset(roots), pinned
        self.heap: list[tuple[float, float, int, bytes]] = []
        self._build()

    def _build(self) -> None:
        index, roots = self.index, self.roots
        heap = self.heap
        heap.clear()
        for key, node in index.nodes.items():
            if node.root in roots:
                if node.has_state:
                    heap.append((node.state_prio, node.state_used, _STATE, key))
                if node.children == 0:
                    heap.append((node.prio, node.used, _BLOCK, key))
        for parent, group in index.ends.items():
            if group.root in roots:
                heap.append((group.prio, group.used, _ENDS, parent))
        heapq.heapify(heap)
        for r in roots:
            watching = index.watchers.setdefault(r, [])
            if not any(w is heap for w in watching):
                watching.append(heap)

    def fresh(self, index: LeafIndex, roots: set[bytes]) -> bool:
        """Whether this heap still serves `roots` of `index`; rebuilt in place when stale
        entries outnumber the index's (so it never grows without bound)."""
        if index is not self.index or roots != self.roots:
            return False
        if len(self.heap) > 2 * (len(index.nodes) + len(index.ends)) + 1024:
            self._build()
        return True

    def close(self) -> None:
        for r in self.roots:
            watching = [w for w in self.index.watchers.get(r, []) if w is not self.heap]
            if watching:
                self.index.watchers[r] = watching
            else:
                self.index.watchers.pop(r, None)

    def pop(self) -> Victim | None:
        index = self.index
        while self.heap:
            prio, t, kind, key = heapq.heappop(self.heap)
            if kind == _ENDS:
                group = index.ends.get(key)
                if group is None or (not self.pinned and index.ends_pinned(key)):
                    continue
                if (group.prio, group.used) != (prio, t):  # used since: at its new key
                    heapq.heappush(self.heap, (group.prio, group.used, _ENDS, key))
                    continue
                return "ends", key, group
            node = index.nodes.get(key)
            if node is None or (not self.pinned and index.pinned(key)):
                continue
            if kind == _STATE:
                if not node.has_state:
                    continue
                if (node.state_prio, node.state_used) != (prio, t):
                    heapq.heappush(self.heap, (node.state_prio, node.state_used, _STATE, key))
                    continue
                return "state", key, node
            if node.children:
                continue
            if (node.prio, node.used) != (prio, t):
                heapq.heappush(self.heap, (node.prio, node.used, _BLOCK, key))
                continue
            return "block", key, node
        return None


@dataclass(frozen=True, slots=True)
class TenantEviction:
    """What one `evict_tenant` removed."""

    tenant: str
    bytes_before: int
    bytes_after: int
    evicted: list[Evicted]

    @property
    def bytes_evicted(self) -> int:
        return sum(e.size for e in self.evicted)


def held_bytes(index: LeafIndex, roots: Iterable[bytes]) -> int:
    return sum(index.root_bytes.get(r, 0) for r in roots)


def evict_tenant(
    bank: Writer,
    tenant: str,
    roots: set[bytes],
    *,
    limit: int | None = None,
    most: int | None = None,
    revoking: bool = False,
    heaps: dict[str, TenantHeap] | None = None,
) -> TenantEviction:
    """Remove the candidates under `roots` in eviction order, in one transaction,
    until they hold at most `limit` bytes (None: all of them) or `most` went.

    `revoking`: pinned ones too, and no removal records (the namespace is going).
    `heaps`: the tenants' heaps kept from one call to the next (by tenant); without
    it the heap is built for this call and closed after it.
    """
    access = bank.access
    with bank.transaction(budget=False) as tx:
        index = leaf_index(tx.store, access)
        before = held_bytes(index, roots)
        kept = heaps.get(tenant) if heaps is not None else None
        if kept is not None and (kept.pinned != revoking or not kept.fresh(index, roots)):
            kept.close()
            kept = None
        heap = kept or TenantHeap(index, roots, pinned=revoking)
        if heaps is not None:
            heaps[tenant] = heap
        else:
            tx.on_abort(heap.close)
        evicted: list[Evicted] = []
        while (limit is None or held_bytes(index, roots) > limit) and (
            most is None or len(evicted) < most
        ):
            victim = heap.pop()
            if victim is None:
                break
            if not evicted:  # the index runs ahead of the disk: if the batch fails, rebuild it
                tx.on_abort(lambda: setattr(access, "index", None))
            evicted.append(_evict(tx, index, victim, None if revoking else "budget"))
        _count_evicted(tx, evicted)
        if not evicted:
            tx.abort()
        after = held_bytes(index, roots)
    if heaps is None:
        heap.close()
    return TenantEviction(tenant, before, after, evicted)
