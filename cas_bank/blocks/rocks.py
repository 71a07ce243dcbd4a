"""The RocksDB backend (through rocksdict, raw mode): one database per bank directory.

Families as in docs/design.md, "Record families". Payload families (blocks, states) keep
values in BlobDB files, uncompressed (KV does not compress; our codec decides per
payload) and are read without RocksDB's software CRC: our blake3 digest is the integrity
check.

Durability: `wal` (default) writes every batch to the write-ahead log, so a store that
returned survives a crash or SIGKILL. `fast` turns the WAL off and flushes families
atomically: a crash may lose the stores since the last flush, never half a batch.
A `read_only` open is frozen at open time; a `secondary` open follows the writer with
`refresh()` and never takes the writer's lock. RocksDB cannot read BlobDB values
through a secondary instance (it crashes the process: facebook/rocksdb#13296), so a
secondary store reads the payload families through a read-only instance that
`refresh()` reopens right after catching up: payloads are never older than headers.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

from rocksdict import (
    AccessType,
    BlockBasedOptions,
    DBCompressionType,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from cas_bank.blocks.store import PAYLOAD_FAMILIES, BlockStore, Family, Write
from cas_bank.errors import BankLockedError, CorruptDataError

AccessMode = Literal["read_write", "read_only", "secondary"]

_MIN_BLOB_SIZE = 4096


def _family_options(family: Family) -> Options:
    opt = Options(raw_mode=True)
    if family in PAYLOAD_FAMILIES:
        opt.set_enable_blob_files(True)
        opt.set_min_blob_size(_MIN_BLOB_SIZE)
        opt.set_blob_compression_type(DBCompressionType.none())
        opt.set_compression_type(DBCompressionType.none())
        opt.set_enable_blob_gc(True)
    # Bloom filters: a lookup of a block that is not stored (every miss, and the binary
    # search of `stored_prefix`) is answered without reading table blocks.
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opt.set_block_based_table_factory(table)
    return opt


def _db_options(durability: str) -> Options:
    opt = _family_options(Family.META)
    opt.create_if_missing(True)
    opt.create_missing_column_families(True)
    if durability == "fast":
        opt.set_atomic_flush(True)
    return opt


def _is_corruption(e: Exception) -> bool:
    return str(e).startswith("Corruption") or " Corruption: " in str(e)


def _walk(cf: Any, values: bool, read_opt: Any) -> Generator[tuple[bytes, bytes], None, None]:
    if values:
        yield from cf.items(read_opt=read_opt)
    else:
        for k in cf.keys(read_opt=read_opt):
            yield k, b""


class RocksStore(BlockStore):
    """A `BlockStore` on one RocksDB database directory."""

    def __init__(
        self, path: str | Path, *, mode: AccessMode = "read_write", durability: str = "wal"
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        self.read_only = mode != "read_write"
        self._secondary_dir: str | None = None
        self._write_lock = threading.Lock()
        self._walks: weakref.WeakSet[Generator[tuple[bytes, bytes], None, None]] = weakref.WeakSet()
        if mode != "read_write" and not (self.path / "CURRENT").exists():
            raise FileNotFoundError(f"no bank at {self.path}")
        if mode == "read_write":
            self.path.mkdir(parents=True, exist_ok=True)
            access = AccessType.read_write()
        elif mode == "read_only":
            access = AccessType.read_only()
        else:
            self._secondary_dir = tempfile.mkdtemp(prefix="cas_bank_secondary_")
            access = AccessType.secondary(self._secondary_dir)
        families = {f.value: _family_options(f) for f in Family}
        if mode != "read_write":
            # A reader opens the families the writer made; an old bank may lack new ones.
            existing = set(Rdict.list_cf(str(self.path)))
            families = {k: v for k, v in families.items() if k in existing}
        try:
            self._db: Any = self._open_db(families, durability, access)
        except Exception as e:
            self._cleanup_secondary()
            if _is_corruption(e):
                raise CorruptDataError(f"bank at {self.path} is damaged: {e}") from None
            # Match the LOCK file, not the word: "block checksum mismatch" holds "lock".
            if "/LOCK" not in str(e):
                raise
            if "current process" in str(e):
                raise BankLockedError(
                    f"bank at {self.path} is already open for writing in this process; "
                    f"close that Bank first ({e})"
                ) from None
            raise BankLockedError(
                f"bank at {self.path} is held by another writer process; open it "
                f"read-only or as a secondary to read it ({e})"
            ) from None
        self._cf: dict[Family, Any] = {}
        self._handles: dict[Family, Any] = {}
        fast_reads = self._fast_reads = ReadOptions()
        fast_reads.set_verify_checksums(False)
        for f in Family:
            if f.value not in families:
                continue
            cf = self._db.get_column_family(f.value)
            if f in PAYLOAD_FAMILIES:
                cf.set_read_options(fast_reads)
            self._cf[f] = cf
            if not self.read_only:
                self._handles[f] = self._db.get_column_family_handle(f.value)
        self._write_opt: Any = cast(Any, WriteOptions())
        self._write_opt.disable_wal = durability == "fast"  # a property at run time
        self._durability = durability
        self._payload_reader: RocksStore | None = None
        if mode == "secondary":
            self._payload_reader = self._open_payload_reader()

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

    def _open_db(self, families: dict[str, Options], durability: str, access: Any) -> Any:
        def attempt() -> Any:
            return Rdict(
                str(self.path),
                options=_db_options(durability),
                column_families=families,
                access_type=access,
            )

        try:
            return attempt()
        except Exception as e:
            if "current process" not in str(e):
                raise
            # A closed store of this process may still sit in a reference cycle that
            # holds a family handle (and so the LOCK): collect it and try once more.
            gc.collect()
            return attempt()

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
        if self._payload_reader is not None and family in PAYLOAD_FAMILIES:
            return self._payload_reader.get_many(family, keys)
        if family not in self._cf and self._db is not None:
            return [None] * len(keys)
        cf = self._family(family)
        try:
            out: list[bytes | None] = cf.get(list(keys))
        except Exception as e:
            raise self._read_error(e, family) from None
        return out

    def get(self, family: Family, key: bytes) -> bytes | None:
        if self._payload_reader is not None and family in PAYLOAD_FAMILIES:
            return self._payload_reader.get(family, key)
        if family not in self._cf and self._db is not None:
            return None
        cf = self._family(family)
        try:
            out: bytes | None = cf.get(key)
        except Exception as e:
            raise self._read_error(e, family) from None
        return out

    def _read_error(self, e: Exception, family: Family) -> Exception:
        """RocksDB's own checksums (on the small families) failing is a `CorruptDataError`."""
        if _is_corruption(e):
            return CorruptDataError(f"bank at {self.path}: {family.value} damaged on disk: {e}")
        return e

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        if self._payload_reader is not None and family in PAYLOAD_FAMILIES:
            return self._payload_reader.iterate(family, values=values)
        if family not in self._cf and self._db is not None:
            return iter(())
        # Iterators ignore the family's read options: payload walks (which read every
        # blob value, even for keys only) pass the unchecked ones, which are faster.
        read_opt = self._fast_reads if family in PAYLOAD_FAMILIES else None
        walk = _walk(self._family(family), values, read_opt)
        # A RocksDB iterator keeps the database (and its LOCK) alive: close() ends
        # every walk still open, so that the directory can be reopened.
        self._walks.add(walk)
        return walk

    # -- writes --------------------------------------------------------------------
    def put_batch(self, writes: Sequence[Write]) -> None:
        if not writes:  # nothing to do, also after close (a second Bank.close flushes nothing)
            return
        if self.read_only:
            raise RuntimeError(f"bank at {self.path} is open {self.mode}")
        if self._db is None:
            raise RuntimeError(f"bank at {self.path} is closed")
        wb = WriteBatch(raw_mode=True)
        for family, key, value in writes:
            if value is None:
                wb.delete(key, self._handles[family])
            else:
                wb.put(key, value, self._handles[family])
        with self._write_lock:
            self._db.write(wb, self._write_opt)

    def flush(self) -> None:
        """Write every family's memtable to disk (`Rdict.flush` alone does the default one).

        Payload families go first: a crash between flushes can then leave a payload
        without its header (invisible), never a header without its payload.
        """
        if self._db is None or self.read_only:
            return
        for family in (*PAYLOAD_FAMILIES, *(f for f in Family if f not in PAYLOAD_FAMILIES)):
            cf = self._cf.get(family)
            if cf is not None:
                cf.flush()

    def refresh(self) -> None:
        if self.mode == "secondary" and self._db is not None:
            self._db.try_catch_up_with_primary()
            if self._payload_reader is not None:
                old, self._payload_reader = self._payload_reader, self._open_payload_reader()
                old.close()

    def disk_bytes(self) -> int | None:
        if self._db is None:
            return None
        total = 0
        for cf in self._cf.values():
            for prop in ("rocksdb.total-sst-files-size", "rocksdb.total-blob-file-size"):
                v = cf.property_int_value(prop)
                total += int(v or 0)
        return total

    def compact(self) -> None:
        """Compact every family, so that deleted payloads leave the disk."""
        for cf in self._cf.values():
            cf.compact_range(None, None)

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Close for real: drop every family handle so RocksDB releases its LOCK."""
        if self._db is None:
            return
        if self._payload_reader is not None:
            self._payload_reader.close()
            self._payload_reader = None
        self.flush()
        for walk in list(self._walks):
            # ValueError: running in another thread right now; it ends with the db.
            with contextlib.suppress(ValueError):
                walk.close()
        for cf in self._cf.values():
            cf.close()
        self._cf.clear()
        self._handles.clear()
        self._db.close()
        self._db = None
        self._cleanup_secondary()

    def _cleanup_secondary(self) -> None:
        if self._secondary_dir is not None:
            shutil.rmtree(self._secondary_dir, ignore_errors=True)
            self._secondary_dir = None
