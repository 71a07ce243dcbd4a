"""`verify`: check everything a bank holds, and with `fix=True` remove what is broken.

Checked, per block (the headers family first, then one pass over each payload family):
- the header decodes, and its chain hash recomputes from its parent and tokens;
- its chain link: block 0's parent is its namespace root and that namespace is
  recorded; any other block's parent is a stored block one index up, same namespace;
- its payload is stored, has the size and digest its header names;
- the state its header announces is stored and matches its digest.
Records of the payload and state families that no header claims are found in the
same pass. End records (`index.ends`): each parses, is stored under its own name, hangs
under an intact stored block (or a recorded namespace root) that ends where its tail
starts, and its payload matches its digest. Chain and prefix records
(`maintenance.verify_chains`): a current one holds exactly the stored headers.

A block that fails any block-level check is *bad*; every block below a bad block can
never be restored (a lookup stops at the first broken link) and is *unreachable*.
`fix=True` deletes bad and unreachable blocks with their payloads, states and access
records, drops states that fail their digest (the block stays, without a state), and
deletes unclaimed payloads and states, all in one batch that carries the stats
counters (decremented as `Namespace.store` incremented them); then, in a second batch,
bad end records and those under the blocks it removed. Like diskcache's
`check()`, nothing is changed unless asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import hash_block
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header
from cas_bank.index.ends import EndHeader
from cas_bank.index.records import block_deletes, state_deletes
from cas_bank.index.tree import HeaderIndex, load_namespaces
from cas_bank.maintenance.verify_chains import fix_chains, scan_chains
from cas_bank.maintenance.verify_problems import Problem, ProblemKind, VerifyReport
from cas_bank.maintenance.verify_records import (
    INDEX_KINDS,
    drop_use,
    fix_children,
    fix_ends,
    scan_access,
    scan_children,
    scan_ends,
)
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.bank import Bank
    from cas_bank.write.txn import Transaction

__all__ = ["Problem", "ProblemKind", "VerifyReport", "read_record", "verify"]

_STATE_ONLY = frozenset({"state_missing", "state_corrupt"})


def verify(
    bank: Bank, *, fix: bool = False, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check every header, link, payload and state of `bank`; see the module docstring.

    `fix=True` needs a bank opened read-write. `progress(done, total)` is called as
    payloads are checked.
    """
    if fix and bank.read_only:
        raise RuntimeError(f"verify --fix needs the bank at {bank.path} opened read-write")
    report = VerifyReport()
    specs, bad_specs = load_namespaces(bank.store)
    for root, why in sorted(bad_specs.items()):
        report.problems.append(Problem("bad_namespace", root, why))
    index = HeaderIndex.load(bank.store)
    for key, why in sorted(index.unreadable.items()):
        report.problems.append(Problem("bad_header", key, why))

    found: list[Problem] = []
    for h in index.headers.values():
        found += _check_link(index, specs, h)
    total = len(index.headers) + sum(1 for h in index.headers.values() if h.has_state)
    ticks = _Ticks(total, progress)
    orphans = _scan(bank, index, Family.BLOCKS, report, found, ticks)
    orphans += _scan(bank, index, Family.STATES, report, found, ticks)

    bad = set(index.unreadable) | {p.chain_hash for p in found if p.kind not in _STATE_ONLY}
    bad_state = {p.chain_hash for p in found if p.kind in _STATE_ONLY} - bad
    unreachable = index.descendants(bad) - bad
    for key in unreachable:
        h = index.headers[key]
        found.append(Problem("unreachable", key, "below a bad block", index=h.index, root=h.root))
    # In chain order, so a reader can follow each chain down to where it breaks.
    found.sort(key=lambda p: (p.root or b"", p.index or 0, p.kind, p.chain_hash))
    parsed: dict[bytes, EndHeader] = {}
    ends = scan_ends(bank, index, specs, bad | unreachable, report, parsed)
    uses = scan_access(bank, index)
    report.problems += found + orphans + [p for p, _ in ends] + uses
    report.problems += scan_children(bank, index, parsed, report)
    chains = scan_chains(bank, index)  # the chain and prefix records against the headers
    report.problems += chains
    if fix and report.problems:
        orphans += [p for p in uses if p.kind == "orphan_access"]
        _fix(bank, index, bad, unreachable, bad_state - unreachable, orphans, report)
        fix_ends(bank, index, bad | unreachable, ends, report)
        fix_chains(bank, chains, report)
        index = HeaderIndex.load(bank.store)
        for key in [k for k in parsed if bank.store.get(Family.ENDS, k) is None]:
            del parsed[key]
    if fix and (report.unindexed or any(p.kind in INDEX_KINDS for p in report.problems)):
        fix_children(bank, index, parsed, report)
    if fix and bank.files is not None:
        with bank.write_lock:  # payload files a crash left without their records
            report.removed_orphans += bank.files.sweep()
        index = HeaderIndex.load(bank.store)
    report.counter_drift = _drift(bank, index)
    return report


class _Ticks:
    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.done, self.total, self.progress = 0, total, progress

    def __call__(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)


