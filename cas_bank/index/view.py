"""One read view of a bank: everything it has accepted, queued for the background
writer or written, found by every lookup (docs/design.md, "Background writer").

RocksDB's own design is the model: a write is in the memtable before it is in a
table, and every read asks the memtable first. Here the memtable is the writer's
overlay (`write.writer.Queued`): a store queued by `Namespace.store_later` registers
its blocks and boundary states (`QueuedChain`), a queued end record its record
(`QueuedEnd`), when it is queued; the writer retires them once its batch has
committed, or failed (the store then leaves the view, and `flush()` raises it).

A `ReadView` is taken at the start of a lookup (`read_view`): the overlay as it is
then, with the store behind it. A record retires only after its batch commits, so a
view taken before the store is read misses nothing that was accepted: each record is
in the overlay, in the store, or in both. It reads as the store does where lookups
read (`get`, `get_parsed` of headers, `around` of the children index: `index.chain`
and `index.children` take it as a store), and adds what only memory holds:

- headers of queued blocks, with a placeholder digest (`QUEUED_DIGEST`); a written
  header wins (its digests are real), a queued state is added to it;
- end records (`end_records`: queued ones with their arrays, `FoundEnd.held`, unless
  the stored one holds more: logits or a hidden state the queued one lacks; a stored
  one, with where a lease may hold its arrays decoded, `FoundEnd.lease`);
- the children index's entries of queued blocks and end records;
- arrays in memory: a queued chain's or a lease's blocks (`held_blocks`), states
  (`held_state`), a queued block's arrays as a payload would decode (`queued_block`).

A store that admission leaves blocks out of (`BankConfig.admit="second_use"`) shows
them until its write: they are its caller's own arrays, exact for those tokens, and
gone from the view once the write has left them out. (Below `admit_min_tokens` a
store is not put in the view at all: it will write none of its blocks.)

A queued block is never read from a file: every queued header at position j of a
chain comes with a queued chain holding blocks 0..j, so `held_blocks` over a matched
chain reaches at least as deep as its deepest queued header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import mlx.core as mx
import numpy as np

from cas_bank.arrays import HeldArrays, dtype_of
from cas_bank.blocks.codec import Decoded
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.hot import record_heads
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.index.chain import Header
from cas_bank.index.children import KIND_BLOCK, child_key, end_entry
from cas_bank.index.ends import (
    EndHeader,
    EndInput,
    EndPayload,
    FoundEnd,
    end_place,
    stored_end,
)

if TYPE_CHECKING:
    from cas_bank.index.lease import Leases

QUEUED_DIGEST = b"queued for the background writer"
"""The payload (and state) digest of a queued block's header: not a digest, so a
queued header is told from a written one, and never checked against a payload."""
assert len(QUEUED_DIGEST) == 32


def is_queued(header: Header) -> bool:
    """Whether `header` is a queued block's (its arrays are in memory, not in a file)."""
    return header.payload_digest == QUEUED_DIGEST


