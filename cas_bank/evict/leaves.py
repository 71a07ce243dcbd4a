"""The leaf index: every stored block's parent, child count, sizes and last uses.

Eviction needs the leaves of the prefix tree (blocks with no stored child). This
index is built on the first eviction of an open bank by walking the headers and
access families (small records, never the payloads; never at open) and is kept
current afterwards from every batch the bank writes (`observe`) and every use it
records (`touch`). Candidates wait in a heap with lazy updates: an entry whose node
was used since it was pushed is pushed again with the newer time when it surfaces,
so a restore costs a dict update per block and never a heap operation. The order
itself is documented in `evict.eviction`.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header
from cas_bank.index.records import END_SUFFIX, access_key, end_access_key, parse_time, read_times

log = logging.getLogger("cas_bank")


def _damaged(e: CorruptDataError) -> None:
    # Eviction places what it could read (a record past a damaged file is not a
    # candidate) and leaves the damage to `cas-bank verify` and `salvage`, rather than
    # refuse every store.
    log.warning("cas_bank: the eviction index stops at damage: %s", e)


# Heap kinds: a state goes before the end records and a block of the same age.
_STATE, _ENDS, _BLOCK = 0, 1, 2


@dataclass(slots=True)
class Node:
    parent: bytes
    payload_size: int
    state_size: int
    has_state: bool
    children: int = 0
    used: float = 0.0
    state_used: float = 0.0
    queued: bool = False  # the block has an entry in the heap
    state_queued: bool = False


@dataclass(slots=True)
class EndGroup:
    """The end records under one parent (a block, or a namespace root): a leaf group."""

    sizes: dict[bytes, int]  # record key -> bytes
    used: float = 0.0
    queued: bool = False

    @property
    def size(self) -> int:
        return sum(self.sizes.values())


class LeafIndex:
    """Every stored block's parent, child count, sizes and last uses; a candidate heap."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.ends: dict[bytes, EndGroup] = {}  # by parent
        self.payload_bytes = 0
        self.state_bytes = 0
        self.end_bytes = 0
        self._heap: list[tuple[float, int, bytes]] = []

    @property
    def total(self) -> int:
        return self.payload_bytes + self.state_bytes + self.end_bytes

    def load(self, store: BlockStore) -> None:
        for key, raw in store.readable(Family.HEADERS, damaged=_damaged):
            try:
                header = Header.decode(key, raw)
            except CorruptDataError:
                continue  # `cas-bank verify` reports it; eviction cannot place it
            self._add(key, header)
        for key, raw in store.readable(Family.ENDS, damaged=_damaged):
            self._put_end(key, len(raw))
        try:
            for key, raw in store.iterate(Family.ACCESS):
                t = parse_time(raw)
                if t is not None:
                    self._touch_one(key, t)
        except CorruptDataError as e:  # read the uses of what is placed one by one
            log.warning("cas_bank: last uses past damage read one by one: %s", e)
            keys = [access_key(k, state) for k in self.nodes for state in (False, True)]
            keys += [end_access_key(p) for p in self.ends]
            for key, t in zip(keys, read_times(store, keys), strict=True):
                if t is not None:
                    self._touch_one(key, t)
        for node in self.nodes.values():
            parent = self.nodes.get(node.parent)
            if parent is not None:
                parent.children += 1
        for key, node in self.nodes.items():
            self._queue(key, node)
        for owner, group in self.ends.items():
            self._queue_ends(owner, group)

    # -- keeping it current ----------------------------------------------------
    def touch(self, keys: Sequence[bytes], now: float) -> None:
        for k in keys:
            self._touch_one(k, now)

    def touch_each(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        for k, t in pairs:
            self._touch_one(k, t)

    def _touch_one(self, key: bytes, t: float) -> None:
        if key[32:] == END_SUFFIX:
            group = self.ends.get(key[:32])
            if group is not None and t > group.used:
                group.used = t
        elif len(key) > 32:
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
        ends_changed: set[bytes] = set()
        for family, key, value in writes:
            if family is Family.ENDS:
                if value is None:
                    self._drop_end(key)
                else:
                    self._put_end(key, len(value))
                    ends_changed.add(key[:32])
        for family, key, value in writes:
            t = parse_time(value) if family is Family.ACCESS and value is not None else None
            if t is not None:
                self._touch_one(key, t)
        for key in added + changed:
            node = self.nodes.get(key)
            if node is not None:
                self._queue(key, node)
        for owner in ends_changed:
            group = self.ends.get(owner)
            if group is not None:
                self._queue_ends(owner, group)

    def _put_end(self, key: bytes, size: int) -> None:
        group = self.ends.get(key[:32])
        if group is None:
            group = self.ends[bytes(key[:32])] = EndGroup({})
        self.end_bytes += size - group.sizes.get(key, 0)
        group.sizes[bytes(key)] = size

    def _drop_end(self, key: bytes) -> None:
        group = self.ends.get(key[:32])
        if group is None or key not in group.sizes:
            return
        self.end_bytes -= group.sizes.pop(key)
        if not group.sizes:
            del self.ends[key[:32]]

    def drop_ends(self, parent: bytes) -> EndGroup | None:
        """Forget every end record under `parent`; what it held."""
        group = self.ends.pop(parent, None)
        if group is not None:
            self.end_bytes -= group.size
        return group

    def _add(self, key: bytes, header: Header) -> Node:
        node = Node(header.parent, header.payload_size, header.state_size, header.has_state)
        self.nodes[bytes(key)] = node
        self.payload_bytes += header.payload_size
        self.state_bytes += header.state_size
        return node

    def remove(self, key: bytes) -> Node | None:
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

    def _queue_ends(self, parent: bytes, group: EndGroup) -> None:
        if not group.queued:
            group.queued = True
            heapq.heappush(self._heap, (group.used, _ENDS, parent))

    def _queue(self, key: bytes, node: Node) -> None:
        if node.has_state and not node.state_queued:
            node.state_queued = True
            heapq.heappush(self._heap, (node.state_used, _STATE, key))
        if node.children == 0 and not node.queued:
            node.queued = True
            heapq.heappush(self._heap, (node.used, _BLOCK, key))

    # -- choosing ----------------------------------------------------------------
    def pop_victim(self) -> tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup] | None:
        """The next candidate in eviction order (not yet removed), or None."""
        heap = self._heap
        while heap:
            t, kind, key = heapq.heappop(heap)
            if kind == _ENDS:
                group = self.ends.get(key)
                if group is None:
                    continue
                group.queued = False
                if group.used > t:
                    self._queue_ends(key, group)
                    continue
                return "ends", key, group
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