def _problem(h: Header, kind: ProblemKind, detail: str) -> Problem:
    return Problem(kind, h.chain_hash, detail, index=h.index, root=h.root)


def _check_link(index: HeaderIndex, specs: dict[bytes, ModelSpec], h: Header) -> list[Problem]:
    """The header's own chain hash and its link to its parent (no payload read)."""
    out: list[Problem] = []
    if hash_block(h.parent, h.tokens) != h.chain_hash:
        out.append(
            _problem(h, "hash_mismatch", "chain hash does not recompute from parent and tokens")
        )
    if h.index == 0:
        if h.parent != h.root:
            out.append(_problem(h, "bad_link", "block 0's parent is not its namespace root"))
        elif h.root not in specs:
            out.append(
                _problem(h, "unknown_namespace", f"namespace {h.root.hex()[:16]} is not recorded")
            )
        return out
    parent = index.headers.get(h.parent)
    if parent is None and h.parent not in index.unreadable:
        out.append(_problem(h, "dangling", f"parent {h.parent.hex()[:16]} is not stored"))
    elif parent is not None and (parent.index != h.index - 1 or parent.root != h.root):
        detail = f"parent {h.parent.hex()[:16]} is block {parent.index} of another chain"
        out.append(_problem(h, "bad_link", detail))
    return out


def _check_record(
    h: Header, family: Family, raw: bytes | None, unreadable: str | None
) -> Problem | None:
    """A payload (or state) against the size and digest its header names."""
    state = family is Family.STATES
    size, digest = (h.state_size, h.state_digest) if state else (h.payload_size, h.payload_digest)
    corrupt: ProblemKind = "state_corrupt" if state else "payload_corrupt"
    if unreadable is not None:
        return _problem(h, corrupt, unreadable)
    if raw is None:
        what = "the header announces a state; none is stored" if state else "no payload"
        return _problem(h, "state_missing" if state else "payload_missing", what)
    if len(raw) != size:
        return _problem(h, corrupt, f"{len(raw)} bytes stored, the header says {size}")
    if not codec.verify(raw, digest):
        return _problem(h, corrupt, "digest mismatch")
    return None


def _scan(
    bank: Bank,
    index: HeaderIndex,
    family: Family,
    report: VerifyReport,
    found: list[Problem],
    tick: Callable[[], None],
) -> list[Problem]:
    """Check every record of a payload family against its header, in one pass.

    One pass over the family's (key, value) pairs: RocksDB's iterator reads every blob
    value even to list keys, so listing, then reading each record, would read them all
    twice. Returns the records no header claims. If RocksDB fails mid-way (a damaged
    file), the records not reached yet are read one by one, so one damaged record is
    reported as such and the rest are still checked.
    """
    expected = {k: h for k, h in index.headers.items() if family is Family.BLOCKS or h.has_state}
    seen: set[bytes] = set()
    orphans: list[Problem] = []
    orphan_kind: ProblemKind = "orphan_payload" if family is Family.BLOCKS else "orphan_state"
    walk = iter(bank.store.iterate(family))
    complete = False
    while True:
        try:
            key, raw = next(walk)
        except StopIteration:
            complete = True
            break
        except Exception:  # RocksDB failed mid-walk (a damaged file): read the rest singly
            break
        seen.add(key)
        if key in index.unreadable:
            continue
        h = expected.get(key)
        if h is None:
            what = "payload without a header" if family is Family.BLOCKS else "unannounced"
            orphans.append(Problem(orphan_kind, key, what))
            continue
        _count(report, family, len(raw))
        problem = _check_record(h, family, raw, None)
        if problem is not None:
            found.append(problem)
        tick()
    for key, h in expected.items():
        if key in seen:
            continue
        record, unreadable = (None, None) if complete else read_record(bank, family, key)
        _count(report, family, len(record) if record is not None else None)
        problem = _check_record(h, family, record, unreadable)
        if problem is not None:
            found.append(problem)
        tick()
    return orphans


def _count(report: VerifyReport, family: Family, size: int | None) -> None:
    if family is Family.BLOCKS:
        report.blocks_checked += 1
    else:
        report.states_checked += 1
    report.bytes_checked += size or 0


def read_record(bank: Bank, family: Family, key: bytes) -> tuple[bytes | None, str | None]:
    """A payload or state, or why RocksDB itself could not read it (its own checksum
    on a damaged file): that is a corrupt record to report, not a reason to stop."""
    try:
        return bank.store.get(family, key), None
    except CorruptDataError as e:
        return None, f"unreadable: {e}"


def _size(bank: Bank, family: Family, key: bytes) -> int:
    return len(read_record(bank, family, key)[0] or b"")


def _found(bank: Bank, index: HeaderIndex) -> dict[str, int]:
    """The stored-content counters as the headers tell them (unreadable ones by their
    records' sizes)."""
    heads = index.headers.values()
    found = {
        "blocks": len(index.headers) + len(index.unreadable),
        "states": sum(1 for h in heads if h.has_state),
        "payload_bytes": sum(h.payload_size for h in heads),
        "state_bytes": sum(h.state_size for h in heads),
    }
    for key in index.unreadable:
        state = read_record(bank, Family.STATES, key)[0]
        found["payload_bytes"] += _size(bank, Family.BLOCKS, key)
        found["states"] += state is not None
        found["state_bytes"] += len(state or b"")
    return found


