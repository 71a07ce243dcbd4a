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
and gets the chain's hashes and headers with no hashing of blocks.

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
_native_keys: Callable[[bytes, memoryview, int, str], list[bytes]] | None = getattr(
    chain_module, "prefixes", None
)


def start_key(root: bytes) -> bytes:
    """P(0): the prefix key of no block of namespace `root`."""
    return blake3.blake3(bytes(root), derive_key_context=PREFIX_CONTEXT).digest()


def next_key(previous: bytes, tokens: bytes | memoryview) -> bytes:
    """The prefix key after one more segment (or the short last one) of `tokens`."""
    return blake3.blake3(tokens, key=bytes(previous)).digest()


def prefix_keys(root: bytes, data: memoryview, segment_bytes: int) -> list[bytes]:
    """The prefix keys of `data` (the chain's tokens, <u4 bytes) up to the end of every
    whole segment of `segment_bytes`, and up to its end where that is not one (one C
    call where `cas_bank._chain` is built: the same keys)."""
    if _native_keys is not None:
        return _native_keys(bytes(root), data, segment_bytes, PREFIX_CONTEXT)
    return python_prefix_keys(root, data, segment_bytes)


def python_prefix_keys(root: bytes, data: memoryview, segment_bytes: int) -> list[bytes]:
    """`prefix_keys` with the blake3 package."""
    key = start_key(root)
    out: list[bytes] = []
    for at in range(0, len(data), segment_bytes):
        key = next_key(key, data[at : at + segment_bytes])
        out.append(key)
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
    while each is stored, current and linked to the one before, and of the last
    (short) one after them. ([], []) where there is none."""
    n = len(data) // step
    if not n:
        return [], []
    keys = [records.epoch_key(root), *prefix_keys(root, data[: n * step], records.SEGMENT * step)]
    try:
        raws, runs = store.get_parsed(Family.PREFIXES, keys, _prefix_parser(root, data, step))
    except CorruptDataError:
        return [], []
    epoch = records.epoch_of(raws[0])
    headers: list[Header] = []
    for s, parsed in enumerate(runs[1:]):
        run = cast(records.Run | None, parsed)
        want = min(records.SEGMENT, n - s * records.SEGMENT)
        if (
            run is None
            or run.epoch != epoch
            or run.first != s * records.SEGMENT
            or len(run.headers) != want
        ):
            break
        if headers and run.headers[0].parent != headers[-1].chain_hash:
            break  # block 0's parent, the root, is checked with the record
        headers += run.headers
    return list(map(_CHAIN_HASH, headers)), headers
