"""The file tier: large payloads as immutable files beside the database.

A wrapper store (like the hot tier). A block or state payload of at least
`min_bytes` is written to its own file, named by its key and digest, and the
database keeps a small stub in its place (`CASF`, the payload's digest and size);
so is an end record of that size where the bank's format allows it (5: `record_digests`
says how to read the digest a record names). Besides the restore's reads below, this
keeps large values out of rocksdict, whose writes hold the GIL: a hybrid model's 4.9 MB
end record written through it stalled every Python thread 13-20 ms.
RocksDB stays the index and the single commit point:

- write: the files first (written whole under a temporary name, fsync'd when
  `durable`, renamed, directory fsync'd), then the inner batch with the stubs. A crash
  in between leaves files no stub names: `sweep` finds and removes them (run at the
  next open after an unclean close, and by `verify`/`gc`).
- read: `get_many` returns the file's bytes, so everything above (verify, export,
  eviction, the codec) sees the same payload as before. A restore reads a file into
  its destination arrays itself (`restore.file_read`), asking this tier where each
  payload is: `file_for` names the file a payload of a header's size and digest is
  kept in (without reading its record), `locate` says what the records hold (a
  `PayloadFile`, the payload itself, or nothing). Which payloads are files is decided
  here only (`stores_as_file`).
- delete / overwrite: the inner batch first, then the files no stub names any more.

Why: rocksdict's `get` returns a new `bytes` per value and holds the GIL (0.66-1.03
GB/s after a reopen, measured), while `preadv` of a file in the page cache into the
destination memory runs at memory speed on both cores (docs/design.md, "Restore path").
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cas_bank.blocks import codec
from cas_bank.blocks.damage import RESUME_MARGIN, free_bytes, full_error, is_no_space
from cas_bank.blocks.store import PAYLOAD_FAMILIES, BlockStore, Family, Write
from cas_bank.errors import BankFullError, CorruptDataError

# Families whose values may be files: the payloads, and (format 5) end records. A read
# of any of them resolves a stub, whatever the bank's format (an end record's value
# begins with its version byte, never with the stub's magic).
FILE_FAMILIES = (*PAYLOAD_FAMILIES, Family.ENDS)
STUB_MAGIC = b"CASF"
_STUB = struct.Struct("<4s32sQ")
MIN_FILE_BYTES = 64 * 1024
_DIRTY = "OPEN"  # present while a writer has the tier open: a crash leaves it behind


def stub_of(value: bytes) -> tuple[bytes, int] | None:
    """(digest, size) if `value` is a file stub, else None."""
    if len(value) == _STUB.size and value[:4] == STUB_MAGIC:
        _, digest, size = _STUB.unpack(value)
        return digest, size
    return None


@dataclass(frozen=True, slots=True)
class PayloadFile:
    """A payload the file tier keeps as a file, as its record (a stub) names it: the
    file (`FileTier.name`), and the payload's digest field and size; and, as
    `FileTier.record_heads` reads it, its first `HEAD_BYTES` (`head`: all of it if
    shorter), read without the rest: what the hot tier keeps of a large end record
    while a lease holds its arrays decoded (`blocks.hot`, `index.ends.stored_end`)."""

    path: str
    digest: bytes
    size: int
    head: bytes = b""

    def is_of(self, digest: bytes, size: int) -> bool:
        """Whether this is the payload of that digest field and size (a header's)."""
        return self.digest == digest and self.size == size

    def read(self, limit: int = -1) -> bytes | None:
        """The file's bytes (its first `limit`, where given); None if it is gone (its
        record rewritten or removed since the stub named it: a file is never changed
        in place, so what it holds is the record the stub named)."""
        try:
            with open(self.path, "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None


# What `FileTier.record_heads` reads of a record kept as a file at least: an end record's
# header and tail tokens (112 bytes and 4 a token) at block sizes up to 997; a longer
# header is read whole (`head_bytes`).
HEAD_BYTES = 4096


class FileTier(BlockStore):
    """Payloads of `min_bytes` or more as files under `directory`; the rest in `inner`."""

    def __init__(
        self,
        inner: BlockStore,
        directory: str | Path,
        *,
        min_bytes: int = MIN_FILE_BYTES,
        durable: bool = True,
        record_digests: Mapping[Family, Callable[[bytes], bytes | None]] | None = None,
        head_bytes: Mapping[Family, Callable[[bytes], int]] | None = None,
    ) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities  # files first, then inner's one batch
        self.directory = Path(directory)
        self._dirs = {family: str(self.directory / family.value) for family in Family}
        self._prefixes = {family: os.fsencode(d) + b"/" for family, d in self._dirs.items()}
        self.min_bytes = min_bytes
        self.durable = durable
        self.read_only = inner.read_only
        self._lock = threading.Lock()  # one writer of files at a time
        self.files_written = 0
        self.file_bytes_written = 0
        self._full: str | None = None  # why files are refused: the disk was full
        # How to read the digest a large value names, by the families written as files:
        # a payload's lead; `record_digests` adds others (None: not one, kept in place).
        self._digests: dict[Family, Callable[[bytes], bytes | None]] = {
            family: _payload_digest for family in PAYLOAD_FAMILIES
        }
        self._digests.update(record_digests or {})
        # How many first bytes of a record hold its header (at least `HEAD_BYTES` read).
        self._head_bytes = dict(head_bytes or {})
        if not self.read_only:
            for family in self._digests:
                (self.directory / family.value).mkdir(parents=True, exist_ok=True)
            dirty = self.directory / _DIRTY
            if dirty.exists():
                self.sweep()  # the last writer did not close: files may lack their stubs
            dirty.touch()

    # -- naming --------------------------------------------------------------------
    def path(self, family: Family, key: bytes, digest: bytes) -> Path:
        return Path(self.name(family, key, digest))

    def name(self, family: Family, key: bytes, digest: bytes) -> str:
        """`path` as a string: a restore names every block's file, and a `Path` costs it
        more than the read's system calls for a small payload (~8 us, pathlib's parse)."""
        return f"{self._dirs[family]}/{key.hex()}.{digest[:8].hex()}"

    def prefix(self, family: Family) -> bytes:
        """What every `name` of `family` starts with, as bytes: `name` is this, then
        the key in hex, a dot and the digest's first 8 bytes in hex (the native reader
        names a restore's files so: `restore.file_read.read_plain_blocks`)."""
        return self._prefixes[family]

    def _stub_path(self, family: Family, key: bytes, stub: bytes) -> Path | None:
        """The file behind a stub read from the inner store, or None."""
        found = stub_of(stub)
        return None if found is None else self.path(family, key, found[0])

    # -- where a payload is: for a restore that reads the files itself -----------------
    def stores_as_file(self, size: int) -> bool:
        """Whether a payload of `size` bytes is kept as a file (the others in records)."""
        return size >= self.min_bytes

    def file_for(self, family: Family, key: bytes, digest: bytes, size: int) -> str | None:
        """The file a payload of `key` with digest field `digest` and `size` bytes (its
        header's) is kept in, named without reading its record (`name`); None if a
        payload of that size is kept in the database. A header commits in the same
        batch as its payload's record, so the file is there unless the payload was
        evicted, damaged, or written by a bank that kept it in a record: `locate` says
        which."""
        return self.name(family, key, digest) if self.stores_as_file(size) else None

    def locate(self, family: Family, keys: Sequence[bytes]) -> list[PayloadFile | bytes | None]:
        """Where each key's payload is, by its record (the files are not opened): a
        `PayloadFile`, the payload's bytes where the database keeps it, None where there
        is no record. Raises `CorruptDataError` where RocksDB's own checks fail."""
        out: list[PayloadFile | bytes | None] = []
        for key, value in zip(keys, self.inner.get_many(family, keys), strict=True):
            found = None if value is None else stub_of(value)
            if found is None:
                out.append(value)
            else:
                out.append(PayloadFile(self.name(family, key, found[0]), *found))
        return out

    def record_heads(
        self, family: Family, keys: Sequence[bytes]
    ) -> list[bytes | PayloadFile | None]:
        """`get_many`, except that a record kept as a file is its `PayloadFile` with its
        first bytes (`head`), not the rest: an end-record lookup learns a record's header
        (and so the name of its lease) without reading its payload. Raises
        `CorruptDataError` where RocksDB's own checks fail."""
        if family not in FILE_FAMILIES:
            return list(self.inner.get_many(family, keys))
        out: list[bytes | PayloadFile | None] = []
        for key, value in zip(keys, self.inner.get_many(family, keys), strict=True):
            found = None if value is None else stub_of(value)
            if found is None:
                out.append(value)
                continue
            file = PayloadFile(self.name(family, key, found[0]), *found)
            head = file.read(HEAD_BYTES)
            need = self._head_need(family, head)
            if head is not None and need > len(head):
                head = file.read(need)  # a header past the first HEAD_BYTES
            out.append(None if head is None else replace(file, head=head))
        return out

    def keeps_files(self, family: Family) -> bool:
        """Whether records of `family` of `min_bytes` or more are kept as files here."""
        return family in self._digests

    def head_of(self, family: Family, key: bytes, value: bytes) -> PayloadFile | None:
        """The file of `value`, the record of `key` as read whole, with its head, where
        this tier keeps such a record as a file (else None): what `record_heads` reads
        of it, if the file is there."""
        digest = self._file_digest(family, value)
        if digest is None:
            return None
        head = value[: max(HEAD_BYTES, self._head_need(family, value))]
        return PayloadFile(self.name(family, key, digest), digest, len(value), head)

    def _head_need(self, family: Family, head: bytes | None) -> int:
        """How many first bytes of the record beginning with `head` its header takes."""
        needs = self._head_bytes.get(family)
        return 0 if needs is None or head is None else needs(head)

    # -- reads ---------------------------------------------------------------------
    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        values = self.inner.get_many(family, keys)
        if family not in FILE_FAMILIES:
            return values
        return [self._resolve(family, k, v) for k, v in zip(keys, values, strict=True)]

    def _resolve(self, family: Family, key: bytes, value: bytes | None) -> bytes | None:
        if value is None:
            return None
        found = stub_of(value)
        if found is None:
            return value
        try:
            with open(self.path(family, key, found[0]), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None  # a payload missing under its header: the reader counts it

    def missing_files(self, family: Family) -> Iterator[tuple[bytes, int]]:
        """The records of `family` whose stub names a file that is gone, with the sizes
        the stubs name: what `iterate` passes over (`verify` reports them)."""
        if family not in FILE_FAMILIES:
            return
        for key, value in self.inner.readable(family):  # the caller's walk reports damage
            found = stub_of(value)
            if found is not None and not os.path.exists(self.name(family, key, found[0])):
                yield key, found[1]

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        for key, value in self.inner.iterate(family, values=values):
            if values and family in FILE_FAMILIES:
                resolved = self._resolve(family, key, value)
                if resolved is None:
                    continue
                value = resolved
            yield key, value

    def prefixed(self, family: Family, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        if family in PAYLOAD_FAMILIES:
            return super().prefixed(family, prefix)
        if family in FILE_FAMILIES:
            return self._resolved(family, self.inner.prefixed(family, prefix))
        return self.inner.prefixed(family, prefix)

    def around(self, family: Family, key: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        if family in PAYLOAD_FAMILIES:
            return super().around(family, key, prefix)
        if family in FILE_FAMILIES:
            return list(self._resolved(family, self.inner.around(family, key, prefix)))
        return self.inner.around(family, key, prefix)

    def _resolved(
        self, family: Family, pairs: Iterator[tuple[bytes, bytes]] | list[tuple[bytes, bytes]]
    ) -> Iterator[tuple[bytes, bytes]]:
        """`pairs` read from the inner store with their stubs resolved (a missing file's
        pair left out)."""
        for key, value in pairs:
            resolved = self._resolve(family, key, value)
            if resolved is not None:
                yield key, resolved

    # -- writes --------------------------------------------------------------------
    def put_batch(self, writes: Sequence[Write]) -> None:
        if self.read_only:
            self.inner.put_batch(writes)  # raises, naming the mode
            return
        touched = [(f, k) for f, k, _ in writes if f in FILE_FAMILIES]
        needed = sum(len(v) for f, _, v in writes if v is not None and self._as_file(f, v))
        with self._lock:
            # After a full disk: refuse at once while it is still full (RocksDB does the
            # same for its own writes).
            if self._full is not None and free_bytes(self.directory) < needed + RESUME_MARGIN:
                raise full_error(self.directory.parent, needed)
            before = self._names(touched)
            out: list[Write] = []
            new: list[Path] = []
            try:
                for family, key, value in writes:
                    digest = self._file_digest(family, value)
                    if digest is not None:
                        assert value is not None
                        path = self.path(family, key, digest)
                        self._write_file(path, value)
                        new.append(path)
                        value = _STUB.pack(STUB_MAGIC, digest, len(value))
                    out.append((family, key, value))
                if new and self.durable:
                    for folder in {p.parent for p in new}:
                        _fsync_dir(folder)
                self.inner.put_batch(out)
                self._full = None
            except BaseException as e:
                for path in new:
                    if path not in before.values():
                        with contextlib.suppress(OSError):
                            path.unlink()
                if isinstance(e, OSError) and not isinstance(e, BankFullError) and is_no_space(e):
                    # a payload file did not fit
                    err = full_error(self.directory.parent, needed, e)
                    self._full = str(err)
                    raise err from None
                raise
            after = self._names(touched)
            for name, path in before.items():
                if after.get(name) != path:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()

    def _as_file(self, family: Family, value: bytes | None) -> bool:
        return self._file_digest(family, value) is not None

    def _file_digest(self, family: Family, value: bytes | None) -> bytes | None:
        """The digest naming `value`'s file where it is written as one; else None."""
        digest_of = self._digests.get(family)
        if digest_of is None or value is None or not self.stores_as_file(len(value)):
            return None
        return digest_of(value)

    def _names(self, touched: list[tuple[Family, bytes]]) -> dict[tuple[Family, bytes], Path]:
        """The files the inner store's stubs name now, for these keys."""
        out: dict[tuple[Family, bytes], Path] = {}
        for family in FILE_FAMILIES:
            keys = [k for f, k in touched if f is family]
            for key, value in zip(keys, self._get_each(family, keys), strict=True):
                found = self._stub_path(family, key, value) if value else None
                if found is not None:
                    out[(family, bytes(key))] = found
        return out

    def _get_each(self, family: Family, keys: list[bytes]) -> list[bytes | None]:
        """Values one by one: one that RocksDB finds damaged reads as None here. A stub
        is small, so it never sits in a blob file: a damaged blob is no stub."""
        try:
            return self.inner.get_many(family, keys)
        except CorruptDataError:
            out: list[bytes | None] = []
            for key in keys:
                try:
                    out.append(self.inner.get(family, key))
                except CorruptDataError:
                    out.append(None)
            return out

    def _write_file(self, path: Path, value: bytes) -> None:
        # Written even if present: a rewrite repairs a file that failed its digest.
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                view = memoryview(value)
                while view:
                    view = view[os.write(fd, view) :]
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # no half-written file is left behind
                os.unlink(tmp)
            raise
        self.files_written += 1
        self.file_bytes_written += len(value)

    # -- upkeep --------------------------------------------------------------------
    def sweep(self) -> int:
        """Remove files no stub names (a crash between a file and its batch); returns
        how many. Needs the writer: a store in flight would lose its new files."""
        removed = 0
        for family in FILE_FAMILIES:
            folder = self.directory / family.value
            if not folder.is_dir():
                continue
            by_key: dict[bytes, list[Path]] = {}
            for entry in os.scandir(folder):
                name = entry.name
                key_hex = name.split(".", 1)[0]
                try:
                    by_key.setdefault(bytes.fromhex(key_hex), []).append(folder / name)
                except ValueError:
                    continue  # not ours
            keys = list(by_key)
            for key, value in zip(keys, self._get_each(family, keys), strict=True):
                keep = self._stub_path(family, key, value) if value else None
                for path in by_key[key]:
                    if path != keep:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                            removed += 1
        return removed

    def file_bytes(self) -> int:
        """Bytes of the payload files now. A writer may rename or remove a file between
        the listing and its `stat` (a `.tmp` made final, an eviction): it is not
        counted (stats() during a background store failed on exactly that)."""
        total = 0
        for family in FILE_FAMILIES:
            folder = self.directory / family.value
            if folder.is_dir():
                total += sum(map(_size_if_there, os.scandir(folder)))
        return total

    @property
    def location(self) -> str:
        return self.inner.location

    def degraded(self) -> str | None:
        return self._full or self.inner.degraded()

    def refresh(self) -> None:
        self.inner.refresh()

    def disk_bytes(self) -> int | None:
        inner = self.inner.disk_bytes()
        return None if inner is None else inner + self.file_bytes()

    def flush(self) -> None:
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()

    def compact(self) -> None:
        compact = getattr(self.inner, "compact", None)
        if compact is not None:
            compact()

    def close(self) -> None:
        self.inner.close()
        if not self.read_only:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / _DIRTY).unlink()


def _payload_digest(value: bytes) -> bytes | None:
    """A payload's digest field (its lead's); None if `value` is not a payload."""
    return codec.digest_field(value) if codec.is_payload(value) else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size_if_there(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat().st_size
    except FileNotFoundError:  # renamed or removed since it was listed
        return 0
