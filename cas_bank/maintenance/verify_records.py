"""`verify`'s checks of the records beside the blocks: end records (`index.ends`), the
children index (`index.children`) and the last-use records, and what `fix=True` does
to each (`cas_bank.maintenance.verify` runs them; its docstring says what is checked)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cas_bank.blocks import codec
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.children import INDEXED_KEY, expected_entries, is_indexed
from cas_bank.index.ends import EndHeader, split_record
from cas_bank.index.records import END_SUFFIX, STATE_SUFFIX, end_access_key
from cas_bank.index.tree import HeaderIndex
from cas_bank.maintenance.verify_problems import Problem, VerifyReport
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.bank import Bank
    from cas_bank.write.txn import Transaction


def scan_ends(
    bank: Bank,
    index: HeaderIndex,
    specs: dict[bytes, ModelSpec],
    bad: set[bytes],
    report: VerifyReport,
    parsed: dict[bytes, EndHeader],
) -> list[tuple[Problem, int]]:
    """Every end record, checked; the bad ones with their sizes (one pass). A walk that
    RocksDB ends at a damaged file is reported (with no key: `--fix` cannot name what
    lies beyond it; `cas-bank salvage` copies what still verifies) after the records
    it did read are checked."""
    out: list[tuple[Problem, int]] = []
    records: list[tuple[bytes, bytes]] = []

    def damaged(e: CorruptDataError) -> None:
        after = f" after {records[-1][0].hex()[:16]}" if records else ""
        why = (
            f"end records unreadable{after}: {_cause(e)}; --fix cannot name the records past "
            "the damage: `cas-bank salvage` copies every one that still verifies"
        )
        out.append((Problem("bad_end", b"", why), 0))

    records.extend(bank.store.readable(Family.ENDS, damaged=damaged))
    if bank.files is not None:  # a record kept as a file whose file is gone: not read above
        for key, size in bank.files.missing_files(Family.ENDS):
            out.append((Problem("bad_end", key, "its file is gone"), size))
    for key, value in records:
        report.ends_checked += 1
        report.bytes_checked += len(value)
        try:
            end, payload = split_record(key, value)
        except CorruptDataError as e:
            out.append((Problem("bad_end", key, str(e)), len(value)))
            continue
        parsed[key] = end
        parent = index.headers.get(end.parent)
        base = end.n_tokens - end.tail_len
        if base == 0:
            linked = end.parent == end.root and end.root in specs
        else:
            linked = (
                parent is not None
                and end.parent not in bad
                and parent.root == end.root
                and parent.end == base
            )
        if not linked:
            what = f"parent {end.parent.hex()[:16]} is not an intact stored block ending at {base}"
            out.append((Problem("dangling_end", key, what, root=end.root), len(value)))
        elif not codec.verify(payload, end.payload_digest):
            out.append((Problem("corrupt_end", key, "digest mismatch", root=end.root), len(value)))
    return out


INDEX_KINDS = frozenset({"bad_child", "unindexed"})


def scan_children(
    bank: Bank, index: HeaderIndex, ends: dict[bytes, EndHeader], report: VerifyReport
) -> list[Problem]:
    """The children index (`index.children`) against the headers and end records: an
    entry naming nothing stored is bad; a record without its entry is unindexed (a
    problem where the bank says every record is indexed; else counted, see
    `VerifyReport.unindexed`)."""
    want = expected_entries(index.headers.values(), ends.items())
    out: list[Problem] = []
    try:
        have = dict(bank.store.iterate(Family.CHILDREN))
    except CorruptDataError as e:
        return [Problem("bad_child", b"", f"children index unreadable: {_cause(e)}")]
    for key, value in have.items():
        if want.get(key) != value:
            out.append(Problem("bad_child", key, "names no stored block or end record"))
    missing = [k for k in want if k not in have]
    if is_indexed(bank.store):
        out += [Problem("unindexed", want[k][1:], "not in the children index") for k in missing]
    else:
        report.unindexed = len(missing)
    return out


def fix_children(
    bank: Bank, index: HeaderIndex, ends: dict[bytes, EndHeader], report: VerifyReport
) -> None:
    """Write the children index of what is stored now, and the mark that it is whole."""
    want = expected_entries(index.headers.values(), ends.items())
    with bank.transaction(budget=False) as tx:
        have = dict(tx.store.readable(Family.CHILDREN))
        for key in have.keys() - want.keys():
            tx.delete(Family.CHILDREN, key)
        for key, value in want.items():
            if have.get(key) != value:
                tx.put(Family.CHILDREN, key, value)
                report.indexed += 1
        tx.put(Family.META, INDEXED_KEY, b"1")
    report.fixed = True


def _cause(e: CorruptDataError) -> str:
    """A read error's message without its advice to run verify (this is verify)."""
    return str(e).partition("; run `")[0]


