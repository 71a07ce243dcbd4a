"""Chain records: the headers of a chain's segments, less their tokens, one record a
segment, so that a reopened lookup of a stored chain reads a few records instead of a
header a block (docs/design.md, "Record families"): their format and the lookup's
read of them. `index.chain_record_writes` keeps them true to every batch.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import numpy as np

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.header import (
    FIXED,
    FLAG_STATE,
    HEADER_VERSION,
    Header,
    HeaderSource,
    native_decoded,
)
from cas_bank.native import chain_module

_new = tuple.__new__

# A chain record (the `chains` family, docs/design.md "Record families") holds the fixed
# part of every header (`Header.encode()` less its tokens) of one segment of a chain:
# the blocks from the segment's first (index a multiple of SEGMENT) to the block it is
# keyed by. A reopened 16k-token lookup read 256 headers (one RocksDB read each, cold:
# ~1 ms); with records, 4 (docs/measurements.md, "Restore path"). The tokens a header
# holds are the prompt's own (the chain hash commits to them), so a record and the
# prompt make each header byte for byte.
#
# Kept by `chain_record_writes.run_writes`, which every transaction runs over its batch
# (as the children index): a record is written for every new block that ends a segment
# or ends the chain the batch writes, and deleted with its block. A record copies its
# ancestors' headers: a header rewritten in place (a state added or dropped, a payload
# written again) has the records that copy it written again in its batch; where that
# cannot be done the batch raises the root's epoch (a record in the same family), and
# a record is used only while the epoch it was written at is the one read beside it
# (one multi-get: one view of the family). Eviction removes leaves (repair whole
# subtrees) in one batch, so a record's block, and with it every block the record
# names, is stored while the record is.
#
# A record whose flags have FLAG_PREFIX ends with the prefix key of the chain up to its
# block (`index.prefixes`): the key its prefix record is kept under (deleted with it),
# and where the next segment's key starts from.
SEGMENT = 64
RUN_VERSION = 1
FLAG_PREFIX = 1
_RUN = struct.Struct("<BBHIQ")  # version, flags, count, first block index, epoch
_EPOCH = struct.Struct("<Q")
PREFIX_SIZE = 32
EPOCH_PREFIX = b"epoch"


def epoch_key(root: bytes) -> bytes:
    """The `chains` key of the epoch of namespace `root`'s records."""
    return EPOCH_PREFIX + bytes(root)


def encode_epoch(epoch: int) -> bytes:
    """The value of a namespace's epoch record."""
    return _EPOCH.pack(epoch)


def epoch_of(value: bytes | None) -> int:
    """The epoch a `chains` epoch record holds: 0 where there is none (no record of the
    namespace was ever made stale), -1 where it is unreadable (no record is current)."""
    if value is None:
        return 0
    return _EPOCH.unpack(value)[0] if len(value) == _EPOCH.size else -1


def encode_run(
    first: int, epoch: int, fixed: Sequence[bytes], prefix: bytes | None = None
) -> bytes:
    """A chain record of the headers' fixed parts `fixed`, of blocks `first` on, with
    the prefix key of the chain up to its block where it is known."""
    flags = FLAG_PREFIX if prefix is not None else 0
    head = _RUN.pack(RUN_VERSION, flags, len(fixed), first, epoch)
    return head + b"".join(fixed) + (bytes(prefix) if prefix is not None else b"")


def fresh_epoch() -> int:
    """An epoch for a namespace whose epoch record did not read: one no record was
    written at (random, below 2**62; the epochs written before it count up from 0,
    each raise by one), so no record left stale becomes current again."""
    return int.from_bytes(os.urandom(8), "little") >> 2


def run_size(flags: int, count: int) -> int:
    """The length of a chain record of `count` entries with `flags`."""
    return _RUN.size + count * FIXED.size + (PREFIX_SIZE if flags & FLAG_PREFIX else 0)


def run_head(value: bytes, tail: int = 0) -> tuple[int, int, int, int] | None:
    """A chain record's (flags, count, first, epoch), None where it is too short, of
    another version, has flags this version does not know or is not `run_size` long
    (and `tail` bytes more: a prefix record's)."""
    if len(value) < _RUN.size:
        return None
    version, flags, count, first, epoch = _RUN.unpack_from(value)
    size = run_size(flags, count) + tail
    if version != RUN_VERSION or flags & ~FLAG_PREFIX or len(value) != size:
        return None
    return flags, count, first, epoch


def run_prefix(value: bytes | None) -> bytes | None:
    """The prefix key a chain record carries, or None (none, or not a record)."""
    head = run_head(value) if value is not None else None
    if head is None or not head[0] & FLAG_PREFIX:
        return None
    return value[-PREFIX_SIZE:] if value is not None else None


class Run(NamedTuple):
    """A chain record, parsed (what the hot tier keeps with it): the epoch it was written
    at, the block its first entry stands for, and the headers its entries make."""

    epoch: int
    first: int
    headers: tuple[Header, ...]


