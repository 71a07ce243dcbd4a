"""The writes that keep the chain records (`index.chain_records`) and the prefix
records (`index.prefixes`) true to a batch: run by every transaction over its batch,
as the children index is (docs/design.md, "Record families").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index import chain_records as records
from cas_bank.index.chain_records import (
    encode_epoch,
    encode_run,
    epoch_key,
    epoch_of,
    fresh_epoch,
    run_head,
    run_prefix,
    run_size,
)
from cas_bank.index.children import is_indexed
from cas_bank.index.header import FIXED, Header, decoded
from cas_bank.index.prefixes import encode_prefix, next_key, start_key

_PARENT = slice(24, 56)  # a header's parent field, in its fixed part
# The most blocks a batch walks to write again the records that copy a header it
# rewrites in place (a seek of the children index each, ~10 us); past it the
# namespace's epoch is raised instead, as where there is no children index.
REWRITE_WALK = 4096


def run_writes(store: BlockStore, writes: Sequence[Write]) -> list[Write]:
    """The `chains` and `prefixes` writes that keep the records true to a batch `writes`
    (`store` as it is before it): a chain record, and its prefix record where its key
    can be made, for every new block that ends a segment or is the deepest the batch
    writes on its chain; the records of removed blocks deleted; those that copy a
    header the batch rewrites in place written again with it (`_rewrite_records`), or
    where that cannot be done the namespace's epoch raised (its records stale)."""
    last: dict[bytes, bytes | None] = {}
    for family, key, value in writes:
        if family is Family.HEADERS:
            last[bytes(key)] = None if value is None else bytes(value)
    removed = [k for k, v in last.items() if v is None]
    out: list[Write] = [(Family.CHAINS, k, None) for k in removed]
    dropped, lost = _prefix_deletes(store, removed)
    out += dropped
    puts = {k: v for k, v in last.items() if v is not None}
    fresh, rewritten, raised = _new_and_rewritten(store, puts, lost)
    repl = {k: cast(bytes, last[k])[: FIXED.size] for k in rewritten}  # their new fixed parts
    if rewritten:
        kept, unhandled = _rewrite_records(store, last, rewritten, repl)
        out += kept
        raised |= unhandled
    if not fresh and not raised:
        return out
    roots = sorted(raised | {h.root for h in fresh.values()})
    epochs, unwritten = _epochs(store, roots, raised)
    for r in sorted(raised):
        epochs[r] += 1
        out += _epoch_writes(r, epochs[r])
    mirrored = set(raised)  # the roots whose epoch the prefix records' family gets here
    parents = {h.parent for h in fresh.values()}
    made: dict[bytes, bytes] = {}  # the prefix keys of the records made here, by block
    for key, header in sorted(fresh.items(), key=lambda item: item[1].index):
        if header.index % records.SEGMENT != records.SEGMENT - 1 and key in parents:
            continue  # inside a segment, below another new block: that one's record
        root = header.root
        epoch = epochs[root] if root not in raised else -1
        fixed = _segment(store, header, last, epoch, repl)
        if fixed is None:
            continue
        first, epoch = header.index - len(fixed) + 1, epochs[root]
        prefix = _prefix_of(store, last, made, root, key, first, fixed)
        out.append((Family.CHAINS, key, encode_run(first, epoch, fixed, prefix)))
        if prefix is not None:
            made[key] = prefix
            out.append((Family.PREFIXES, prefix, encode_prefix(first, epoch, fixed, key)))
        if root in unwritten and root not in raised:
            # Its epoch, 0, written once: a lookup then finds every key it asks for
            # of a chain stored whole (and the hot tier, written through, holds it).
            out += _epoch_writes(root, 0)
            unwritten.discard(root)
            mirrored.add(root)
        elif prefix is not None and root not in mirrored:
            # The epoch beside the prefix record, as `chains` has it (a bank whose
            # epoch was raised before prefix records were kept has none there yet).
            out.append((Family.PREFIXES, epoch_key(root), encode_epoch(epoch)))
            mirrored.add(root)
    return out


def _epoch_writes(root: bytes, epoch: int) -> list[Write]:
    """Namespace `root`'s epoch written in both families that keep it."""
    value = encode_epoch(epoch)
    return [(Family.CHAINS, epoch_key(root), value), (Family.PREFIXES, epoch_key(root), value)]


