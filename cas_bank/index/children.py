"""The children index: every stored block and end record under its parent, by its
tokens (docs/design.md, "Partial blocks").

A restore that matched M whole blocks asks which stored child of block M-1 (the
namespace root when M = 0) shares the longest prefix with the prompt's next tokens:
attention KV is causal, so that child's first j tokens are exact for the prompt too.

Record (`children` family): key `parent (32 bytes) || the child's tokens as >u4` (a
block: its block_size tokens; an end record: its 1..block_size-1 tail tokens; an end
record with no tail is not indexed: it adds nothing to its parent), value `kind (b"b"
block, b"e" end record) || the child's name (chain hash, or end hash) 32 bytes`.
Big-endian tokens make byte order token order, so the keys under a parent are the
children's token lists in lexicographic order; of strings in that order, the one
sharing the longest prefix with a query is next to it: the last key before the query
or the first one at or after it. One seek (`BlockStore.around`) answers, however many
children a block has.

The index is kept by `Transaction.commit` (`index_writes`): every batch that writes a
header or an end record puts its entry, every batch that deletes one deletes it, so
stores, imports, fetches from the shared tier, eviction, `gc` and `verify --fix` keep
it exact without knowing of it. It is advice, never trusted: a restore reads the
child's own header (or record) and checks it before using it. A bank made before the
index has none for its older records (meta `children_index` is absent): they are
found by `cas-bank verify --fix`, which indexes them and writes the mark.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index.ends import EndHeader, split_record
from cas_bank.index.header import Header, read_headers

log = logging.getLogger("cas_bank")

KIND_BLOCK, KIND_END = b"b", b"e"
INDEXED_KEY = b"children_index"  # meta: every record of this bank is indexed
PARENT = 32


def child_key(parent: bytes, tokens: bytes) -> bytes:
    """The key of the child of `parent` holding `tokens` (<u4 bytes)."""
    return bytes(parent) + np.frombuffer(tokens, dtype="<u4").astype(">u4").tobytes()


def block_entry(h: Header) -> Write:
    return (Family.CHILDREN, child_key(h.parent, h.tokens), KIND_BLOCK + bytes(h.chain_hash))


def end_entry(key: bytes, end: EndHeader) -> Write | None:
    """The index entry of the end record stored under `key`; None for an empty tail."""
    if not end.tail_len:
        return None
    return (Family.CHILDREN, child_key(end.parent, end.tail), KIND_END + key[PARENT:])


@dataclass(frozen=True, slots=True)
class Child:
    """A stored child of `parent` and how many of a query's tokens it shares."""

    parent: bytes
    kind: bytes  # KIND_BLOCK or KIND_END
    name: bytes  # its chain hash (a block) or end hash (an end record)
    tokens: bytes  # its tokens, >u4
    shared: int

    @property
    def is_block(self) -> bool:
        return self.kind == KIND_BLOCK

    @property
    def record_key(self) -> bytes:
        """Its key in the `headers` (a block) or `ends` (an end record) family."""
        return self.name if self.is_block else self.parent + self.name

    def token_ids(self) -> list[int]:
        return [int(t) for t in np.frombuffer(self.tokens, dtype=">u4")]