def _run_parser(
    root: bytes, hashes: Sequence[BlockHash], tokens: memoryview, step: int
) -> Callable[[bytes, bytes], Run | None]:
    """`parse` for `get_parsed` of the chain records of the chain `hashes`: a record
    keyed by block i's hash holds the headers of blocks `first`..i, each checked against
    the chain (`decode_run`); None where it is another version, or does not hold
    exactly them. What it makes of a record depends on the record alone: its key names
    the chain up to it, so the same key is the same blocks and tokens in any prompt."""

    def parse(key: bytes, value: bytes) -> Run | None:
        head = run_head(value)
        if head is None or len(key) != 32:
            return None
        _, count, first, epoch = head
        last = first + count - 1
        if not count or last >= len(hashes) or hashes[last] != key:
            return None
        got = decode_run(value, _RUN.size, first, count, root, hashes, tokens, step)
        return Run(epoch, first, tuple(got)) if len(got) == count else None

    return parse


def read_runs(
    store: HeaderSource,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray | bytes,
    start: int = 0,
) -> tuple[list[Header], bool]:
    """The headers the chain records give of the chain `hashes` from block `start` (a
    segment's first; the blocks before it known stored), a stored part, maybe not all
    of it, and whether the stored chain is known to end there.

    One multi-get of the namespace's epoch, the record of every whole segment's last
    block and that of the chain's last block: a chain stored as it is asked, whole or
    as a prefix of a longer one stored in segments, needs no other read. Short of the
    chain's end, one point read of the next block's header: absent (a miss, a prompt
    that goes on past what is stored), the stored chain ends there. Present (it ends
    inside the segment, or a record there is stale), a second multi-get of the records
    of that segment's blocks gives the deepest one there."""
    n = len(hashes)
    if isinstance(tokens, np.ndarray):
        data = np.ascontiguousarray(tokens, dtype="<u4").data.cast("B")
    else:
        data = memoryview(tokens)
    if not n or len(data) % n:
        return [], False
    parse = _run_parser(root, hashes, data, len(data) // n)
    whole, segments = n // SEGMENT, range(start // SEGMENT, n // SEGMENT)
    keys = [epoch_key(root), *(hashes[(s + 1) * SEGMENT - 1] for s in segments)]
    if n % SEGMENT:
        keys.append(hashes[n - 1])
    try:
        raws, runs = store.get_parsed(Family.CHAINS, keys, parse)
    except CorruptDataError:
        return [], False
    epoch = epoch_of(raws[0])
    out: list[Header] = []
    for j, s in enumerate(segments):
        run = cast(Run | None, runs[1 + j])
        if run is None or run.epoch != epoch or run.first != s * SEGMENT:
            break
        out += run.headers
    else:
        run = cast(Run | None, runs[-1]) if n % SEGMENT else None
        if run is not None and run.epoch == epoch and run.first == whole * SEGMENT:
            out += run.headers
    first = start + len(out)
    if first == n:
        return out, True
    if store.get(Family.HEADERS, hashes[first]) is None:
        return out, True  # prefix-closed: nothing after it is stored either
    return out + _deepest_inside(store, root, hashes, parse, first), False


def _deepest_inside(
    store: HeaderSource,
    root: bytes,
    hashes: Sequence[BlockHash],
    parse: Callable[[bytes, bytes], Run | None],
    first: int,
) -> list[Header]:
    """The headers of the deepest current record of the segment from block `first`
    (where the stored chain goes on inside it, or a record there is stale): one
    multi-get of its blocks' records but the chain's last (asked already)."""
    inner = range(first + 1, min(first + SEGMENT, len(hashes)) - 1)
    if not inner:
        return []
    try:
        raws, runs = store.get_parsed(
            Family.CHAINS, [epoch_key(root), *(hashes[i] for i in inner)], parse
        )
    except CorruptDataError:
        return []
    epoch = epoch_of(raws[0])
    for j in range(len(inner) - 1, -1, -1):
        run = cast(Run | None, runs[1 + j])
        if run is not None and run.epoch == epoch and run.first == first:
            return list(run.headers)
    return []


def python_run(
    value: bytes,
    offset: int,
    first: int,
    count: int,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: memoryview,
    step: int,
) -> list[Header]:
    """`cas_bank._chain.run`: the headers a chain record's entries make with the
    chain's tokens, up to the first that is not the block it stands for (its version,
    index, root, parent or token count)."""
    out: list[Header] = []
    for j in range(count):
        i = first + j
        at = offset + j * FIXED.size
        if at + FIXED.size > len(value):
            break
        fields = FIXED.unpack_from(value, at)
        version, flags, n, index, size, state_size, parent, their_root, pd, sd = fields
        want_parent = root if i == 0 else hashes[i - 1]
        if (
            version != HEADER_VERSION
            or 4 * n != step
            or index != i
            or i >= len(hashes)
            or their_root != root
            or parent != want_parent
            or (i + 1) * step > len(tokens)
        ):
            break
        out.append(
            _new(
                Header,
                (
                    hashes[i],
                    want_parent,
                    i,
                    root,
                    pd,
                    size,
                    bytes(tokens[i * step : (i + 1) * step]),
                    sd if flags & FLAG_STATE else None,
                    state_size,
                ),
            )
        )
    return out


def _native_run() -> Callable[..., list[Header]] | None:
    run = getattr(chain_module, "run", None)
    if run is None or native_decoded is None:  # `set_header_type` was called for it
        return None
    return cast(Callable[..., list[Header]], run)


decode_run = _native_run() or python_run
