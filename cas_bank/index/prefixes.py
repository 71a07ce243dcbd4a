"""Prefix records: a stored chain found from its tokens, without hashing it block by block
(docs/design.md, "Record families").

A chain's names are sequential: block i's hash needs block i-1's, five dependent
BLAKE3 compressions a block of 64 tokens, ~0.1 ms for a 16k-token prompt on a server
core, whatever the SIMD width. A lookup of a chain that is stored needs them only to
find its records. So the records of a chain are also kept under a key made of the
prompt's tokens with wide hashing: the *prefix key*

    P(0)  = blake3(derive_key=PREFIX_CONTEXT, namespace root)
    P(s)  = blake3(key=P(s-1), tokens of segment s as <u4)

over segments of `chain_records.SEGMENT` blocks (16 KiB of tokens at 64 a block, hashed
1 KiB chunks at a time), the last segment of a prefix possibly short. The key of a
prefix of m blocks names its namespace and every token of it (BLAKE3's collision
resistance, as the chain hash), so a record found under it was written for exactly
these tokens.

A prefix record (family `prefixes`, keyed by the prefix key up to its block) is the
chain record of that block (`chain_records`: the same header, epoch and entries)
followed by the block's chain hash: with the parents its entries name, the chain
hash of every block it covers. The namespace's epoch is kept in this family too (the
same value as in `chains`, written with it): a lookup reads it, the record of every
whole segment and that of the prompt's end in one multi-get (one view of the family),
and gets the chain's hashes and headers with no hashing of blocks; where the end is
not stored (a next turn), a second multi-get finds the deepest record of the last
segment.

Kept with the chain records (`chain_records.run_writes`): written beside every chain
record whose prefix key the batch can make (the segment's tokens from the headers, the
key of the segment before from its chain record, which carries it), deleted with it
(its block's chain record names the key). Its own family: a cas_bank that does not
keep these records cannot open a bank that has them (RocksDB refuses an unknown column
family), so none is ever left behind by an eviction that did not know of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import cast

import blake3

from cas_bank.blocks.hashing import DIGEST_SIZE, BlockHash
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index import chain_records as records
from cas_bank.index.header import FIXED, Header, HeaderSource
from cas_bank.native import chain_module

PREFIX_CONTEXT = "cas_bank 2026-12-06 chain prefix v1"
_CHAIN_HASH = attrgetter("chain_hash")
_native_keys: Callable[[bytes, memoryview, int, str | None, int], list[bytes]] | None = getattr(
    chain_module, "prefixes", None
)


def start_key(root: bytes) -> bytes:
    """P(0): the prefix key of no block of namespace `root`."""
    return blake3.blake3(bytes(root), derive_key_context=PREFIX_CONTEXT).digest()


def next_key(previous: bytes, tokens: bytes | memoryview) -> bytes:
    """The prefix key after one more segment (or the short last one) of `tokens`."""
    return blake3.blake3(tokens, key=bytes(previous)).digest()


def prefix_keys(
    root: bytes,
    data: memoryview,
    segment_bytes: int,
    block_bytes: int = 0,
    after: bytes | None = None,
) -> list[bytes]:
    """The prefix keys of `data` (the chain's tokens, <u4 bytes) up to the end of every
    whole segment of `segment_bytes`, then, where a short segment is left, up to the end
    of each of its blocks of `block_bytes` (0: only up to its end). `after`: the key of
    the prefix `data` goes on from (a whole number of segments; None: `data` starts the
    chain). One C call where `cas_bank._chain` is built: the same keys."""
    if _native_keys is not None:
        start, context = (root, PREFIX_CONTEXT) if after is None else (after, None)
        return _native_keys(bytes(start), data, segment_bytes, context, block_bytes)
    return python_prefix_keys(root, data, segment_bytes, block_bytes, after)


def python_prefix_keys(
    root: bytes,
    data: memoryview,
    segment_bytes: int,
    block_bytes: int = 0,
    after: bytes | None = None,
) -> list[bytes]:
    """`prefix_keys` with the blake3 package."""
    key = start_key(root) if after is None else after
    out: list[bytes] = []
    whole = len(data) - len(data) % segment_bytes
    for at in range(0, whole, segment_bytes):
        key = next_key(key, data[at : at + segment_bytes])
        out.append(key)
    if whole < len(data):
        h = blake3.blake3(key=bytes(key))
        each = block_bytes or len(data) - whole
        for at in range(whole, len(data), each):
            h.update(data[at : at + each])
            out.append(h.digest())
    return out


def encode_prefix(first: int, epoch: int, fixed: Sequence[bytes], last: bytes) -> bytes:
    """A prefix record: the chain record of blocks `first` on, then `last`'s chain hash."""
    return records.encode_run(first, epoch, fixed) + bytes(last)


def python_prefix_run(
    value: bytes, offset: int, first: int, count: int, root: bytes, tokens: memoryview, step: int
) -> list[Header]:
    """`cas_bank._chain.prefix_run`: the headers a prefix record's entries make, each
    block named by the parent field of the entry after it (the last by the 32 bytes
    after the entries), up to the first entry that is not its block. The first entry's
    parent is taken as it stands (but for block 0: the root); the caller links it."""
    size, at = FIXED.size, offset + 24  # an entry's parent field
    last = offset + count * size
    if count <= 0 or len(value) < last + DIGEST_SIZE:
        return []
    # names[i] for i in first - 1 .. first + count - 1 (what `decode_run` reads)
    names: list[bytes | None] = [None] * (first - 1) if first else []
    names += [
        value[at + j * size : at + j * size + DIGEST_SIZE] for j in range(0 if first else 1, count)
    ]
    names.append(value[last : last + DIGEST_SIZE])
    chain = cast(Sequence[BlockHash], names)
    return records.python_run(value, offset, first, count, root, chain, tokens, step)


def _native_prefix_run() -> Callable[..., list[Header]] | None:
    run = getattr(chain_module, "prefix_run", None)
    if run is None or records.decode_run is records.python_run:  # no header type set
        return None
    return cast(Callable[..., list[Header]], run)


decode_prefix_run = _native_prefix_run() or python_prefix_run


def _prefix_parser(
    root: bytes, tokens: memoryview, step: int
) -> Callable[[bytes, bytes], records.Run | None]:
    """`parse` of the prefix records of a chain whose blocks are `tokens` (`step` bytes
    each): the headers a record makes, named by the hashes it holds; None where it is
    another version or an entry is not its block (`decode_prefix_run`). What it makes
    depends on the record alone (its key names the tokens up to it)."""
    offset = records.run_size(0, 0)

    def parse(key: bytes, value: bytes) -> records.Run | None:
        head = records.run_head(value, DIGEST_SIZE)
        if head is None or len(key) != DIGEST_SIZE:
            return None
        flags, count, first, epoch = head
        if flags or not count:
            return None
        got = decode_prefix_run(value, offset, first, count, root, tokens, step)
        return records.Run(epoch, first, tuple(got)) if len(got) == count else None

    return parse


def read_prefixes(
    store: HeaderSource, root: bytes, data: memoryview, step: int
) -> tuple[list[BlockHash], list[Header]]:
    """The chain hashes and headers the prefix records give of the chain whose blocks
    are `data` (<u4 token bytes, `step` a block): of every whole segment from the first
    while each is stored, current and linked to the one before, and after them of the
    deepest block of the short last segment that has one (a stored chain that ends
    inside it: a next turn). ([], []) where there is none.

    One multi-get for a chain stored as it is asked: the namespace's epoch, the key of
    every whole segment and that of the chain's end (`prefix_keys`). Where the end is
    not stored, a second of the epoch and the keys of the last segment's other blocks
    (one keyed hasher's digests, going on from the whole segments' key)."""
    n = len(data) // step
    if not n:
        return [], []
    segment = records.SEGMENT
    whole, tail = divmod(n, segment)
    keys = prefix_keys(root, data[: n * step], segment * step)  # the chain's end last
    parse = _prefix_parser(root, data, step)
    epoch_key = records.epoch_key(root)
    asked = [epoch_key, *keys]
    try:
        raws, runs = store.get_parsed(Family.PREFIXES, asked, parse)
    except CorruptDataError:
        return [], []
    epoch = records.epoch_of(raws[0])
    headers: list[Header] = []
    for s, run in enumerate(cast(list[records.Run | None], runs[1:])):
        first, count = s * segment, segment if s < whole else tail
        if not _follows(run, epoch, headers, first, count):
            break
        headers += cast(records.Run, run).headers
    if len(headers) != whole * segment or tail < 2:
        return list(map(_CHAIN_HASH, headers)), headers
    # The chain's end is not stored: the deepest block of the last segment that is
    # (the keys of its blocks, going on from the whole segments').
    at = whole * segment * step
    after = keys[whole - 1] if whole else None
    inner = prefix_keys(root, data[at : n * step - step], segment * step, step, after)
    try:
        raws, runs = store.get_parsed(Family.PREFIXES, [epoch_key, *inner], parse)
    except CorruptDataError:
        return list(map(_CHAIN_HASH, headers)), headers
    if records.epoch_of(raws[0]) == epoch:
        for b in range(tail - 1, 0, -1):
            run = cast(records.Run | None, runs[b])
            if _follows(run, epoch, headers, whole * segment, b):
                headers += cast(records.Run, run).headers
                break
    return list(map(_CHAIN_HASH, headers)), headers


def _follows(
    run: records.Run | None, epoch: int, before: list[Header], first: int, count: int
) -> bool:
    """Whether `run` is current and holds blocks `first` on, `count` of them, linked
    to the headers `before` (block 0's parent, the root, is checked with the record)."""
    return (
        run is not None
        and run.epoch == epoch
        and run.first == first
        and len(run.headers) == count
        and (not before or run.headers[0].parent == before[-1].chain_hash)
    )
