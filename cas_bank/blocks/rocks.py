"""The RocksDB backend (through rocksdict, raw mode): one database per bank directory.

Families as in docs/design.md, "Record families". Payload families (blocks, states)
keep values in BlobDB files, uncompressed (KV does not compress; our codec decides per
payload).

Damage on disk (see `cas_bank.blocks.damage`): every read verifies RocksDB's own
checksums (XXH3 on table blocks, CRC32c on blob records), so a damaged table or blob
index is a `CorruptDataError` naming the file, never garbage parsed as structure (that
crashed the process); our blake3 digest stays the payload check above it. Opens that
must not write (`read_only`, `secondary`) open a private view of the directory, so
nothing is written in the bank directory. Every open refuses a path that is no bank
and no place for one (a file, other files, another program's database: `bankdir`). A
read-write open of an existing directory is checked first (`damage.preflight`):
RocksDB deletes table files its MANIFEST does not name, so a bank whose MANIFEST lost
them is refused instead of wiped.

Durability: `wal` (default) writes every batch to the write-ahead log, so a store that
returned survives a crash or SIGKILL. `fast` turns the WAL off and flushes families
atomically: a crash may lose the stores since the last flush, never half a batch.
A `read_only` open is frozen at open time; a `secondary` open follows the writer with
`refresh()` and never takes the writer's lock. RocksDB cannot read a BlobDB family
through a secondary instance (it crashes the process: facebook/rocksdb#13296; even a
walk of the keys of one whose values are in blob files), so a secondary store reads
the blob families (payloads and end records) through a read-only instance that
`refresh()` reopens right after catching up: payloads are never older than headers.

Every use of the database and a reopen exclude each other: after a full disk the
first store to find room reopens the database (`_resume`, on the writer's thread), a
secondary's `refresh()` swaps its payload reader, and `close()` ends it; each waits for
the reads and writes under way, and one that comes meanwhile waits for it to end
(`_enter`, `_alone`). So a restore or a store on another thread sees the database open
or the bank closed (cas_bank's "bank ... is closed" `RuntimeError`), never a database
half reopened. A walk (`iterate`, `prefixed`) holds the gate a step at a time (up to
256 records or 1 MiB), not between steps, so its caller may read and write inside its
loop: one a reopen or refresh interrupts goes on past its last key in the database as
reopened; one a close interrupts raises the closed error instead of ending early.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

from rocksdict import WriteBatch, WriteOptions

from cas_bank.blocks import bankdir, damage
from cas_bank.blocks.damage import (
    RESUME_MARGIN,
    View,
    free_bytes,
    full_error,
    read_error,
    write_error,
)
from cas_bank.blocks.rocks_open import access_type, families_to_open, open_db, open_error
from cas_bank.blocks.rocks_options import BLOB_FAMILIES, db_options, family_options
from cas_bank.blocks.store import PAYLOAD_FAMILIES, BlockStore, Capability, Family, Write
from cas_bank.errors import BankFullError

AccessMode = Literal["read_write", "read_only", "secondary"]

log = logging.getLogger("cas_bank")


_STEP_ITEMS, _STEP_BYTES = 256, 1 << 20  # what one gated step of a walk reads at most


class _Place:
    """Where a walk is: its RocksDB iterator (None before the first step, and once a
    reopen or close dropped it: an iterator holds the database and its LOCK) and the
    last key it gave."""

    __slots__ = ("__weakref__", "family", "it", "last")

    def __init__(self, family: Family) -> None:
        self.family = family
        self.it: Any = None
        self.last: bytes | None = None


class RocksStore(BlockStore):
    """A `BlockStore` on one RocksDB database directory."""

    capabilities = frozenset(Capability)  # every one: a WriteBatch spans the families

    def __init__(
        self, path: str | Path, *, mode: AccessMode = "read_write", durability: str = "wal"
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        self.read_only = mode != "read_write"
        self._view: View | None = None
        self._write_lock = threading.Lock()
        # Reads under way, and whether a reopen or close runs (it waits for them; a
        # read that comes meanwhile waits for it): see `_enter` and `_alone`.
        self._gate_lock = threading.Lock()  # a read takes it directly: ~2x cheaper
        self._gate = threading.Condition(self._gate_lock)
        self._readers = 0
        self._reopening = False
        self._closed = False
        self._walks: weakref.WeakSet[_Place] = weakref.WeakSet()
        self._durability = durability
        # Why writes are refused right now (a full disk), None while the bank writes.
        self._degraded: str | None = None
        self._needed = 0
        # A file, other files, no bank for a reader: refused here (`bankdir`).
        bankdir.check_directory(self.path, create=mode == "read_write")
        if mode == "read_write":
            self.path.mkdir(parents=True, exist_ok=True)
            damage.preflight(
                self.path, {f.value: family_options(f) for f in Family}, db_options(durability)
            )
        else:
            self._view = View(self.path)
        try:
            self._open_retrying()
        except BaseException:
            self._close_view()
            raise

    def _open_retrying(self) -> None:
        """Open; a reader whose view names a file the writer has just deleted (a
        compaction, or a write-ahead log flushed and removed, between linking and
        opening: RocksDB's own error then, or one translated) links again and retries."""
        for attempt in range(5):
            try:
                self._open()
                return
            except Exception as e:
                if self._view is None or "No such file" not in str(e) or attempt == 4:
                    raise
                time.sleep(0.02 * (attempt + 1))
                self._view.sync()

    def _open(self) -> None:
        where = self._view.path if self._view is not None else self.path
        families = families_to_open(self.path, where, self.mode, self._view_path())
        try:
            access = access_type(self.mode, self._view)
            self._db: Any = open_db(where, families, self._durability, access)
        except Exception as e:
            translated = open_error(self.path, e, self._view_path())
            if translated is None:
                raise
            raise translated from None
        self._cf: dict[Family, Any] = {}
        self._handles: dict[Family, Any] = {}
        for f in Family:
            if f.value not in families:
                continue
            self._cf[f] = self._db.get_column_family(f.value)
            if not self.read_only:
                self._handles[f] = self._db.get_column_family_handle(f.value)
        self._write_opt: Any = cast(Any, WriteOptions())
        self._write_opt.disable_wal = self._durability == "fast"  # a property at run time
        self._payload_reader: RocksStore | None = None
        if self.mode == "secondary":
            try:
                self._payload_reader = self._open_payload_reader()
            except BaseException:
                self._close_db()
                raise

    def _open_payload_reader(self) -> RocksStore:
        # The writer may delete a file (compaction) while a read-only open lists them.
        for attempt in range(5):
            try:
                return RocksStore(self.path, mode="read_only", durability=self._durability)
            except Exception as e:
                if "No such file" not in str(e) or attempt == 4:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    @property
    def location(self) -> str:
        return str(self.path)

    # -- reads ---------------------------------------------------------------------
    def _family(self, family: Family) -> Any:
        try:
            return self._cf[family]
        except KeyError:
            if self._db is None:
                raise RuntimeError(f"bank at {self.path} is closed") from None
            raise KeyError(f"bank at {self.path} has no {family.value!r} family") from None

    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        self._enter()
        try:
            if self._payload_reader is not None and family in BLOB_FAMILIES:
                return self._payload_reader.get_many(family, keys)  # its own errors
            try:
                if family not in self._cf and self._db is not None:
                    return [None] * len(keys)
                out: list[bytes | None] = self._family(family).get(list(keys))
            except Exception as e:
                raise self._read_error(e, family) from None
        finally:
            self._leave()
        return out

    def get(self, family: Family, key: bytes) -> bytes | None:
        self._enter()
        try:
            if self._payload_reader is not None and family in BLOB_FAMILIES:
                return self._payload_reader.get(family, key)  # its own errors
            try:
                if family not in self._cf and self._db is not None:
                    return None
                out: bytes | None = self._family(family).get(key)
            except Exception as e:
                raise self._read_error(e, family) from None
        finally:
            self._leave()
        return out

    def _enter(self) -> None:
        """A read begins: it waits while a reopen or close runs (`_alone`)."""
        with self._gate_lock:
            while self._reopening:
                self._gate.wait()
            self._readers += 1

    def _leave(self) -> None:
        with self._gate_lock:
            self._readers -= 1
            if self._reopening and not self._readers:
                self._gate.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """No read under way, and none begins, while the database is reopened or
        closed (one at a time)."""
        with self._gate:
            while self._reopening:
                self._gate.wait()
            self._reopening = True
            while self._readers:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._reopening = False
                self._gate.notify_all()

    def _read_error(self, e: Exception, family: Family) -> Exception:
        """RocksDB's own checksums failing, or a file gone, is a `CorruptDataError`."""
        return read_error(e, self.path, family.value, self._view_path())

    def _view_path(self) -> Path | None:
        return None if self._view is None else self._view.path

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        return self._walk(family, values, None)

    def prefixed(self, family: Family, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self._walk(family, True, prefix)

    def _walk(
        self, family: Family, values: bool, prefix: bytes | None
    ) -> Generator[tuple[bytes, bytes], None, None]:
        """Every (key, value) of a family (or of its keys under `prefix`), in key order,
        read in steps (`_step`) that each hold the gate."""
        place = _Place(family)
        self._walks.add(place)  # a reopen or close drops its iterator (`_drop_walks`)
        try:
            while True:
                items, done = self._step(place, values, prefix)
                yield from items
                if done:
                    return
        finally:
            place.it = None

    def _step(
        self, place: _Place, values: bool, prefix: bytes | None
    ) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The walk's next items (up to `_STEP_ITEMS` or `_STEP_BYTES`), and whether it
        ended. A walk whose iterator a reopen dropped seeks again past its last key; a
        closed bank raises. rocksdict's `items()` ends quietly at a damaged block or
        blob as if the family ended there: the iterator's own status is asked instead."""
        self._enter()
        try:
            if place.it is None and not self._seek(place, prefix):
                return [], True
            it, out, size = place.it, list[tuple[bytes, bytes]](), 0
            while it.valid():
                k = it.key()
                if prefix is not None and not k.startswith(prefix):
                    break
                v = it.value() if values else b""
                out.append((k, v))
                it.next()
                size += len(k) + len(v)
                if len(out) >= _STEP_ITEMS or size >= _STEP_BYTES:
                    place.last = k
                    return out, False
            it.status()  # raises if the walk stopped at an error, not at the end
            place.it = None
            return out, True
        except Exception as e:
            place.it = None
            raise self._read_error(e, place.family) from None
        finally:
            self._leave()

    def _seek(self, place: _Place, prefix: bytes | None) -> bool:
        """A new iterator for the walk at its place (False: the bank has no such
        family); under the gate."""
        family, last = place.family, place.last
        reader = self._payload_reader
        store = reader if reader is not None and family in BLOB_FAMILIES else self
        if family not in store._cf and store._db is not None:
            return False
        it = store._family(family).iter()  # "bank ... is closed" once closed
        if last is not None:
            it.seek(last)
            if it.valid() and it.key() == last:
                it.next()
        elif prefix is not None:
            it.seek(prefix)
        else:
            it.seek_to_first()
        place.it = it
        return True

    def _drop_walks(self, families: frozenset[Family] | None = None) -> None:
        """Drop the iterators of the walks (of `families`, else all) under `_alone`:
        their next step seeks again, or says the bank is closed."""
        for place in list(self._walks):
            if families is None or place.family in families:
                place.it = None

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """One seek to `key`, then a step back (docs/design.md, "Partial blocks")."""
        self._enter()
        try:
            if self._payload_reader is not None and family in BLOB_FAMILIES:
                return self._payload_reader.around(family, key, prefix)
            return self._around(family, key, prefix)
        finally:
            self._leave()

    def _around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        if family not in self._cf and self._db is not None:
            return []
        it = self._family(family).iter()
        try:
            out: list[tuple[bytes, bytes]] = []
            it.seek(key)
            if it.valid():
                k = it.key()
                if k.startswith(prefix):
                    out.append((k, it.value()))
                it.prev()
            else:
                it.seek_to_last()
            if it.valid():
                k = it.key()
                if k.startswith(prefix) and k < key:
                    out.insert(0, (k, it.value()))
            it.status()
            return out
        except Exception as e:
            raise self._read_error(e, family) from None
        finally:
            del it

    # -- writes --------------------------------------------------------------------
    def put_batch(self, writes: Sequence[Write]) -> None:
        if not writes:  # nothing to do, also after close (a second Bank.close flushes nothing)
            return
        if self.read_only:
            raise RuntimeError(f"bank at {self.path} is open {self.mode}")
        needed = sum(len(k) + len(v or b"") for _, k, v in writes)
        with self._write_lock:
            if self._degraded is not None:
                self._resume(needed)
            self._enter()  # a close waits for the write, or the write finds it closed
            try:
                self._write(writes, needed)
            finally:
                self._leave()

    def _write(self, writes: Sequence[Write], needed: int) -> None:
        if self._db is None:
            raise RuntimeError(f"bank at {self.path} is closed")
        wb = WriteBatch(raw_mode=True)
        for family, key, value in writes:
            if value is None:
                wb.delete(key, self._handles[family])
            else:
                wb.put(key, value, self._handles[family])
        try:
            self._db.write(wb, self._write_opt)
        except Exception as e:
            raise self._write_failed(e, needed) from None

    def degraded(self) -> str | None:
        return self._degraded

    def _write_failed(self, e: Exception, needed: int) -> Exception:
        err = write_error(e, self.path, needed)
        if isinstance(err, BankFullError):
            # RocksDB stops writing after a failed write or flush until it is reopened.
            self._degraded, self._needed = str(err), needed
            log.warning("cas_bank: %s", err)
        return err

    def _resume(self, needed: int) -> None:
        """After a full disk: refuse at once while it is still full; once there is room,
        reopen (RocksDB refuses every write after the error until then)."""
        if free_bytes(self.path) < needed + RESUME_MARGIN:
            raise full_error(self.path, needed)
        with self._alone():
            if self._closed:
                raise RuntimeError(f"bank at {self.path} is closed")
            if self._db is not None and self._durability == "wal":
                # A close after the error waits ~1 s for RocksDB's background flush
                # (failing); the write-ahead log holds what the memtables do.
                self._db.cancel_all_background(False)
            self._close_db()
            try:
                self._open()
            except Exception as e:
                self._db = None
                raise self._write_failed(e, needed) from None
            self._degraded = None
        log.warning("cas_bank: bank at %s writes again (space was freed)", self.path)

    def flush(self) -> None:
        """Write every family's memtable to disk (`Rdict.flush` alone does the default one).

        Payload families go first: a crash between flushes can then leave a payload
        without its header (invisible), never a header without its payload.
        """
        self._enter()
        try:
            self._flush()
        finally:
            self._leave()

    def _flush(self) -> None:
        if self._db is None or self.read_only or self._degraded is not None:
            return
        for family in (*PAYLOAD_FAMILIES, *(f for f in Family if f not in PAYLOAD_FAMILIES)):
            cf = self._cf.get(family)
            if cf is not None:
                try:
                    cf.flush()
                except Exception as e:
                    raise self._write_failed(e, 0) from None

    def refresh(self) -> None:
        """A secondary catches up with the writer, then reopens its payload reader: a
        read or walk on another thread waits for the swap (walks of the payload
        families go on past their last key in the new reader); one at a time."""
        if self.mode != "secondary":
            return
        with self._write_lock:  # unused for writes by a secondary: one refresh at a time
            self._enter()
            try:
                if self._db is None:
                    return
                assert self._view is not None
                self._view.sync()  # files the writer added since
                self._db.try_catch_up_with_primary()
            finally:
                self._leave()
            fresh = self._open_payload_reader()
            with self._alone():
                old = self._payload_reader if self._db is not None else fresh
                if old is not fresh:
                    self._payload_reader = fresh
                    self._drop_walks(BLOB_FAMILIES)
            if old is not None:
                old.close()

    def disk_bytes(self) -> int | None:
        """Table and blob files, and the write-ahead logs (not yet flushed stores)."""
        self._enter()
        try:
            if self._db is None:
                return None
            total = 0
            for cf in self._cf.values():
                for prop in ("rocksdb.total-sst-files-size", "rocksdb.total-blob-file-size"):
                    total += int(cf.property_int_value(prop) or 0)
        finally:
            self._leave()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path):
                if entry.name.endswith(".log"):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_size
        return total

    def compact(self) -> None:
        """Compact every family, so that deleted payloads leave the disk."""
        self._enter()
        try:
            for cf in self._cf.values():
                cf.compact_range(None, None)
        finally:
            self._leave()

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Close for real: drop every family handle so RocksDB releases its LOCK, also
        when the last flush fails (a full disk: the write-ahead log holds the stores).
        It waits for the reads under way; a read after it says the bank is closed."""
        with self._alone():
            self._closed = True
            try:
                if self._payload_reader is not None:
                    self._payload_reader.close()
                    self._payload_reader = None
                if self._db is not None:
                    try:
                        self._flush()
                    except Exception as e:
                        log.warning("cas_bank: closing %s without its last flush: %s", self.path, e)
            finally:
                self._close_db()
                self._close_view()

    def _close_db(self) -> None:
        if self._db is None:
            return
        self._drop_walks()
        for cf in self._cf.values():
            with contextlib.suppress(Exception):
                cf.close()
        self._cf.clear()
        self._handles.clear()
        db, self._db = self._db, None
        with contextlib.suppress(Exception):
            db.close()

    def _close_view(self) -> None:
        if self._view is not None:
            self._view.close()
            self._view = None
