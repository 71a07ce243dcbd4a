"""The leaf index: every stored block's parent, child count, sizes and last uses.

Eviction needs the leaves of the prefix tree (blocks with no stored child). This
index is built on the first eviction of an open bank by walking the headers and
access families (small records, never the payloads; never at open) and is kept
current afterwards from every batch the bank writes (`observe`) and every use it
records (`touch`). Candidates wait in a heap with lazy updates: an entry whose node
was used since it was pushed is pushed again with its newer key when it surfaces,
so a restore costs a dict update per block and never a heap operation. The order
itself (the policies `lru` and `lfu`) is documented in `evict.eviction`.

Pins (`evict.pins`) are kept here too: a pinned block, its state and a pinned group
of end records never come out of `pop_victim` (an entry that surfaces while pinned
is dropped, and queued again when its last pin goes).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.config import EvictionPolicy
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

POLICIES: tuple[EvictionPolicy, ...] = get_args(EvictionPolicy)


@dataclass(slots=True)
class Node:
    parent: bytes
    root: bytes  # its namespace root (a tenant's quota sums its roots: `evict.tenants`)
    payload_size: int
    state_size: int
    has_state: bool
    children: int = 0
    used: float = 0.0
    state_used: float = 0.0
    uses: int = 0  # uses seen by this index (a use at a newer time than the last)
    state_uses: int = 0
    prio: float = 0.0  # the policy's rank: 0 for lru; the aging clock + uses for lfu
    state_prio: float = 0.0
    queued: bool = False  # the block has an entry in the heap
    state_queued: bool = False


@dataclass(slots=True)
class EndGroup:
    """The end records under one parent (a block, or a namespace root): a leaf group."""

    sizes: dict[bytes, int]  # record key -> bytes
    root: bytes = b""  # its namespace root
    used: float = 0.0
    uses: int = 0
    prio: float = 0.0
    queued: bool = False

    @property
    def size(self) -> int:
        return sum(self.sizes.values())


def _end_root(value: bytes) -> bytes | None:
    """The namespace root an end record names (`index.ends`: after version, flags,
    tail length, tokens, payload size and parent), or None if it is too short."""
    return bytes(value[48:80]) if len(value) >= 80 else None


class LeafIndex:
    """Every stored block's parent, child count, sizes and last uses; a candidate heap.

    `policy` orders the heap (a bank's index takes `BankConfig.eviction_policy`);
    `lru` ranks every candidate alike.
    """

    def __init__(self, policy: EvictionPolicy = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"no eviction policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.nodes: dict[bytes, Node] = {}
        self.ends: dict[bytes, EndGroup] = {}  # by parent
        self.payload_bytes = 0
        self.state_bytes = 0
        self.end_bytes = 0
        # Bytes (payloads, states, end records) under each namespace root.
        self.root_bytes: dict[bytes, int] = {}
        self._roots: dict[bytes, bytes] = {}  # one bytes object per root, shared
        # lfu's aging clock: the rank of the last victim (LFU with dynamic aging).
        self.age = 0.0
        self._heap: list[tuple[float, float, int, bytes]] = []
        # Pins: by pin key, its blocks and the parent of its end records (or None);
        # and how many pins hold each block and each group of end records.
        self.pins: dict[bytes, tuple[tuple[bytes, ...], bytes | None]] = {}
        self._pinned: dict[bytes, int] = {}
        self._pinned_ends: dict[bytes, int] = {}
        # Heaps of candidates under some roots (a tenant's, `evict.tenants`): every
        # candidate queued here is pushed there too, so they stay complete.
        self.watchers: dict[bytes, list[list[tuple[float, float, int, bytes]]]] = {}

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
            self._put_end(key, len(raw), _end_root(raw))
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

    def _rank(self, uses: int) -> float:
        """The policy's rank after `uses` uses, now: the first part of a heap key."""
        return self.age + uses if self.policy == "lfu" else 0.0

    def _touch_one(self, key: bytes, t: float) -> None:
        # A use counts once: the same time written again (a restore's use, drained
        # into a later batch) is no second use.
        if key[32:] == END_SUFFIX:
            group = self.ends.get(key[:32])
            if group is not None and t > group.used:
                group.used = t
                group.uses += 1
                group.prio = self._rank(group.uses)
        elif len(key) > 32:
            node = self.nodes.get(key[:32])
            if node is not None and t > node.state_used:
                node.state_used = t
                node.state_uses += 1
                node.state_prio = self._rank(node.state_uses)
        else:
            node = self.nodes.get(key)
            if node is not None and t > node.used:
                node.used = t
                node.uses += 1
                node.prio = self._rank(node.uses)

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
                self._charge(
                    node.root,
                    header.payload_size + header.state_size - node.payload_size - node.state_size,
                )
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
                    self._put_end(key, len(value), _end_root(value))
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

    def _charge(self, root: bytes, delta: int) -> None:
        n = self.root_bytes.get(root, 0) + delta
        if n:
            self.root_bytes[root] = n
        else:
            self.root_bytes.pop(root, None)

    def _root(self, root: bytes) -> bytes:
        return self._roots.setdefault(bytes(root), bytes(root))

    def _put_end(self, key: bytes, size: int, root: bytes | None = None) -> None:
        group = self.ends.get(key[:32])
        if group is None:
            parent = bytes(key[:32])
            node = self.nodes.get(parent)  # under a block, else its record's root
            root = node.root if node is not None else root or parent
            group = self.ends[parent] = EndGroup({}, self._root(root))
        delta = size - group.sizes.get(key, 0)
        self.end_bytes += delta
        self._charge(group.root, delta)
        group.sizes[bytes(key)] = size

    def _drop_end(self, key: bytes) -> None:
        group = self.ends.get(key[:32])
        if group is None or key not in group.sizes:
            return
        size = group.sizes.pop(key)
        self.end_bytes -= size
        self._charge(group.root, -size)
        if not group.sizes:
            del self.ends[key[:32]]

    def drop_ends(self, parent: bytes) -> EndGroup | None:
        """Forget every end record under `parent`; what it held."""
        group = self.ends.pop(parent, None)
        if group is not None:
            self.end_bytes -= group.size
            self._charge(group.root, -group.size)
        return group

    def _add(self, key: bytes, header: Header) -> Node:
        root = self._root(header.root)
        node = Node(header.parent, root, header.payload_size, header.state_size, header.has_state)
        self.nodes[bytes(key)] = node
        self.payload_bytes += header.payload_size
        self.state_bytes += header.state_size
        self._charge(root, header.payload_size + header.state_size)
        return node

    def remove(self, key: bytes) -> Node | None:
        """Forget a block (and its state); its parent may become a leaf."""
        node = self.nodes.pop(key, None)
        if node is None:
            return None
        self.payload_bytes -= node.payload_size
        self.state_bytes -= node.state_size
        self._charge(node.root, -node.payload_size - node.state_size)
        parent = self.nodes.get(node.parent)
        if parent is not None:
            parent.children -= 1
            self._queue(node.parent, parent)
        return node

    def drop_state(self, key: bytes) -> None:
        node = self.nodes[key]
        self.state_bytes -= node.state_size
        self._charge(node.root, -node.state_size)
        node.state_size, node.has_state, node.state_used = 0, False, 0.0
        node.state_uses, node.state_prio = 0, 0.0

    def _queue_ends(self, parent: bytes, group: EndGroup) -> None:
        for watcher in self.watchers.get(group.root, ()) if self.watchers else ():
            heapq.heappush(watcher, (group.prio, group.used, _ENDS, parent))
        if not group.queued:
            group.queued = True
            heapq.heappush(self._heap, (group.prio, group.used, _ENDS, parent))

    def _queue(self, key: bytes, node: Node) -> None:
        for watcher in self.watchers.get(node.root, ()) if self.watchers else ():
            if node.has_state:
                heapq.heappush(watcher, (node.state_prio, node.state_used, _STATE, key))
            if node.children == 0:
                heapq.heappush(watcher, (node.prio, node.used, _BLOCK, key))
        if node.has_state and not node.state_queued:
            node.state_queued = True
            heapq.heappush(self._heap, (node.state_prio, node.state_used, _STATE, key))
        if node.children == 0 and not node.queued:
            node.queued = True
            heapq.heappush(self._heap, (node.prio, node.used, _BLOCK, key))

    # -- pins ----------------------------------------------------------------------
    def pin(self, key: bytes, blocks: Sequence[bytes], ends: bytes | None) -> bool:
        """Hold `blocks` (with their states) and the end records under `ends` (a parent,
        or None) for the pin `key`; False if that pin is already held."""
        if key in self.pins:
            return False
        held = tuple(bytes(b) for b in blocks)
        self.pins[key] = (held, ends)
        for b in held:
            self._pinned[b] = self._pinned.get(b, 0) + 1
        if ends is not None:
            self._pinned_ends[ends] = self._pinned_ends.get(ends, 0) + 1
        return True

    def unpin(self, key: bytes) -> bool:
        """Let the pin `key` go; what no other pin holds is a candidate again."""
        held = self.pins.pop(key, None)
        if held is None:
            return False
        blocks, ends = held
        for b in blocks:
            n = self._pinned[b] - 1
            if n:
                self._pinned[b] = n
                continue
            del self._pinned[b]
            node = self.nodes.get(b)
            if node is not None:
                self._queue(b, node)
        if ends is not None:
            n = self._pinned_ends[ends] - 1
            if n:
                self._pinned_ends[ends] = n
            else:
                del self._pinned_ends[ends]
                group = self.ends.get(ends)
                if group is not None:
                    self._queue_ends(ends, group)
        return True

    def pinned(self, key: bytes) -> bool:
        """Whether a pin holds the block `key` (and so its state)."""
        return key in self._pinned

    def ends_pinned(self, parent: bytes) -> bool:
        """Whether a pin holds the end records under `parent`."""
        return parent in self._pinned_ends

    @property
    def pinned_bytes(self) -> int:
        """Bytes the pins hold now: their stored blocks, states and end records."""
        blocks = sum(
            n.payload_size + n.state_size for k in self._pinned if (n := self.nodes.get(k))
        )
        return blocks + sum(g.size for p in self._pinned_ends if (g := self.ends.get(p)))

    # -- choosing ----------------------------------------------------------------
    def pop_victim(self) -> tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup] | None:
        """The next candidate in eviction order (not yet removed, not pinned), or None."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            prio, t, kind, key = entry
            if kind == _ENDS:
                group = self.ends.get(key)
                if group is None:
                    continue
                group.queued = False
                if key in self._pinned_ends:
                    continue  # queued again when its last pin goes
                if (group.prio, group.used) != (prio, t):  # used since: at its new key
                    self._queue_ends(key, group)
                    continue
                return self._chosen(prio, ("ends", key, group))
            node = self.nodes.get(key)
            if node is None:
                continue
            if kind == _STATE:
                node.state_queued = False
                if not node.has_state or key in self._pinned:
                    continue
                if (node.state_prio, node.state_used) != (prio, t):
                    self._queue(key, node)
                    continue
                return self._chosen(prio, ("state", key, node))
            node.queued = False
            if node.children or key in self._pinned:
                continue  # no longer a leaf (or pinned); queued again when that changes
            if (node.prio, node.used) != (prio, t):
                self._queue(key, node)
                continue
            return self._chosen(prio, ("block", key, node))
        return None

    def _chosen(
        self, prio: float, victim: tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup]
    ) -> tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup]:
        if prio > self.age:  # lfu ages: what is used from now on starts at this rank
            self.age = prio
        return victim
