"""Budget, last-use bookkeeping, and leaf-first eviction.

Last use (`index.access`)
-------------------------
A block's last use is the last time a store covered it (wrote it, or found it
already stored) or a restore returned it; a state's, the last time a store wrote or
offered it or a restore resumed from it. Recorded in memory and written in batches
(with stores, every `access_flush_interval` seconds, at close), never a write per
restore. A block with no access record (an older bank) counts as used at time 0.

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

The leaves come from `index.leaves.LeafIndex`, built on the first eviction of an
open bank (a walk of the small headers and access families, never at open) and
kept current from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import InvalidInputError
from cas_bank.index.access import AccessLog, access_key, last_use
from cas_bank.index.chain import Header
from cas_bank.index.leaves import LeafIndex

if TYPE_CHECKING:
    from cas_bank.bank import Bank

__all__ = [
    "AccessLog",
    "Evicted",
    "EvictionReport",
    "enforce_budget",
    "evict_to_budget",
    "last_use",
    "leaf_index",
]


def leaf_index(bank: Bank) -> LeafIndex:
    """The bank's leaf index, built on first use by walking headers and access records."""
    log = bank.access
    if log.index is None:
        index = LeafIndex()
        index.load(bank.store)
        log.index = index  # touches from now on reach it directly
        index.touch_each(log.pending_items())  # and those from before
    return log.index


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
        index = leaf_index(bank)
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
    deltas = {
        "blocks": -blocks,
        "states": -states,
        "payload_bytes": -payload_bytes,
        "state_bytes": -state_bytes,
        "blocks_evicted": blocks,
        "states_evicted": states,
        "bytes_evicted": payload_bytes + state_bytes,
    }
    bank.counters.add(**deltas)  # the batch below carries them
    # A lone state keeps its block: only the state's pending use goes.
    bank.access.forget(
        access_key(e.chain_hash, state)
        for e in evicted
        for state in ((True,) if e.kind == "state" else (False, True))
    )
    try:
        bank.write(writes)
    except BaseException:
        bank.counters.add(**{k: -v for k, v in deltas.items()})
        bank.access.index = None  # no longer mirrors the disk: rebuild on next use
        raise
    bank.suspect.difference_update(e.chain_hash for e in evicted if e.kind == "block")
    bank.suspect_states.difference_update(e.chain_hash for e in evicted)
