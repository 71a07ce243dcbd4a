"""Budget, last-use bookkeeping, and leaf-first eviction.

Last use (`evict.access`)
-------------------------
A block's last use is the last time a store covered it (wrote it, or found it
already stored) or a restore returned it; a state's, the last time a store wrote or
offered it or a restore resumed from it. Recorded in memory and written in batches
(with stores, every `access_flush_interval` seconds, at close), never a write per
restore. A block with no access record (an older bank) counts as used at time 0.

Eviction order (`evict_to_budget`)
----------------------------------
While payload + state + end-record bytes exceed the budget, remove the first of
these candidates, ordered by (rank, last use, states before end records before
blocks, chain hash):
1. every stored state, on its own: the block stays, only its restore point goes;
2. the end records under a block (or a namespace root), together (`index.ends`: an
   end record is a leaf, used when its group was last stored or restored from);
3. every leaf block (no stored child), together with its state if it has one and
   the end records under it.
The rank is the policy's (`BankConfig.eviction_policy`, `evict.leaves`): `lfu`
(LFU with dynamic aging) ranks a candidate at the aging floor plus its uses, the
floor being the last victim's rank, so what is used often outlives what was used
once more recently, and what was popular once ages out; `lru` ranks all alike, so
the least recently used thing goes first. Within a rank the least recently used
goes first; a state is a candidate on its own and goes before end records and a
block of the same rank and age, and a state whose boundary is rarely restored
(intermediate boundaries, branch points nobody resumes from) goes long before the
blocks it sits on, which restores keep touching. A block with a stored child is
never a candidate: only after its last child goes does it become a leaf, with its
own last use and uses. So no chain ever has a hole. Pinned blocks, their states
and pinned end records are never candidates (`pin_prefix`, `evict.pins`). Evicting
a state alone also rewrites its block's header without the state flag. Every pass
is one atomic batch holding the deletes and the counters they change.

The leaves come from `evict.leaves.LeafIndex`, built (a walk of the small headers,
ends and access families, never at open) at the first store under a budget for
`lfu`, whose use counts start there, else at the first eviction of an open bank;
kept current from then on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cas_bank.blocks.hashing import BlockHash, end_hash
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import InvalidInputError
from cas_bank.evict.access import AccessLog
from cas_bank.evict.evicted import Reason
from cas_bank.evict.leaves import EndGroup, LeafIndex, Node
from cas_bank.evict.pins import Pin, pin_key, pin_writes, read_pins
from cas_bank.index.chain import Header
from cas_bank.index.records import block_deletes, end_deletes, state_deletes
from cas_bank.owner import Writer
from cas_bank.write.txn import Transaction


def leaf_index(store: BlockStore, access: AccessLog) -> LeafIndex:
    """The bank's leaf index, built on first use by walking headers and access records,
    in the access log's policy, with the bank's pins."""
    if access.index is None:
        index = LeafIndex(access.policy)
        index.load(store)
        for pin in read_pins(store):
            index.pin(pin.key, pin.blocks, pin.end_parent)
        access.index = index  # touches from now on reach it directly
        index.touch_each(access.pending_items())  # and those from before
    return access.index


@dataclass(frozen=True, slots=True)
class Evicted:
    """One removal: a state on its own, the end records under a block (or a root) on
    their own, or a leaf block (with its state and end records, if any)."""

    kind: Literal["block", "state", "ends"]
    chain_hash: BlockHash  # the block, or the parent of the end records
    payload_bytes: int  # 0 for a state or end records on their own
    state_bytes: int  # the state's bytes, alone or with its block
    last_use: float  # of the block, or of the state or end records on their own
    end_bytes: int = 0
    ends: int = 0  # end records removed

    @property
    def size(self) -> int:
        """Bytes removed: the payload, the state, the end records."""
        return self.payload_bytes + self.state_bytes + self.end_bytes

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
    pinned_bytes: int = 0  # held by pins, never evicted (bytes_after may exceed the budget)

    @property
    def blocks_evicted(self) -> int:
        return sum(1 for e in self.evicted if e.kind == "block")

    @property
    def ends_evicted(self) -> int:
        return sum(e.ends for e in self.evicted)

    @property
    def states_evicted(self) -> int:
        return sum(1 for e in self.evicted if e.state_bytes > 0)

    @property
    def bytes_evicted(self) -> int:
        return sum(e.size for e in self.evicted)


def evict_to_budget(bank: Writer, max_bytes: int, *, reason: Reason = "budget") -> EvictionReport:
    """Evict in the documented order until payload + state + end bytes <= `max_bytes`.

    Used after a store when `BankConfig.max_bytes` is exceeded, and offline by
    `cas-bank gc` (`reason="gc"`). One transaction for all the deletes, the counters
    and the removal records (`evict.evicted`: what went, when, and `reason`).
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidInputError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
    with bank.transaction(budget=False) as tx:
        access = bank.access
        index = leaf_index(tx.store, access)
        before = index.total
        evicted: list[Evicted] = []
        while index.total > max_bytes:
            victim = index.pop_victim()
            if victim is None:
                break
            if not evicted:  # the index runs ahead of the disk: if the batch fails, rebuild it
                tx.on_abort(lambda: setattr(access, "index", None))
            evicted.append(_evict(tx, index, victim, reason))
        _count_evicted(tx, evicted)
        if not evicted:
            tx.abort()  # nothing to write: the pending uses stay pending
    return EvictionReport(max_bytes, before, index.total, evicted, index.pinned_bytes)


