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
from typing import NamedTuple, cast

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
    """The headers a prefix record's entries make, each block named by the parent field
    of the entry after it (the last by the 32 bytes after the entries), up to the first
    entry that is not its block. The first entry's parent is taken as it stands (but
    for block 0: the root); the caller links it."""
    size, at = FIXED.size, offset + 24  # an entry's parent field
    last = offset + count * size
    # A block past the tokens: `python_run` would take no entry. Checked first because
    # `names` below has `first` items and `first` is the record's own (up to 2**32 - 1
    # in a damaged one: 32 GiB of list), not the prompt's.
    if count <= 0 or len(value) < last + DIGEST_SIZE or (first + 1) * step > len(tokens):
        return []
    # names[i] for i in first - 1 .. first + count - 1 (what `decode_run` reads)
    names: list[bytes | None] = [None] * (first - 1) if first else []
    names += [
        value[at + j * size : at + j * size + DIGEST_SIZE] for j in range(0 if first else 1, count)
    ]
    names.append(value[last : last + DIGEST_SIZE])
    chain = cast(Sequence[BlockHash], names)
    return records.python_run(value, offset, first, count, root, chain, tokens, step)


class PrefixRun(NamedTuple):
    """A prefix record, parsed (what the hot tier keeps with it): the epoch it was
    written at, the block its first entry stands for, the headers its entries make and
    their chain hashes."""

    epoch: int
    first: int
    headers: tuple[Header, ...]
    hashes: tuple[BlockHash, ...]


def python_prefix_record(
    value: bytes, root: bytes, tokens: memoryview, step: int, cls: type[PrefixRun]
) -> PrefixRun | None:
    """`cas_bank._chain.prefix_record`: the prefix record `value` parsed, with the
    headers its entries make of `tokens` (`python_prefix_run`); None where it is not
    one (another version, flags, no entries, not its length) or an entry is not its
    block."""
    head = records.run_head(value, DIGEST_SIZE)
    if head is None or head[0] or not head[1]:
        return None
    _, count, first, epoch = head
    got = python_prefix_run(value, records.run_size(0, 0), first, count, root, tokens, step)
    if len(got) != count:
        return None
    return cls(epoch, first, tuple(got), tuple(map(_CHAIN_HASH, got)))


def _native_prefix_record() -> Callable[..., PrefixRun | None] | None:
    parse = getattr(chain_module, "prefix_record", None)
    if parse is None or records.decode_run is records.python_run:  # no header type set
        return None
    return cast(Callable[..., PrefixRun | None], parse)


decode_prefix_record = _native_prefix_record() or python_prefix_record


def _prefix_parser(
    root: bytes, tokens: memoryview, step: int
) -> Callable[[bytes, bytes], PrefixRun | None]:
    """`parse` of the prefix records of a chain whose blocks are `tokens` (`step` bytes
    each): what `decode_prefix_record` makes of a record, None where it is another
    version or an entry is not its block. What it makes depends on the record alone
    (its key names the tokens up to it)."""

    def parse(key: bytes, value: bytes) -> PrefixRun | None:
        if len(key) != DIGEST_SIZE:
            return None
        return decode_prefix_record(value, root, tokens, step, PrefixRun)

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
    found = cast("list[PrefixRun | None]", runs)
    hashes: list[BlockHash] = []
    headers: list[Header] = []
    for s in range(len(keys)):
        run = found[1 + s]
        if run is None or not _follows(
            run, epoch, hashes, s * segment, segment if s < whole else tail
        ):
            break
        hashes += run.hashes
        headers += run.headers
    if len(headers) != whole * segment or tail < 2:
        return hashes, headers
    # The chain's end is not stored: the deepest block of the last segment that is
    # (the keys of its blocks, going on from the whole segments').
    at = whole * segment * step
    after = keys[whole - 1] if whole else None
    inner = prefix_keys(root, data[at : n * step - step], segment * step, step, after)
    try:
        raws, runs = store.get_parsed(Family.PREFIXES, [epoch_key, *inner], parse)
    except CorruptDataError:
        return hashes, headers
    if records.epoch_of(raws[0]) == epoch:
        found = cast("list[PrefixRun | None]", runs)
        for b in range(tail - 1, 0, -1):
            run = found[b]
            if run is not None and _follows(run, epoch, hashes, whole * segment, b):
                hashes += run.hashes
                headers += run.headers
                break
    return hashes, headers


def _follows(run: PrefixRun, epoch: int, before: list[BlockHash], first: int, count: int) -> bool:
    """Whether `run` is current and holds blocks `first` on, `count` of them, linked
    to the chain hashes `before` (block 0's parent, the root, is checked with the
    record)."""
    return (
        run.epoch == epoch
        and run.first == first
        and len(run.hashes) == count
        and (not before or run.headers[0].parent == before[-1])
    )