def shared_tokens(a: bytes, b: bytes) -> int:
    """How many leading 4-byte tokens `a` and `b` have in common (a binary search of
    slice comparisons: no loop over the tokens in Python)."""
    lo, hi = 0, min(len(a), len(b)) // 4  # tokens below lo are shared; from hi on, not known
    if a[: 4 * hi] == b[: 4 * hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def parse_entry(key: bytes, value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(kind, name, tokens as >u4) of an index entry; None if it is not one."""
    body = key[PARENT:]
    if len(value) != 1 + 32 or value[:1] not in (KIND_BLOCK, KIND_END) or not body:
        return None
    if len(body) % 4:
        return None
    return value[:1], value[1:], body


class Neighbours(Protocol):
    """What `nearest_child` reads: a `BlockStore`, or the read view of a bank
    (`index.view.ReadView`: the children of its queued records too)."""

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]: ...


def nearest_child(store: Neighbours, parent: bytes, after: bytes) -> Child | None:
    """The stored child of `parent` sharing the longest prefix (at least one token) with
    `after` (the prompt's tokens after it as >u4, at most a block): one seek (and the
    queued children, through a read view). A block wins a tie with an end record (its
    payload is read the fast way)."""
    if not after:
        return None
    parent = bytes(parent)
    try:
        pairs = store.around(Family.CHILDREN, parent + after, parent)
    except CorruptDataError as e:  # RocksDB's own checks: no partial block this time
        log.warning("cas_bank: children index unreadable (%s); no partial block", e)
        return None
    best: Child | None = None
    for key, value in pairs:
        parsed = parse_entry(key, value)
        if parsed is None:
            continue
        kind, name, tokens = parsed
        j = shared_tokens(tokens, after)
        better = best is None or j > best.shared or (j == best.shared and kind == KIND_BLOCK)
        if j and better:
            best = Child(parent, kind, name, tokens, j)
    return best


def index_writes(store: BlockStore, batch: Sequence[Write]) -> list[Write]:
    """The index entries that keep the children index equal to what `batch` leaves
    stored: a put for every header and end record it writes, a delete for every one it
    removes (the removed header is read for its parent and tokens; an end record's
    entry is found under its parent). A record unreadable here leaves its entry to
    `verify`; a restore checks every entry it uses."""
    last: dict[tuple[Family, bytes], bytes | None] = {}
    for family, key, value in batch:
        if family is Family.HEADERS or family is Family.ENDS:
            last[(family, bytes(key))] = value
    if not last:
        return []
    puts: list[Write] = []
    gone_headers: list[bytes] = []
    gone_ends: dict[bytes, set[bytes]] = {}
    for (family, key), value in last.items():
        if value is None:
            if family is Family.HEADERS:
                gone_headers.append(key)
            else:
                gone_ends.setdefault(key[:PARENT], set()).add(key[PARENT:])
            continue
        try:
            if family is Family.HEADERS:
                puts.append(block_entry(Header.decode(key, value)))
            elif (entry := end_entry(key, split_record(key, value)[0])) is not None:
                puts.append(entry)
        except CorruptDataError:
            continue  # a damaged record written back as it was (verify reports it)
    return [*_deletes(store, gone_headers, gone_ends), *puts]


def _deletes(store: BlockStore, headers: list[bytes], ends: dict[bytes, set[bytes]]) -> list[Write]:
    out: list[Write] = []
    try:
        for h in read_headers(store, headers) if headers else []:
            if h is not None:
                out.append((Family.CHILDREN, block_entry(h)[1], None))
        for parent, names in ends.items():
            for key, value in store.prefixed(Family.CHILDREN, parent):
                if value[:1] == KIND_END and value[1:] in names:
                    out.append((Family.CHILDREN, key, None))
    except CorruptDataError as e:
        log.warning("cas_bank: children index not updated for a removal (%s)", e)
    return out


def expected_entries(
    headers: Iterable[Header], ends: Iterable[tuple[bytes, EndHeader]]
) -> dict[bytes, bytes]:
    """The index of exactly `headers` and the end records `ends` (key, header): key ->
    value (`verify` compares the stored index with it)."""
    out: dict[bytes, bytes] = {}
    for w in [*(block_entry(h) for h in headers), *(end_entry(k, e) for k, e in ends)]:
        if w is not None and w[2] is not None:
            out[w[1]] = w[2]
    return out


def is_indexed(store: BlockStore) -> bool:
    """Whether every record of the bank has its entry (a bank made with the index, or
    one `verify --fix` indexed); an older bank's records before its upgrade do not."""
    try:
        return store.get(Family.META, INDEXED_KEY) is not None
    except CorruptDataError:
        return False