def _prefix_deletes(store: BlockStore, removed: list[bytes]) -> tuple[list[Write], bool]:
    """The prefix records of the removed blocks' chain records, deleted; and whether the
    chain records could not be read (every namespace's records are then made stale:
    a prefix record left behind must never be current)."""
    if not removed:
        return [], False
    try:
        values = store.get_many(Family.CHAINS, removed)
    except CorruptDataError:
        return [], True
    keys = {p for v in values if (p := run_prefix(v)) is not None}
    return [(Family.PREFIXES, k, None) for k in sorted(keys)], False


def _prefix_of(
    store: BlockStore,
    batch: dict[bytes, bytes | None],
    made: dict[bytes, bytes],
    root: bytes,
    key: bytes,
    first: int,
    fixed: list[bytes],
) -> bytes | None:
    """The prefix key of the chain up to block `key`, whose segment from block `first`
    the headers `fixed` are: from the key up to the segment before (this batch's, or
    the one its last block's chain record carries; the root's for the first) and the
    segment's tokens (from the headers the batch writes, else the stored ones, each
    the very header the record copies). None where any of them is not there."""
    if first == 0:
        previous: bytes | None = start_key(root)
    else:
        before = bytes(fixed[0][_PARENT])
        previous = made.get(before)
        if previous is None:
            try:
                previous = run_prefix(store.get(Family.CHAINS, before))
            except CorruptDataError:
                return None
    if previous is None:
        return None
    names = [bytes(f[_PARENT]) for f in fixed[1:]] + [bytes(key)]
    raws = [batch.get(name) for name in names]
    missing = [i for i, raw in enumerate(raws) if raw is None]
    if missing:
        try:
            got = store.get_many(Family.HEADERS, [names[i] for i in missing])
        except CorruptDataError:
            return None
        for i, raw in zip(missing, got, strict=True):
            raws[i] = raw
    tokens: list[bytes] = []
    for raw, entry in zip(raws, fixed, strict=True):
        if raw is None or raw[: FIXED.size] != entry:
            return None
        tokens.append(raw[FIXED.size :])
    return next_key(previous, b"".join(tokens))


def _rewrite_records(
    store: BlockStore,
    batch: dict[bytes, bytes | None],
    rewritten: dict[bytes, Header],
    repl: dict[bytes, bytes],
) -> tuple[list[Write], set[bytes]]:
    """The stored chain and prefix records that copy a header the batch rewrites in
    place (a state added or dropped, a payload written again), written again with it:
    the records of the block and of its descendants in its segment (found through the
    children index), each at its own epoch. The roots where that cannot be done (a bank
    without a complete children index, a read that fails, more than `REWRITE_WALK`
    blocks to walk) come back instead: their epoch is raised (every record of theirs
    stale) as before."""
    roots = {h.root for h in rewritten.values()}
    if not is_indexed(store):
        return [], roots
    targets: dict[bytes, None] = {}
    try:
        for key, header in rewritten.items():
            end = header.index - header.index % records.SEGMENT + records.SEGMENT - 1
            below = [(key, header.index)]
            while below:
                node, index = below.pop()
                targets[node] = None
                if len(targets) > REWRITE_WALK:  # a bushy subtree: a bounded batch instead
                    return [], roots
                if index < end:
                    below += [
                        (v[1:], index + 1)
                        for _, v in store.prefixed(Family.CHILDREN, node)
                        if v[:1] == b"b"
                    ]
        keys = [k for k in targets if batch.get(k, b"") is not None]  # not removed here
        values = store.get_many(Family.CHAINS, keys)
    except CorruptDataError:
        return [], roots
    out: list[Write] = []
    for key, value in zip(keys, values, strict=True):
        head = run_head(value) if value is not None else None
        if value is None or head is None:
            continue
        _, count, first, epoch = head
        fixed = _entries(value, count, key, repl)
        prefix = run_prefix(value)
        out.append((Family.CHAINS, key, encode_run(first, epoch, fixed, prefix)))
        if prefix is not None:
            out.append((Family.PREFIXES, prefix, encode_prefix(first, epoch, fixed, key)))
    return out, set()


