"""The leaf index: every stored block's parent, child count, sizes and last uses.

Eviction needs the leaves of the prefix tree (blocks with no stored child). This
index is built on the first eviction of an open bank by walking the headers and
access families (small records, never the payloads; never at open) and is kept
current afterwards from every batch the bank writes (`observe`) and every use it
records (`touch`). Candidates wait in a heap with lazy updates: an entry whose node
was used since it was pushed is pushed again with the newer time when it surfaces,
so a restore costs a dict update per block and never a heap operation. The order
itself is documented in `index.evict`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header
from cas_bank.index.records import parse_time

_STATE, _BLOCK = 0, 1  # heap kinds: a state goes before a block of the same age


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
            t = parse_time(raw)
            if t is not None:
                self._touch_one(key, t)
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
        added: list[bytes] = []
        changed: list[bytes] = []
        # The last write of a key is what the disk holds (an eviction batch may
        # rewrite a header for a lone state, then delete the block).
        final = {key: value for family, key, value in writes if family is Family.HEADERS}
        for key, value in final.items():
            if value is None:
                self.remove(key)
                continue
            try:
                header = Header.decode(key, value)
            except CorruptDataError:
                continue
            node = self.nodes.get(key)
            if node is None:
                self._add(key, header)
                added.append(key)
            else:
                self.payload_bytes += header.payload_size - node.payload_size
                self.state_bytes += header.state_size - node.state_size
                node.payload_size, node.state_size = header.payload_size, header.state_size
                node.has_state = header.has_state
                changed.append(key)
        # Parents are counted once every new node is in: a batch may hold a child
        # before its parent.
        for key in added:
            parent = self.nodes.get(self.nodes[key].parent)
            if parent is not None:
                parent.children += 1
        for family, key, value in writes:
            t = parse_time(value) if family is Family.ACCESS and value is not None else None
            if t is not None:
                self._touch_one(key, t)
        for key in added + changed:
            node = self.nodes.get(key)
            if node is not None:
                self._queue(key, node)

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
        node.state_size, node.has_state, node.state_used = 0, False, 0.0

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