def _evict(
    tx: Transaction,
    index: LeafIndex,
    victim: tuple[Literal["block", "state", "ends"], bytes, Node | EndGroup],
    reason: Reason | None,
) -> Evicted:
    """Remove one victim of `LeafIndex.pop_victim` in `tx` and from `index`; with a
    `reason`, its removal record too (none for a revoked tenant's: `evict.tenants`)."""
    kind, key, node = victim
    if kind == "ends":
        assert isinstance(node, EndGroup)
        return _evict_ends(tx, index, key, node)
    assert isinstance(node, Node)
    if kind == "state":
        return _evict_state(tx, index, key, node, reason)
    return _evict_block(tx, index, key, node, reason)


def _evict_ends(tx: Transaction, index: LeafIndex, key: bytes, group: EndGroup) -> Evicted:
    """The end records under `key` (a block or a namespace root), on their own."""
    tx.extend(end_deletes(list(group.sizes), key))
    tx.forget(ends=[key])
    evicted = Evicted("ends", BlockHash(key), 0, 0, group.used, group.size, len(group.sizes))
    index.drop_ends(key)
    return evicted


def _evict_state(
    tx: Transaction, index: LeafIndex, key: bytes, node: Node, reason: Reason | None
) -> Evicted:
    """A stored state on its own: its block stays, its header loses the state flag."""
    raw = tx.store.get(Family.HEADERS, key)
    assert raw is not None, "the leaf index lists only stored headers"
    tx.extend(state_deletes(Header.decode(key, raw)))
    tx.forget(states=[key])
    tx.clear_suspect(states=[key])
    if reason is not None:
        tx.removed(states=[key], reason=reason)
    evicted = Evicted("state", BlockHash(key), 0, node.state_size, node.state_used)
    index.drop_state(key)
    return evicted


def _evict_block(
    tx: Transaction, index: LeafIndex, key: bytes, node: Node, reason: Reason | None
) -> Evicted:
    """A leaf block, with its state and the end records under it."""
    tx.extend(block_deletes(key, with_state=node.has_state))
    tx.forget(blocks=[key])
    tx.clear_suspect(blocks=[key], states=[key])
    if reason is not None:
        tx.removed(blocks=[key], reason=reason)
    group = index.drop_ends(key)  # an end record goes with its parent
    sizes = group.sizes if group is not None else {}
    if sizes:
        tx.extend(end_deletes(list(sizes), key))
    evicted = Evicted(
        "block",
        BlockHash(key),
        node.payload_size,
        node.state_size,
        node.used,
        sum(sizes.values()),
        len(sizes),
    )
    index.remove(key)
    return evicted


def _count_evicted(tx: Transaction, evicted: list[Evicted]) -> None:
    """The counters `evicted` changes: the bank's totals down, the eviction tallies up."""
    payload_bytes = sum(e.payload_bytes for e in evicted)
    state_bytes = sum(e.state_bytes for e in evicted)
    end_bytes = sum(e.end_bytes for e in evicted)
    ends = sum(e.ends for e in evicted)
    blocks = sum(1 for e in evicted if e.kind == "block")
    states = sum(1 for e in evicted if e.state_bytes > 0)
    tx.add(
        blocks=-blocks,
        states=-states,
        ends=-ends,
        payload_bytes=-payload_bytes,
        state_bytes=-state_bytes,
        end_bytes=-end_bytes,
        blocks_evicted=blocks,
        states_evicted=states,
        ends_evicted=ends,
        bytes_evicted=payload_bytes + state_bytes + end_bytes,
    )