def _found_ends(bank: Bank) -> dict[str, int]:
    """The end-record counters as the records tell them; none where RocksDB cannot
    walk them all (a damaged file, reported by `scan_ends`)."""
    try:
        sizes = [len(v) for _, v in bank.store.iterate(Family.ENDS)]
    except CorruptDataError:
        return {}
    return {"ends": len(sizes), "end_bytes": sum(sizes)}


def _excess(bank: Bank, index: HeaderIndex) -> dict[str, int]:
    counted = bank.counters.values()
    return {k: counted[k] - v for k, v in _found(bank, index).items()}


def _drift(bank: Bank, index: HeaderIndex) -> dict[str, tuple[int, int]]:
    """Stored-content counters that disagree with the headers (informative only: a
    header deleted behind the bank's back leaves its block counted)."""
    counted = bank.counters.values()
    found = _found(bank, index) | _found_ends(bank)
    return {k: (counted[k], v) for k, v in found.items() if counted[k] != v}


def _fix(
    bank: Bank,
    index: HeaderIndex,
    bad: set[bytes],
    unreachable: set[bytes],
    drop_state: set[bytes],
    orphans: list[Problem],
    report: VerifyReport,
) -> None:
    """Delete what `verify` found, in one transaction with the counters it changes."""
    with bank.transaction(budget=False) as tx:
        deltas = {"blocks": 0, "states": 0, "payload_bytes": 0, "state_bytes": 0}
        _delete_blocks(bank, tx, index, bad, unreachable, deltas, report)
        _delete_states(tx, index, drop_state, deltas, report)
        orphaned = _delete_orphans(bank, tx, orphans, report)
        # An unclaimed record was counted if its header was lost after the store (the
        # counters then exceed what the headers hold), not if it was written by hand:
        # take off no more than that excess.
        for name, excess in _excess(bank, index).items():
            deltas[name] -= min(orphaned[name], max(0, excess))
        tx.add(**deltas)
        # Pending last uses of what goes must not be written after it is gone.
        tx.forget(blocks=report.removed_blocks, states=report.removed_states)
        tx.clear_suspect(
            blocks=report.removed_blocks, states=[*report.removed_blocks, *report.removed_states]
        )
    report.fixed = True


def _delete_blocks(
    bank: Bank,
    tx: Transaction,
    index: HeaderIndex,
    bad: set[bytes],
    unreachable: set[bytes],
    deltas: dict[str, int],
    report: VerifyReport,
) -> None:
    """Delete the damaged and unreachable blocks (with their states), taking what they
    held off `deltas`."""
    for key in sorted(bad | unreachable):
        h = index.headers.get(key)
        if h is not None:
            payload_size, state_size, has_state = h.payload_size, h.state_size, h.has_state
        else:  # an unreadable header: size what is there
            state = read_record(bank, Family.STATES, key)[0]
            payload_size = _size(bank, Family.BLOCKS, key)
            state_size = len(state or b"")
            has_state = state is not None
        tx.extend(block_deletes(key))
        deltas["blocks"] -= 1
        deltas["payload_bytes"] -= payload_size
        if has_state:
            deltas["states"] -= 1
            deltas["state_bytes"] -= state_size
        report.removed_blocks.append(key)
        tx.removed([key], reason="unreachable" if key in unreachable else "damaged")


def _delete_states(
    tx: Transaction,
    index: HeaderIndex,
    drop_state: set[bytes],
    deltas: dict[str, int],
    report: VerifyReport,
) -> None:
    """Delete the damaged states of blocks that stay, taking them off `deltas`."""
    for key in sorted(drop_state):
        h = index.headers[key]
        tx.extend(state_deletes(h))
        deltas["states"] -= 1
        deltas["state_bytes"] -= h.state_size
        report.removed_states.append(key)
        tx.removed(states=[key], reason="damaged")


def _delete_orphans(
    bank: Bank, tx: Transaction, orphans: list[Problem], report: VerifyReport
) -> dict[str, int]:
    """Delete the records no header claims; the payloads and states among them, counted
    and sized (last uses are counted by no counter)."""
    orphaned = {"blocks": 0, "states": 0, "payload_bytes": 0, "state_bytes": 0}
    for p in orphans:
        if p.kind == "orphan_access":  # no counter counts last uses
            drop_use(tx, p.chain_hash)
            report.removed_orphans += 1
            continue
        family = Family.BLOCKS if p.kind == "orphan_payload" else Family.STATES
        tx.delete(family, p.chain_hash)
        blocks = family is Family.BLOCKS
        count, size = ("blocks", "payload_bytes") if blocks else ("states", "state_bytes")
        orphaned[count] += 1
        orphaned[size] += _size(bank, family, p.chain_hash)
        report.removed_orphans += 1
    return orphaned
