"""Chain records: the headers of a chain's segments, less their tokens, one record a
segment, so that a reopened lookup of a stored chain reads a few records instead of a
header a block (docs/design.md, "Record families"); `run_writes` keeps them true to every
batch.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import numpy as np

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index.header import (
    FIXED,
    FLAG_STATE,
    HEADER_VERSION,
    Header,
    HeaderSource,
    decoded,
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
# Kept by `run_writes`, which every transaction runs over its batch (as the children
# index): a record is written for every new block that ends a segment or ends the
# chain the batch writes, and deleted with its block. A record copies its ancestors'
# headers, so a header rewritten in place (a state added or dropped, a payload
# written again) would leave the records below it stale: instead the batch raises
# the root's epoch (a record in the same family), and a record is used only while
# the epoch it was written at is the one read beside it (one multi-get: one view of
# the family). Eviction removes leaves (repair whole subtrees) in one batch, so a
# record's block, and with it every block the record names, is stored while the
# record is.
SEGMENT = 64
RUN_VERSION = 1
_RUN = struct.Struct("<BBHIQ")  # version, flags (0), count, first block index, epoch
_EPOCH = struct.Struct("<Q")
EPOCH_PREFIX = b"epoch"


def epoch_key(root: bytes) -> bytes:
    """The `chains` key of the epoch of namespace `root`'s records."""
    return EPOCH_PREFIX + bytes(root)


def _epoch_of(value: bytes | None) -> int:
    """The epoch a `chains` epoch record holds: 0 where there is none (no record of the
    namespace was ever made stale), -1 where it is unreadable (no record is current)."""
    if value is None:
        return 0
    return _EPOCH.unpack(value)[0] if len(value) == _EPOCH.size else -1


def encode_run(first: int, epoch: int, fixed: Sequence[bytes]) -> bytes:
    """A chain record of the headers' fixed parts `fixed`, of blocks `first` on."""
    return _RUN.pack(RUN_VERSION, 0, len(fixed), first, epoch) + b"".join(fixed)


class _Run(NamedTuple):
    """A chain record, parsed (what the hot tier keeps with it): the epoch it was written
    at, the block its first entry stands for, and the headers its entries make."""

    epoch: int
    first: int
    headers: tuple[Header, ...]


def _run_parser(
    root: bytes, hashes: Sequence[BlockHash], tokens: memoryview, step: int
) -> Callable[[bytes, bytes], _Run | None]:
    """`parse` for `get_parsed` of the chain records of the chain `hashes`: a record
    keyed by block i's hash holds the headers of blocks `first`..i, each checked against
    the chain (`_decode_run`); None where it is another version, or does not hold
    exactly them. What it makes of a record depends on the record alone: its key names
    the chain up to it, so the same key is the same blocks and tokens in any prompt."""

    def parse(key: bytes, value: bytes) -> _Run | None:
        if len(key) != 32 or len(value) < _RUN.size:
            return None
        version, _, count, first, epoch = _RUN.unpack_from(value)
        last = first + count - 1
        if (
            version != RUN_VERSION
            or not count
            or len(value) != _RUN.size + count * FIXED.size
            or last >= len(hashes)
            or hashes[last] != key
        ):
            return None
        got = _decode_run(value, _RUN.size, first, count, root, hashes, tokens, step)
        return _Run(epoch, first, tuple(got)) if len(got) == count else None

    return parse