def _entries(value: bytes, count: int, key: bytes, repl: dict[bytes, bytes]) -> list[bytes]:
    """The fixed parts a chain record keyed by `key` holds, those of the blocks in
    `repl` replaced by theirs (each entry's block: the parent of the entry after it,
    the last one `key`)."""
    at, size = run_size(0, 0), FIXED.size
    fixed = [value[at + j * size : at + (j + 1) * size] for j in range(count)]
    if not repl:
        return fixed
    names = [bytes(f[_PARENT]) for f in fixed[1:]] + [bytes(key)]
    return [repl.get(name, f) for name, f in zip(names, fixed, strict=True)]


def _new_and_rewritten(
    store: BlockStore, puts: dict[bytes, bytes], lost: bool
) -> tuple[dict[bytes, Header], dict[bytes, Header], set[bytes]]:
    """The headers a batch writes anew, those it rewrites in place, and the roots whose
    records must go stale instead (every namespace's where a rewritten header cannot be
    read, or where `lost`)."""
    try:
        before: list[bytes | None] | None = (
            store.get_many(Family.HEADERS, list(puts)) if puts else []
        )
    except CorruptDataError:
        before = None  # which are rewrites is unknown: all of them are
    fresh: dict[bytes, Header] = {}
    rewritten: dict[bytes, Header] = {}
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
        if (
            before is not None
            and header is not None
            and was is not None
            and (header.root, header.index) == (was.root, was.index)
        ):
            rewritten[key] = header  # its records are written again with it
            continue
        its = {h.root for h in (header, was) if h is not None}
        unknown = unknown or not its
        raised |= its
    if unknown or lost:  # a rewritten header nobody can read: every namespace's records stale
        raised |= {bytes(k) for k in store.keys(Family.NAMESPACES)}
    return fresh, rewritten, raised


def _epochs(
    store: BlockStore, roots: list[bytes], raised: set[bytes]
) -> tuple[dict[bytes, int], set[bytes]]:
    """Each root's epoch as stored, and the roots without an epoch record yet; a root
    whose record cannot be read (or the read failed) is added to `raised`, its epoch
    written again from `fresh_epoch` (an epoch it had before may be that of records
    left stale since: counting from 0 again would make them current)."""
    try:
        stored: list[bytes | None] = store.get_many(Family.CHAINS, [epoch_key(r) for r in roots])
    except CorruptDataError:
        stored = [b""] * len(roots)  # read as unreadable, not as absent
    epochs: dict[bytes, int] = {}
    unwritten: set[bytes] = set()
    for r, v in zip(roots, stored, strict=True):
        epochs[r] = epoch_of(v)
        if v is None:
            unwritten.add(r)
        elif epochs[r] < 0:
            epochs[r] = fresh_epoch()
            raised.add(r)
    return epochs, unwritten


def _segment(
    store: BlockStore,
    header: Header,
    batch: dict[bytes, bytes | None],
    epoch: int,
    repl: dict[bytes, bytes],
) -> list[bytes] | None:
    """The fixed parts of the headers of `header`'s segment up to it, as the `batch`
    (its header writes) leaves them: walked up through the batch, then through the
    record of the first ancestor it does not write (where one is current: `epoch`, -1
    for none), else its headers one by one. None where one is missing, removed by the
    batch or unreadable."""
    first = header.index - header.index % records.SEGMENT
    fixed = [cast(bytes, batch[bytes(header.chain_hash)])[: FIXED.size]]
    cur = header
    while cur.index > first:
        key = bytes(cur.parent)
        if key in batch and batch[key] is None:
            return None  # removed by the batch (no batch removes a block below a new one)
        raw = batch.get(key)
        if raw is None:
            earlier = _stored_segment(store, key, first, cur.index - 1, epoch, repl)
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
    store: BlockStore, key: bytes, first: int, index: int, epoch: int, repl: dict[bytes, bytes]
) -> list[bytes] | None:
    """The fixed parts in the current record of block `key` (index `index`) from block
    `first` on, those the batch rewrites (`repl`) as it leaves them; or None (no
    record, or not a current one)."""
    if epoch < 0:
        return None
    try:
        value = store.get(Family.CHAINS, key)
    except CorruptDataError:
        return None
    head = run_head(value) if value is not None else None
    count = index - first + 1
    if head is None or head[1:] != (count, first, epoch):
        return None
    assert value is not None
    return _entries(value, count, key, repl)
