"""`verify`'s check of the chain records (`index.chain_records`) and prefix records
(`index.prefixes`) against the headers, and what `fix=True` does with a bad one.

A lookup takes a current record (its epoch the namespace's) in place of the headers it
copies, so a current record that differs from them would restore blocks other than
the stored ones: such a record is a problem, as is one that does not decode, names a
block that is not stored or does not end its segment where its block is. A prefix
record must be carried by its block's chain record (the only way it is deleted with
its block), hold the same headers, and be named by the prefix key of its block's
tokens (recomputed from the key the chain record before it carries, or the root's). A
record that is not current is dead weight, not a problem (the next store past it
writes a current one). The namespace's epoch must read the same in both families.
`fix=True` deletes the bad records: a lookup then reads the headers, as for a chain
stored before the records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cas_bank.blocks.store import Family
from cas_bank.index import chain_records as records
from cas_bank.index import prefixes
from cas_bank.index.header import FIXED, Header
from cas_bank.index.tree import HeaderIndex
from cas_bank.maintenance.verify_problems import Problem, VerifyReport

if TYPE_CHECKING:
    from cas_bank.bank import Bank

_EPOCH_KEY = len(records.EPOCH_PREFIX) + 32


def scan_chains(bank: Bank, index: HeaderIndex) -> list[Problem]:
    """The bad chain and prefix records of `bank` (as far as each family reads)."""
    chains = dict(bank.store.readable(Family.CHAINS))
    kept = dict(bank.store.readable(Family.PREFIXES))
    epochs = _epochs(chains)
    out = _epoch_problems(chains, kept)
    carried: dict[bytes, bytes] = {}  # block -> the prefix key its chain record carries
    for key, value in chains.items():
        if _is_epoch(key):
            continue
        why = _chain_problem(index, epochs, key, value)
        if why is not None:
            out.append(Problem("bad_chain_record", key, why))
        prefix = records.run_prefix(value)
        if prefix is not None and key in index.headers:
            carried[key] = prefix  # a bad record's too: its prefix record is checked
    for key, value in kept.items():
        if not _is_epoch(key):
            why = _prefix_problem(index, chains, carried, key, value)
            if why is not None:
                out.append(Problem("bad_prefix_record", key, why))
    return out


def fix_chains(bank: Bank, bad: list[Problem], report: VerifyReport) -> None:
    """Delete the bad chain and prefix records (an epoch that disagrees, or does not
    read: written in both families as one no record was written at (`fresh_epoch`; one
    more than either could be an epoch records were left stale at), so none is
    current)."""
    chains = [p.chain_hash for p in bad if p.kind == "bad_chain_record"]
    kept = [p.chain_hash for p in bad if p.kind == "bad_prefix_record"]
    if not chains and not kept:
        return
    with bank.transaction(budget=False) as tx:
        for key in chains:
            if _is_epoch(key):  # one no record was written at: none is current
                value = records.encode_epoch(records.fresh_epoch())
                for family in (Family.CHAINS, Family.PREFIXES):
                    tx.put(family, key, value)
                continue
            prefix = records.run_prefix(bank.store.get(Family.CHAINS, key))
            tx.delete(Family.CHAINS, key)
            if prefix is not None:
                tx.delete(Family.PREFIXES, prefix)
        for key in kept:
            tx.delete(Family.PREFIXES, key)
    report.fixed = True


def _epoch_problems(chains: dict[bytes, bytes], kept: dict[bytes, bytes]) -> list[Problem]:
    """The namespaces' epochs that do not read in `chains`, or that `prefixes` holds
    otherwise than `chains` (absent in `chains`: 0; absent in `prefixes`: not kept
    there yet, no problem)."""
    out: list[Problem] = []
    for key in sorted(k for k in {*chains, *kept} if _is_epoch(k)):
        epoch = records.epoch_of(chains.get(key))
        mirrored = records.epoch_of(kept[key]) if key in kept else epoch
        if epoch < 0 or mirrored != epoch:
            why = f"epoch {mirrored} in prefixes, {epoch} in chains (-1: does not read)"
            out.append(Problem("bad_chain_record", key, why))
    return out


def _is_epoch(key: bytes) -> bool:
    return len(key) == _EPOCH_KEY and key.startswith(records.EPOCH_PREFIX)


def _epochs(chains: dict[bytes, bytes]) -> dict[bytes, int]:
    """Each namespace's epoch as `chains` holds it, by root."""
    cut = len(records.EPOCH_PREFIX)
    return {k[cut:]: records.epoch_of(v) for k, v in chains.items() if _is_epoch(k)}


def _segment(index: HeaderIndex, h: Header, count: int) -> list[Header] | None:
    """The stored headers of the `count` blocks up to `h` (its ancestors), in order."""
    out = [h]
    while len(out) < count:
        parent = index.headers.get(out[-1].parent)
        if parent is None:
            return None
        out.append(parent)
    return out[::-1]


def _chain_problem(
    index: HeaderIndex, epochs: dict[bytes, int], key: bytes, value: bytes
) -> str | None:
    """Why the chain record `key` is bad, or None."""
    head = records.run_head(value)
    if head is None:
        return "the chain record does not decode"
    h = index.headers.get(key)
    if h is None:
        if key in index.unreadable:
            return None  # its header is reported; the record goes with its block
        return "the chain record names a block that is not stored"
    _, count, first, epoch = head
    segment = _segment(index, h, count) if count else None
    if segment is None or first != h.index - count + 1 or first % records.SEGMENT:
        return "the chain record does not hold its block's segment up to it"
    stored = b"".join(s.encode()[: FIXED.size] for s in segment)
    at = records.run_size(0, 0)
    if epoch == epochs.get(h.root, 0) and value[at : at + len(stored)] != stored:
        return "the chain record is current and holds headers other than the stored ones"
    return None


def _prefix_problem(
    index: HeaderIndex,
    chains: dict[bytes, bytes],
    carried: dict[bytes, bytes],
    key: bytes,
    value: bytes,
) -> str | None:
    """Why the prefix record `key` is bad, or None."""
    head = records.run_head(value, 32)
    if head is None or head[0]:
        return "the prefix record does not decode"
    block = value[-32:]
    if carried.get(block) != key:
        return "no chain record carries the prefix record"
    _, count, first, _ = head
    if value[:-32] != _unflagged(chains[block]):
        return "the prefix record holds other headers than its chain record"
    h = index.headers[block]  # its chain record names a stored block: checked
    segment = _segment(index, h, count)
    if segment is None:
        return "the prefix record's blocks are not stored"
    if first == 0:
        previous: bytes | None = prefixes.start_key(h.root)
    else:
        previous = carried.get(segment[0].parent)
    if previous is None:
        return "the prefix key of the segment before is not kept"
    tokens = b"".join(s.tokens for s in segment)
    if prefixes.next_key(previous, tokens) != key:
        return "the prefix record is not under the prefix key of its block's tokens"
    return None


def _unflagged(value: bytes) -> bytes:
    """A chain record as its prefix record holds it: flags 0, no prefix key after."""
    head = records.run_head(value)
    assert head is not None
    _, count, first, epoch = head
    at, size = records.run_size(0, 0), FIXED.size
    fixed = [value[at + j * size : at + (j + 1) * size] for j in range(count)]
    return records.encode_run(first, epoch, fixed)
