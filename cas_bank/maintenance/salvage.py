"""`salvage`: copy every block and state that still verifies from a damaged bank into a
new one (`cas-bank salvage SRC DST`). The damaged bank is never changed.

The source is copied to a scratch directory first. If that copy does not open
cleanly (a truncated MANIFEST, a damaged table), RocksDB's repair rebuilds the copy's
MANIFEST from the table files it can read (it does not know blob files: payloads are
then read from the blob files directly, each record checked against its header's
digest). Then every header is walked (a walk that fails part-way keeps what it read);
a block is copied when its header decodes, its chain hash recomputes, its payload
matches its digest and its parent was copied (or it is block 0 of a recorded
namespace); a state is copied when it matches its digest; an end record when it
parses under its own name, matches its digest and its parent block was copied (or is
a recorded namespace root). End records RocksDB cannot walk to (past a damaged blob
record) are read from the blob files directly, and checked the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cas_bank.bank import Bank
from cas_bank.blocks import codec
from cas_bank.blocks.bankdir import check_directory
from cas_bank.blocks.hashing import hash_block
from cas_bank.blocks.store import Family
from cas_bank.config import BankConfig
from cas_bank.errors import CasBankError, InvalidInputError, NotABankError
from cas_bank.index.chain import Header
from cas_bank.index.ends import split_record


@dataclass
class SalvageReport:
    repaired: bool = False  # RocksDB's repair rebuilt the copy's MANIFEST
    headers_read: int = 0
    blocks_copied: int = 0
    states_copied: int = 0
    ends_copied: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # why blocks were left behind
    walk_errors: list[str] = field(default_factory=list)
    unreadable_files: list[str] = field(default_factory=list)  # left out of the copy


def _walk(bank: Bank, family: Family, report: SalvageReport) -> Iterator[tuple[bytes, bytes]]:
    return bank.store.readable(
        family, damaged=lambda e: report.walk_errors.append(f"{family.value}: {e}")
    )


def salvage(src: str | Path, dst: str | Path) -> SalvageReport:
    src, dst = Path(src), Path(dst)
    if not check_directory(src, create=False):  # a file, other files: refused there
        raise InvalidInputError(f"no bank at {src}")
    if check_directory(dst, create=True):  # a file, other files: refused there
        raise InvalidInputError(f"{dst} holds a database already: salvage writes a new bank")
    report = SalvageReport()
    scratch = Path(tempfile.mkdtemp(prefix="cas_bank_salvage_"))
    try:
        copy = scratch / "bank"
        report.unreadable_files = _copy_dir(src, copy)
        try:
            old = Bank.open(copy, _COPY_CONFIG)
        except NotABankError as e:  # another program's database: nothing to salvage
            raise NotABankError(str(e).replace(str(copy), str(src))) from None
        except CasBankError:
            from rocksdict import Options, Rdict

            Rdict.repair(str(copy), Options(raw_mode=True))
            report.repaired = True
            old = Bank.open(copy, _COPY_CONFIG)
        with old:
            _copy(old, dst, report, _blob_records(src, key_length=32) if report.repaired else {})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report


_COPY_ATTEMPTS = 3
# The copy read from: no hot tier (each record is read once), no spares (nothing is
# restored; with them the copy's open would make its last session's, up to 1 GiB).
_COPY_CONFIG = BankConfig(hot_bytes=0, spare_bytes=0)


def _copy_dir(src: Path, copy: Path) -> list[str]:
    """Copy the bank's files; the ones that cannot be read (an I/O error: what salvage
    is for) are left out and returned, and RocksDB's repair does without them. A writer
    still running may delete a file mid-copy (after a flush or a compaction): then the
    copy starts again, a few times at most. What is copied is only a source: every
    record is checked before it is written anew."""
    for attempt in range(_COPY_ATTEMPTS):
        unreadable: list[str] = []
        try:
            shutil.copytree(
                src,
                copy,
                ignore=shutil.ignore_patterns("LOCK"),
                copy_function=functools.partial(_copy_or_note, unreadable),
            )
            return unreadable
        except (shutil.Error, FileNotFoundError) as e:
            shutil.rmtree(copy, ignore_errors=True)
            if attempt + 1 == _COPY_ATTEMPTS:
                raise CasBankError(
                    f"could not copy {src}: a writer changed its files during "
                    f"{_COPY_ATTEMPTS} copies ({e}); stop it, or salvage when it is idle"
                ) from None
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def _copy_or_note(unreadable: list[str], source: str, target: str) -> str:
    """Copy one file; one that cannot be read is noted in `unreadable` and left out."""
    try:
        return str(shutil.copy2(source, target))
    except FileNotFoundError:
        raise  # gone since it was listed: a writer at work, copy again
    except OSError as e:
        unreadable.append(f"{source}: {e.strerror or e}")
        return target


_BLOB_FILE_HEADER = 30  # magic, version, family id, flags, compression, expiration range
_BLOB_RECORD = struct.Struct("<QQQII")  # key and value sizes, expiration, two CRCs


def _blob_records(src: Path, key_length: int | None = None) -> dict[bytes, list[bytes]]:
    """Every (key, value) record of the bank's blob files, read without RocksDB; values
    are only candidates (a key has a payload and may have a state): the caller checks
    each against the header's digest (an end record, keyed by 64 bytes, against its
    own). A damaged record ends its file's walk. `key_length`: keep only keys of that
    length (end records: 64), so payloads are not held in memory for nothing."""
    out: dict[bytes, list[bytes]] = {}
    for blob in sorted(src.glob("*.blob")):
        data = blob.read_bytes()
        pos = _BLOB_FILE_HEADER
        while pos + _BLOB_RECORD.size <= len(data):
            klen, vlen, _exp, _hcrc, _bcrc = _BLOB_RECORD.unpack_from(data, pos)
            start = pos + _BLOB_RECORD.size
            if klen not in (32, 64) or start + klen + vlen > len(data):
                break
            key = data[start : start + klen]
            if key_length is None or klen == key_length:
                out.setdefault(key, []).append(data[start + klen : start + klen + vlen])
            pos = start + klen + vlen
    return out


def _copy(old: Bank, dst: Path, report: SalvageReport, blobs: dict[bytes, list[bytes]]) -> None:
    roots = {}
    for root, raw in _walk(old, Family.NAMESPACES, report):
        with contextlib.suppress(ValueError):
            json.loads(raw)
            roots[root] = raw
    headers: list[Header] = []
    for key, raw in _walk(old, Family.HEADERS, report):
        report.headers_read += 1
        try:
            headers.append(Header.decode(key, raw))
        except CasBankError:
            report.skipped["bad_header"] = report.skipped.get("bad_header", 0) + 1
    headers.sort(key=lambda h: h.index)
    config = BankConfig(block_size=old.config.block_size, hot_bytes=0)
    with Bank.open(dst, config) as new:
        # Every namespace that still parses, with or without a block left: `explain`
        # and the tools name them, and a store adds to them as before.
        with new.transaction(budget=False) as tx:
            for root, raw in roots.items():
                tx.put(Family.NAMESPACES, root, raw)
        copied: set[bytes] = set()
        for h in headers:
            payload, why = _payload(old, h, roots, copied, blobs)
            if payload is None:
                report.skipped[why] = report.skipped.get(why, 0) + 1
                continue
            state = _state(old, h, blobs)
            header = h if state is not None or not h.has_state else h.with_state(None)
            with new.transaction(budget=False) as tx:
                tx.put(Family.BLOCKS, h.chain_hash, payload)
                tx.put(Family.HEADERS, h.chain_hash, header.encode())
                # How often each block was stored is history the copy does not keep:
                # counted once (a dedup ratio of 1 from here on).
                tx.add(blocks=1, payload_bytes=len(payload), logical_tokens=len(h.tokens) // 4)
                if state is not None:
                    tx.put(Family.STATES, h.chain_hash, state)
                    tx.add(states=1, state_bytes=len(state))
            copied.add(h.chain_hash)
            report.blocks_copied += 1
            report.states_copied += state is not None
        _copy_ends(old, new, copied, roots, report)


def _copy_ends(
    old: Bank, new: Bank, copied: set[bytes], roots: dict[bytes, bytes], report: SalvageReport
) -> None:
    """The end records that verify and hang under a copied block (or a recorded root).
    Where RocksDB cannot walk them all (a damaged blob file), the blob files are read
    directly for the rest."""
    errors = len(report.walk_errors)
    records = dict(_walk(old, Family.ENDS, report))
    if len(report.walk_errors) > errors:
        for key, values in _blob_records(old.path, key_length=64).items():
            if key not in records:
                records[key] = values[-1]  # the newest; it is checked like the rest
    with new.transaction(budget=False) as tx:
        for key, value in records.items():
            try:
                end, payload = split_record(key, value)
            except CasBankError:
                continue
            if end.parent not in copied and end.parent not in roots:
                continue
            if codec.verify(payload, end.payload_digest):
                tx.put(Family.ENDS, key, value)
                tx.add(ends=1, end_bytes=len(value))
                report.ends_copied += 1


def _payload(
    old: Bank,
    h: Header,
    roots: dict[bytes, bytes],
    copied: set[bytes],
    blobs: dict[bytes, list[bytes]],
) -> tuple[bytes | None, str]:
    """The block's payload if it and its links verify, else None and why not."""
    if hash_block(h.parent, h.tokens) != h.chain_hash:
        return None, "hash_mismatch"
    if h.index == 0 and (h.parent != h.root or h.root not in roots):
        return None, "unknown_namespace"
    if h.index > 0 and h.parent not in copied:
        return None, "below_a_lost_block"
    found = _verified(old, Family.BLOCKS, h.chain_hash, h.payload_size, h.payload_digest, blobs)
    return (found, "") if found is not None else (None, "payload_missing_or_corrupt")


def _verified(
    old: Bank,
    family: Family,
    key: bytes,
    size: int,
    digest: bytes,
    blobs: dict[bytes, list[bytes]],
) -> bytes | None:
    candidates = list(blobs.get(key, ()))
    with contextlib.suppress(CasBankError):
        stored = old.store.get(family, key)
        if stored is not None:
            candidates.insert(0, stored)
    for value in candidates:
        if len(value) == size and codec.verify(value, digest):
            return value
    return None


def _state(old: Bank, h: Header, blobs: dict[bytes, list[bytes]]) -> bytes | None:
    if h.state_digest is None:
        return None
    return _verified(old, Family.STATES, h.chain_hash, h.state_size, h.state_digest, blobs)