class QueuedChain:
    """A queued store's full blocks: the chain `hashes` of `tokens` (<u4, whole blocks)
    under `root`, the flat attention arrays holding them all (the store's snapshot)
    and its boundary states by the chain hash of the block that ends there. Headers
    are made when a lookup asks (the store's caller pays for none of them)."""

    __slots__ = ("arrays", "block_size", "hashes", "position", "root", "states", "tokens")

    def __init__(
        self,
        root: bytes,
        hashes: Sequence[BlockHash],
        tokens: np.ndarray,
        block_size: int,
        arrays: Sequence[mx.array],
        states: Mapping[int, Sequence[mx.array]],
    ) -> None:
        self.root = bytes(root)
        self.hashes = [bytes(h) for h in hashes]
        self.position = {h: i for i, h in enumerate(self.hashes)}
        # The queued store's own copy (`write.queued_turn._turn`): a view of it, not another.
        self.tokens = tokens[: len(hashes) * block_size].astype("<u4", copy=False)
        self.block_size = block_size
        self.arrays = HeldArrays(arrays)
        self.states = {self.hashes[b // block_size - 1]: list(st) for b, st in states.items()}

    def header(self, chain_hash: bytes) -> Header | None:
        """The header block `chain_hash` will have (placeholder digests), if queued here."""
        i = self.position.get(chain_hash)
        if i is None:
            return None
        bs = self.block_size
        state = QUEUED_DIGEST if chain_hash in self.states else None
        return Header(
            BlockHash(chain_hash),
            self.root if i == 0 else self.hashes[i - 1],
            i,
            self.root,
            QUEUED_DIGEST,
            0,
            self.tokens[i * bs : (i + 1) * bs].tobytes(),
            state,
        )

    def child_of(self, parent: bytes) -> tuple[bytes, bytes] | None:
        """The children index entry (key, value) of the queued block under `parent`."""
        i = 0 if parent == self.root else self.position.get(parent, -2) + 1
        if not 0 <= i < len(self.hashes):
            return None
        bs = self.block_size
        key = child_key(parent, self.tokens[i * bs : (i + 1) * bs].tobytes())
        return key, KIND_BLOCK + self.hashes[i]

    def block(self, chain_hash: bytes) -> Decoded | None:
        """The arrays of queued block `chain_hash` as its payload would decode (numpy
        views, bf16 as uint16), or None if it is not queued here."""
        i = self.position.get(chain_hash)
        if i is None:
            return None
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        views = [v[..., lo:hi, :] for v in self.arrays.numpy_views()]
        return Decoded(views, [dtype_of(a) for a in self.arrays], False)


class QueuedEnd:
    """A queued end record: its key, header (placeholder digest) and arrays."""

    __slots__ = ("end", "header", "key")

    def __init__(self, root: bytes, hashes: Sequence[BlockHash], end: EndInput, block_size: int):
        parent, tail, self.key = end_place(root, hashes, end.tokens, block_size)
        n = len(end.tokens)
        self.header = EndHeader(parent, bytes(root), n, tail, QUEUED_DIGEST, 0, end.flags)
        self.end = end


class ReadView:
    """The bank as a lookup sees it: `queued` records (the writer's overlay, as taken
    now) in front of `store`, and the arrays `leases` hold. See the module."""

    def __init__(self, store: BlockStore, queued: Sequence[object], leases: Leases | None) -> None:
        self.store = store
        self.leases = leases
        self._chains = [e for e in reversed(queued) if isinstance(e, QueuedChain)]
        # Of two queued records of one end, the one the writer will keep: a later one
        # replaces an earlier only where it holds more (`write.end_records.write_end`).
        self._ends: dict[bytes, QueuedEnd] = {}
        for e in queued:
            if isinstance(e, QueuedEnd):
                earlier = self._ends.get(e.key)
                if earlier is None or not earlier.header.holds(e.header.flags):
                    self._ends[e.key] = e

    # -- as a store, where lookups read ---------------------------------------------
    @property
    def queued_blocks(self) -> bool:
        """Whether a queued store holds blocks: a lookup then reads headers (the chain
        records of `index.chain` name written blocks only)."""
        return bool(self._chains)

    def get(self, family: Family, key: bytes) -> bytes | None:
        raw = self.store.get(family, key)
        if raw is None and family is Family.HEADERS and self._chains:
            header = self._queued_header(key)
            return header.encode() if header is not None else None
        return raw

    def get_parsed(
        self, family: Family, keys: Sequence[bytes], parse: Callable[[bytes, bytes], Any]
    ) -> tuple[list[bytes | None], list[Any]]:
        """The store's records of `keys` and what `parse` made of them; for headers,
        the queued ones where the store has none, and a queued state added to a written
        header that holds none."""
        raws, parsed = self.store.get_parsed(family, keys, parse)
        if family is not Family.HEADERS or not self._chains:
            return raws, parsed
        raws, parsed = list(raws), list(parsed)
        states = any(c.states for c in self._chains)
        for i, key in enumerate(keys):
            if raws[i] is None:
                queued = self._queued_header(key)
                if queued is not None:
                    raws[i], parsed[i] = queued.encode(), queued
            elif states:
                header = cast(Header | None, parsed[i])
                if header is not None and not header.has_state and self._queued_state(key):
                    parsed[i] = header.with_state(QUEUED_DIGEST)
        return raws, parsed

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The store's neighbours of `key` under `prefix`; for the children index, the
        queued children of `prefix` (a parent) too."""
        pairs = list(self.store.around(family, key, prefix))
        if family is Family.CHILDREN:
            pairs += [e for c in self._chains if (e := c.child_of(prefix)) is not None]
            for end in self._ends.values():
                entry = end_entry(end.key, end.header) if end.header.parent == prefix else None
                if entry is not None and entry[2] is not None:
                    pairs.append((entry[1], entry[2]))
        return pairs

    # -- what only memory holds ------------------------------------------------------
    def end_records(self, keys: Sequence[bytes]) -> list[FoundEnd | None]:
        """The end records under `keys` (one multi-get of the store's): a queued one,
        unless the stored one holds more (`_holds_more`: the write will skip the queued
        one as held, so the stored one is what stays); a stored one that does not split
        is None (`verify` reports it). A stored one is told where a lease may hold its
        arrays for its payload digest (`FoundEnd.lease`): asked only by a restore that
        takes them, not by a lookup that reads headers (`Namespace.match`) nor for the
        shallower records found beside the one a restore resumes from."""
        values = record_heads(self.store, Family.ENDS, list(keys)) if keys else []
        lease_of = self.leases.end if self.leases is not None else None
        out: list[FoundEnd | None] = []
        for key, value in zip(keys, values, strict=True):
            stored = stored_end(key, value, lease_of)
            queued = self._ends.get(bytes(key))
            if queued is None or (stored is not None and _holds_more(stored, queued)):
                out.append(stored)
            else:
                out.append(FoundEnd(queued.header, None, queued.end))
        return out

    def keep_end(self, found: FoundEnd, payload: EndPayload) -> None:
        if self.leases is not None:
            self.leases.put_end(found.header.key(), found.header.payload_digest, payload)

    def held_blocks(self, hashes: Sequence[bytes]) -> tuple[int, HeldArrays]:
        """(k, arrays): the arrays in memory (a queued chain's, or a lease's) of the
        deepest block k-1 of the chain `hashes` either holds; (0, none) if neither.
        As `Leases.probe`: the arrays may hold more than k blocks."""
        leased, arrays = self.leases.probe(hashes) if self.leases and hashes else (0, None)
        queued = self._deepest_queued(hashes)
        if queued is not None and queued[0] > leased:
            return queued
        return leased, arrays if arrays is not None else HeldArrays(())

    def held_state(self, chain_hash: bytes) -> list[mx.array] | None:
        """The state at the end of block `chain_hash` in memory (queued or leased), as
        new array objects on the same buffers; None if neither holds it."""
        state = self._queued_state(chain_hash)
        if state is not None:
            out = [a.reshape(a.shape) for a in state]
            mx.eval(out)
            return out
        return self.leases.state(chain_hash) if self.leases is not None else None

    def holds_state(self, chain_hash: bytes) -> bool:
        """Whether `held_state(chain_hash)` finds one (reads no arrays)."""
        if self._queued_state(chain_hash) is not None:
            return True
        return self.leases is not None and self.leases.has_state(chain_hash)

    def queued_block(self, header: Header) -> Decoded | None:
        """A queued block's arrays as its payload would decode; None if not queued."""
        if not is_queued(header):
            return None
        for chain in self._chains:
            block = chain.block(bytes(header.chain_hash))
            if block is not None:
                return block
        return None

    # -- the overlay -----------------------------------------------------------------
    def _queued_header(self, chain_hash: bytes) -> Header | None:
        for chain in self._chains:
            header = chain.header(bytes(chain_hash))
            if header is not None:
                if not header.has_state and self._queued_state(chain_hash) is not None:
                    header = header.with_state(QUEUED_DIGEST)
                return header
        return None

    def _queued_state(self, chain_hash: bytes) -> list[mx.array] | None:
        for chain in self._chains:
            state = chain.states.get(bytes(chain_hash))
            if state is not None:
                return state
        return None

    def _deepest_queued(self, hashes: Sequence[bytes]) -> tuple[int, HeldArrays] | None:
        """(k, arrays) of the queued chain holding the deepest block of `hashes`: a
        binary search (a queued chain holds every block above each of its blocks)."""
        if not self._chains or not hashes:
            return None

        def held(h: bytes) -> bool:
            return any(bytes(h) in c.position for c in self._chains)

        lo, hi = 0, len(hashes)  # blocks below lo are held; from hi on, not
        if held(hashes[-1]):
            lo = hi
        while lo < hi:
            mid = (lo + hi) // 2
            if held(hashes[mid]):
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        last = bytes(hashes[lo - 1])
        chain = next(c for c in self._chains if last in c.position)
        return lo, chain.arrays


def _holds_more(stored: FoundEnd, queued: QueuedEnd) -> bool:
    """Whether the stored record holds all the queued one does and more (logits or the
    hidden state it lacks): `write_end` will skip the queued one as held (the stored one
    intact; a damaged one reads as a miss until the write replaces it, unless a lease
    holds its arrays for the digest its header claims). With the same flags the queued
    one is read (its arrays are in memory; the two are of one prompt)."""
    return stored.header.holds(queued.header.flags) and stored.header.flags != queued.header.flags


class QueueHolder(Protocol):
    """A background writer, as a view sees it: the records of its queued stores."""

    @property
    def queued(self) -> Entries: ...


class Entries(Protocol):
    @property
    def entries(self) -> tuple[object, ...]: ...


class Viewed(Protocol):
    """What a read view is taken of: a bank's store, its writer's queue, its leases."""

    @property
    def store(self) -> BlockStore: ...
    @property
    def writer(self) -> QueueHolder | None: ...
    @property
    def leases(self) -> Leases | None: ...


def read_view(bank: Viewed) -> ReadView:
    """The view of `bank` now: what its background writer holds, then its store."""
    writer = bank.writer
    queued = writer.queued.entries if writer is not None else ()
    return ReadView(bank.store, queued, bank.leases)