def scan_access(bank: Bank, index: HeaderIndex) -> list[Problem]:
    """The last-use records, walked once: one of a block, a state or the end records
    under a parent that is not stored is reported (`--fix` deletes it), and so is a
    damaged file among them. The bank works without them (a use it cannot read is
    unknown: eviction takes such a block as unused), and --fix cannot name what it
    cannot read: `cas-bank salvage` writes a bank without the damage."""
    out: list[Problem] = []
    parents = {key[:32] for key, _ in bank.store.readable(Family.ENDS, values=False)}

    def damaged(e: CorruptDataError) -> None:
        why = (
            f"last-use records unreadable: {_cause(e)}; restores and stores go on without "
            "them, `cas-bank salvage` writes a bank without the damage"
        )
        out.append(Problem("bad_access", b"", why))

    for key, _ in bank.store.readable(Family.ACCESS, values=False, damaged=damaged):
        what = _unused_access(index, parents, key)
        if what is not None:
            out.append(Problem("orphan_access", key, what))
    return out


def drop_use(tx: Transaction, key: bytes) -> None:
    """Delete the last-use record `key`, and any use of it not written yet."""
    tx.delete(Family.ACCESS, key)
    name, suffix = key[:32], key[32:]
    if suffix == STATE_SUFFIX:
        tx.forget(states=[name])
    elif suffix == END_SUFFIX:
        tx.forget(ends=[name])
    elif not suffix:
        tx.forget(blocks=[name])


def _unused_access(index: HeaderIndex, parents: set[bytes], key: bytes) -> str | None:
    """Why the last-use record `key` belongs to nothing stored, or None if it does
    (keys: `index.records.access_key` and `end_access_key`)."""
    name, suffix = key[:32], key[32:]
    if name in index.unreadable:
        return None  # its block is reported (bad_header) and goes with it
    header = index.headers.get(name)
    if suffix == b"" and header is None:
        return "last use of a block that is not stored"
    if suffix == STATE_SUFFIX and (header is None or not header.has_state):
        return "last use of a state that is not stored"
    if suffix == END_SUFFIX and name not in parents:
        return "last use of end records none of which is stored"
    if suffix not in (b"", STATE_SUFFIX, END_SUFFIX) or len(name) != 32:
        return "not a last-use key"
    return None


def fix_ends(
    bank: Bank,
    index: HeaderIndex,
    removed: set[bytes],
    bad: list[tuple[Problem, int]],
    report: VerifyReport,
) -> None:
    """Delete the bad end records, and those under blocks `_fix` removed."""
    doomed = {p.chain_hash: size for p, size in bad if p.chain_hash}
    keys: list[bytes] = []
    for key, value in bank.store.readable(Family.ENDS):  # a damaged file: those before it
        if key[:32] in removed:
            doomed[key] = len(value)
        keys.append(key)
    if not doomed:
        return
    parents = {k[:32] for k in keys if k not in doomed}  # of the end records that stay
    with bank.transaction(budget=False) as tx:
        for key in doomed:
            tx.delete(Family.ENDS, key)
        for parent in {k[:32] for k in doomed} - parents:  # their last use goes with them
            tx.delete(Family.ACCESS, end_access_key(parent))
        tx.add(ends=-len(doomed), end_bytes=-sum(doomed.values()))
        tx.forget(ends={k[:32] for k in doomed})
    report.removed_ends += len(doomed)
    report.fixed = True