def read_runs(
    store: HeaderSource, root: bytes, hashes: Sequence[BlockHash], tokens: np.ndarray | bytes
) -> tuple[list[Header], bool]:
    """The headers the chain records give of the chain `hashes` (a stored prefix, maybe
    not all of it), and whether the stored chain is known to end there.

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
    whole = n // SEGMENT
    keys = [epoch_key(root), *(hashes[(s + 1) * SEGMENT - 1] for s in range(whole))]
    if n % SEGMENT:
        keys.append(hashes[n - 1])
    try:
        raws, runs = store.get_parsed(Family.CHAINS, keys, parse)
    except CorruptDataError:
        return [], False
    epoch = _epoch_of(raws[0])
    out: list[Header] = []
    for s in range(whole):
        run = cast(_Run | None, runs[1 + s])
        if run is None or run.epoch != epoch or run.first != s * SEGMENT:
            break
        out += run.headers
    else:
        run = cast(_Run | None, runs[-1]) if n % SEGMENT else None
        if run is not None and run.epoch == epoch and run.first == whole * SEGMENT:
            out += run.headers
    first = len(out)
    if first == n:
        return out, True
    if store.get(Family.HEADERS, hashes[first]) is None:
        return out, True  # prefix-closed: nothing after it is stored either
    # The stored part goes on inside the segment from `first` (or a record there is
    # stale): the records of its blocks but its last (asked already), the deepest.
    inner = range(first + 1, min(first + SEGMENT, n) - 1)
    if not inner:
        return out, False
    try:
        raws, runs = store.get_parsed(
            Family.CHAINS, [epoch_key(root), *(hashes[i] for i in inner)], parse
        )
    except CorruptDataError:
        return out, False
    epoch = _epoch_of(raws[0])
    for j in range(len(inner) - 1, -1, -1):
        run = cast(_Run | None, runs[1 + j])
        if run is not None and run.epoch == epoch and run.first == first:
            return out + list(run.headers), False
    return out, False


def _python_run(
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


_decode_run = _native_run() or _python_run


def run_writes(store: BlockStore, writes: Sequence[Write]) -> list[Write]:
    """The `chains` writes that keep the chain records true to a batch `writes` (run
    by every transaction over its batch, before it is written; `store` as it is before
    it): a record for every new block that ends a segment or is the deepest the batch
    writes on its chain; the records of removed blocks deleted; the epoch of every
    namespace whose headers the batch rewrites in place raised (its records stale)."""
    last: dict[bytes, bytes | None] = {}
    for family, key, value in writes:
        if family is Family.HEADERS:
            last[bytes(key)] = None if value is None else bytes(value)
    out: list[Write] = [(Family.CHAINS, k, None) for k, v in last.items() if v is None]
    puts = {k: v for k, v in last.items() if v is not None}
    if not puts:
        return out
    fresh, raised = _new_and_rewritten(store, puts)
    roots = sorted(raised | {h.root for h in fresh.values()})
    epochs, unwritten = _epochs(store, roots, raised)
    for r in sorted(raised):
        epochs[r] += 1
        out.append((Family.CHAINS, epoch_key(r), _EPOCH.pack(epochs[r])))
    parents = {h.parent for h in fresh.values()}
    for key, header in fresh.items():
        if header.index % SEGMENT != SEGMENT - 1 and key in parents:
            continue  # inside a segment, below another new block: that one's record
        root = header.root
        fixed = _segment(store, header, last, epochs[root] if root not in raised else -1)
        if fixed is not None:
            first = header.index - len(fixed) + 1
            out.append((Family.CHAINS, key, encode_run(first, epochs[root], fixed)))
            if root in unwritten and root not in raised:
                # Its epoch, 0, written once: a lookup then finds every key it asks for
                # of a chain stored whole (and the hot tier, written through, holds it).
                out.append((Family.CHAINS, epoch_key(root), _EPOCH.pack(0)))
                unwritten.discard(root)
    return out


def _new_and_rewritten(
    store: BlockStore, puts: dict[bytes, bytes]
) -> tuple[dict[bytes, Header], set[bytes]]:
    """The headers a batch writes anew, and the roots whose headers it rewrites in place
    (every namespace's where a rewritten header cannot be read)."""
    try:
        before: list[bytes | None] | None = store.get_many(Family.HEADERS, list(puts))
    except CorruptDataError:
        before = None  # which are rewrites is unknown: all of them are
    fresh: dict[bytes, Header] = {}
    raised: set[bytes] = set()
    unknown = False
    for i, (key, value) in enumerate(puts.items()):
        header = decoded(key, value)
        old = before[i] if before is not None else value
        if before is not None and old is None:
            if header is not None:
                fresh[key] = header
            continue
        if before is not None and old == value:
            continue  # written again as it was
        was = decoded(key, old) if old is not None else None
        its = {h.root for h in (header, was) if h is not None}
        unknown = unknown or not its
        raised |= its
    if unknown:  # a rewritten header nobody can read: every namespace's records go stale
        raised |= {bytes(k) for k in store.keys(Family.NAMESPACES)}
    return fresh, raised


def _epochs(
    store: BlockStore, roots: list[bytes], raised: set[bytes]
) -> tuple[dict[bytes, int], set[bytes]]:
    """Each root's epoch as stored, and the roots without an epoch record yet; a root
    whose record cannot be read is added to `raised` (written again, from 1)."""
    try:
        stored = store.get_many(Family.CHAINS, [epoch_key(r) for r in roots])
    except CorruptDataError:
        stored = [None] * len(roots)
    epochs: dict[bytes, int] = {}
    unwritten: set[bytes] = set()
    for r, v in zip(roots, stored, strict=True):
        epochs[r] = _epoch_of(v)
        if v is None:
            unwritten.add(r)
        elif epochs[r] < 0:  # unreadable: written again (from 1: no reader took it as 0)
            epochs[r] = 0
            raised.add(r)
    return epochs, unwritten


def _segment(
    store: BlockStore, header: Header, batch: dict[bytes, bytes | None], epoch: int
) -> list[bytes] | None:
    """The fixed parts of the headers of `header`'s segment up to it, as the `batch`
    (its header writes) leaves them: walked up through the batch, then through the
    record of the first ancestor it does not write (where one is current: `epoch`, -1
    for none), else its headers one by one. None where one is missing, removed by the
    batch or unreadable."""
    first = header.index - header.index % SEGMENT
    fixed = [cast(bytes, batch[bytes(header.chain_hash)])[: FIXED.size]]
    cur = header
    while cur.index > first:
        key = bytes(cur.parent)
        if key in batch and batch[key] is None:
            return None  # removed by the batch (no batch removes a block below a new one)
        raw = batch.get(key)
        if raw is None:
            earlier = _stored_segment(store, key, first, cur.index - 1, epoch)
            if earlier is not None:
                return earlier + fixed[::-1]
            try:
                raw = store.get(Family.HEADERS, key)
            except CorruptDataError:
                return None
            if raw is None:
                return None
        parent = decoded(key, raw)
        if parent is None or parent.index != cur.index - 1 or parent.root != header.root:
            return None
        fixed.append(raw[: FIXED.size])
        cur = parent
    return fixed[::-1]


def _stored_segment(
    store: BlockStore, key: bytes, first: int, index: int, epoch: int
) -> list[bytes] | None:
    """The fixed parts in the current record of block `key` (index `index`) from block
    `first` on, or None (no record, or not a current one)."""
    if epoch < 0:
        return None
    try:
        value = store.get(Family.CHAINS, key)
    except CorruptDataError:
        return None
    if value is None or len(value) < _RUN.size:
        return None
    version, _, n, at, written = _RUN.unpack_from(value)
    count = index - first + 1
    if (version, n, at, written) != (RUN_VERSION, count, first, epoch):
        return None
    if len(value) != _RUN.size + count * FIXED.size:
        return None
    size = FIXED.size
    return [value[_RUN.size + j * size : _RUN.size + (j + 1) * size] for j in range(count)]