# -- pins ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PinReport:
    """What `pin_prefix` holds."""

    tokens: int  # tokens of the prefix held: its full blocks (and its tail, with ends)
    blocks: int
    bytes: int  # what this prefix holds now: its blocks, their states, its end records
    pinned_bytes: int  # what every pin holds together, this one included
    limit: int | None  # pin_share x max_bytes; None: no budget, no limit
    new: bool  # False: the prefix was pinned already (nothing changed)


def pin_prefix(
    bank: Writer,
    root: bytes,
    tokens: np.ndarray,
    hashes: Sequence[BlockHash],
    *,
    block_size: int,
    max_bytes: int | None,
    share: float,
) -> PinReport:
    """Pin the stored prefix `tokens` (a uint32 array; `hashes` its full blocks' chain
    hashes under `root`): from now on eviction keeps its blocks, their states and, when
    its own end record is stored, the end records under its last block (`evict.pins`).

    Every full block must be stored (`InvalidInputError` says how much is). Refused
    (`InvalidInputError`, with the numbers) when the pinned bytes would pass `share` of
    `max_bytes`. Idempotent; written in one batch, so it survives a restart.
    """
    if not hashes:
        raise InvalidInputError(
            f"nothing to pin: a prefix of {len(tokens)} tokens holds no full block "
            f"(a block is {block_size} tokens)"
        )
    with bank.transaction(budget=False) as tx:
        index = leaf_index(tx.store, bank.access)
        _check_stored(index, root, hashes, block_size)
        last = bytes(hashes[-1])
        tail = tokens[len(hashes) * block_size :]
        group = index.ends.get(last)
        ends = group is not None and last + end_hash(last, tail) in group.sizes
        pin = Pin(
            bytes(root),
            tuple(int(t) for t in tokens),
            tuple(bytes(h) for h in hashes),
            ends,
            bank.access.clock(),
        )
        key = pin.key
        limit = None if max_bytes is None else int(share * max_bytes)
        before = index.pinned_bytes
        new = index.pin(key, pin.blocks, pin.end_parent)
        own = sum(index.nodes[h].payload_size + index.nodes[h].state_size for h in pin.blocks)
        own += group.size if ends and group is not None else 0
        total = index.pinned_bytes
        covered = len(tokens) if ends else len(hashes) * block_size
        report = PinReport(covered, len(hashes), own, total, limit, new)
        if not new:
            tx.abort()
            return report
        if limit is not None and total > limit:
            index.unpin(key)
            raise _past_share(report, before, len(tokens), share, max_bytes)

        def undo() -> None:
            index.unpin(key)

        tx.on_abort(undo)
        tx.extend(pin_writes([pin]))
    return report


def _past_share(
    report: PinReport, before: int, tokens: int, share: float, max_bytes: int | None
) -> InvalidInputError:
    """The refusal of a pin that would take the pinned bytes past `share` of the budget."""
    total = report.pinned_bytes
    return InvalidInputError(
        f"pin refused: pins would hold {total} bytes ({before} pinned now + "
        f"{total - before} for this prefix of {tokens} tokens, {report.bytes} bytes in "
        f"all), over pin_share {share:g} x max_bytes {max_bytes} = {report.limit} bytes"
    )


def _check_stored(
    index: LeafIndex, root: bytes, hashes: Sequence[BlockHash], block_size: int
) -> None:
    """Refuse a pin of a prefix whose full blocks are not all stored, with how much is."""
    stored, parent = 0, root
    for h in hashes:
        node = index.nodes.get(h)
        if node is None or node.parent != parent:
            break
        stored, parent = stored + 1, h
    if stored < len(hashes):
        raise InvalidInputError(
            f"only {stored * block_size} of the prefix's {len(hashes) * block_size} "
            "full-block tokens are stored: store the prefix (and flush) before pinning it"
        )


def unpin_prefix(bank: Writer, root: bytes, tokens: np.ndarray) -> bool:
    """Let the pin of `tokens` under `root` go: what no other pin holds is evicted
    like anything else from now on (at once, down to the bank's budget). False if it
    was not pinned."""
    key = pin_key(root, tokens)
    with bank.transaction() as tx:
        if tx.store.get(Family.META, key) is None:
            tx.abort()
            return False
        tx.delete(Family.META, key)
        index = bank.access.index
        held = index.pins.get(key) if index is not None else None
        if index is not None and held is not None:
            index.unpin(key)

            def undo() -> None:
                index.pin(key, *held)

            tx.on_abort(undo)
    return True


def pins(store: BlockStore) -> list[Pin]:
    """The bank's pins (`evict.pins`)."""
    return read_pins(store)
