"""Damaged files and a full disk, as RocksDB reports them, turned into cas_bank errors;
the private view readers open; and the check before a read-write open.

- A read error that is RocksDB's own checksum failing, or a file it needs gone, is a
  `CorruptDataError` naming the bank and the file (a restore counts it as a miss).
- A write that fails for want of space is a `BankFullError` naming the path and the
  bytes the write needed; so is a read-write open that finds the disk full.
- `View`: a private directory of symlinks to the bank's files. rocksdict writes
  `rocksdict-config.json` (and RocksDB its `LOG`) into the directory it opens, so a
  reader opens this view: nothing is written in the bank directory, which may be on a
  read-only mount.
- `preflight`: RocksDB deletes the table and blob files its MANIFEST does not name
  when it opens a database for writing. A truncated or damaged MANIFEST therefore
  wipes a bank silently. Before a read-write open of an existing directory, a
  read-only look through a `View` compares the files the MANIFEST names with the
  files present, and refuses (naming them) a directory that would lose any, or that
  holds some other RocksDB database (`bankdir.check_families`, which readers ask too).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Options, Rdict

from cas_bank.blocks.bankdir import (
    FORMAT_KEY,
    MARKER_FAMILY,
    check_families,
    foreign_error,
    is_foreign,
)
from cas_bank.errors import BankDamagedError, BankFullError, CorruptDataError

# Files of a RocksDB directory a reader must not share: its lock, its info log, and
# rocksdict's config (each open writes its own).
_PRIVATE = re.compile(r"^(LOCK|LOG(\.old\..*)?|rocksdict-config\.json)$")
_NUMBERED = re.compile(r"^(\d+)\.(sst|blob)$")


def is_corruption(e: BaseException) -> bool:
    return str(e).startswith("Corruption") or " Corruption: " in str(e)


def _is_missing_file(e: BaseException) -> bool:
    s = str(e)
    return s.startswith("IO error") and ("No such file" in s or "not found" in s)


def is_no_space(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return "No space left" in str(e) or "NoSpace" in str(e)


def read_error(e: Exception, path: Path, what: str, view: Path | None = None) -> Exception:
    """A RocksDB read failure as cas_bank reports it (see the module docstring)."""
    if is_corruption(e) or _is_missing_file(e):
        return CorruptDataError(
            f"bank at {path}: {what} damaged on disk ({real(e, path, view)}); run "
            f"`cas-bank verify {path}`"
        )
    return e


def real(e: object, path: Path, view: Path | None) -> str:
    """RocksDB's message with the files a view links to named by their real path."""
    s = str(e)
    return s if view is None else s.replace(str(view), str(path))


def write_error(e: Exception, path: Path, needed: int) -> Exception:
    """A RocksDB write failure as cas_bank reports it: a full disk is `BankFullError`."""
    if isinstance(e, BankFullError):
        return e
    if is_no_space(e):
        return full_error(path, needed, e)
    return e


RESUME_MARGIN = 1 << 20  # free bytes beyond a write's own that a full disk waits for


def full_error(path: Path, needed: int, cause: object = None) -> BankFullError:
    free = free_bytes(path)
    why = f" ({cause})" if cause is not None else ""
    return BankFullError(
        f"bank at {path}: the disk is full: a write of {needed} bytes needs room, "
        f"{free} bytes are free{why}. Stores are refused until space is freed (restores "
        "keep working); the bank resumes writing by itself then",
        path=path,
        needed=needed,
    )


def open_full_error(path: Path, cause: object) -> BankFullError:
    """A read-write open refused for want of space (RocksDB writes its MANIFEST and
    log when it opens a database for writing)."""
    return BankFullError(
        f"bank at {path} cannot be opened for writing: the disk is full, "
        f"{free_bytes(path)} bytes are free ({cause}). Free space, or open it "
        "read-only (mode='read_only') to restore from it",
        path=path,
    )


def free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class View:
    """A private directory of symlinks to the bank's files (see the module docstring).

    `path` is what a reader hands RocksDB; `scratch` is a second private directory
    (a secondary instance's own). `sync()` follows the files the writer added or
    removed since; `close()` removes both directories.
    """

    def __init__(self, bank: Path) -> None:
        self.bank = bank.resolve()
        self.root = Path(tempfile.mkdtemp(prefix="cas_bank_view_"))
        self.path = self.root / "view"
        self.scratch = self.root / "scratch"
        self.path.mkdir()
        self.scratch.mkdir()
        self._links: set[str] = set()
        try:
            self.sync()
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        want = {n for n in os.listdir(self.bank) if not _PRIVATE.match(n)}
        for name in self._links - want:
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        for name in sorted(want - self._links):
            os.symlink(self.bank / name, self.path / name)
        self._links = want

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _numbered(names: list[str], ext: str) -> dict[str, int]:
    out = {}
    for n in names:
        m = _NUMBERED.match(n)
        if m and m.group(2) == ext:
            out[n] = int(m.group(1))
    return out


def preflight(path: Path, families: dict[str, Options], db_options: Options) -> None:
    """Refuse a directory a read-write open would damage (see the module docstring).

    `families` / `db_options`: those of the bank (so the look parses what the writer
    will). A directory without `CURRENT` is a new bank: nothing to check. A look that
    fails while the files change is taken again: a live writer (which holds the lock
    the open then reports) deletes files as it compacts.
    """
    for _ in range(5):
        if not (path / "CURRENT").exists():
            return
        before = _listing(path)
        try:
            _look(path, families, db_options)
            return
        except BankDamagedError:
            if _listing(path) == before:
                raise
        time.sleep(0.05)


def _listing(path: Path) -> frozenset[tuple[str, int, int]]:
    out = set()
    for entry in os.scandir(path):
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat()
            out.add((entry.name, st.st_size, st.st_mtime_ns))
    return frozenset(out)


def _look(path: Path, families: dict[str, Options], db_options: Options) -> None:
    """Refuse `path` (`BankDamagedError`, or `foreign_error`) if a read-only look through
    a `View` finds its CURRENT or MANIFEST unreadable, files its MANIFEST does not name,
    or another RocksDB database."""
    view = View(path)
    try:
        try:
            names = set(Rdict.list_cf(str(view.path)))
        except Exception as e:
            why = f"its CURRENT or MANIFEST is unreadable ({real(e, path, view.path)})"
            raise BankDamagedError(_damaged(path, why)) from None
        check_families(path, names)
        manifest = _read_manifest(path, view.path, names, families, db_options)
        if manifest.unmarked:  # before the writer's open adds a bank's families to it
            raise foreign_error(path, f"its {MARKER_FAMILY} family holds no cas_bank format record")
        _check_named(path, manifest)
    finally:
        view.close()


@dataclass(frozen=True, slots=True)
class _Manifest:
    """What a read-only open of a bank directory says of it."""

    empty: bool  # no family holds a record
    unmarked: bool  # the marker family holds records, none of them the format record
    live: set[str]  # the table files its MANIFEST names
    blobs_named: int  # how many blob files it names


def _read_manifest(
    path: Path, view: Path, names: set[str], families: dict[str, Options], db_options: Options
) -> _Manifest:
    """`_Manifest` of the bank at `path`, opened read-only through `view`; one RocksDB
    cannot open is damaged (`BankDamagedError`) or not a bank (`foreign_error`)."""
    db: Any = None
    try:
        try:
            db = Rdict(
                str(view),
                options=db_options,
                column_families={k: v for k, v in families.items() if k in names},
                access_type=AccessType.read_only(),
            )
            return _manifest_of(db, names)
        except BankDamagedError:
            raise
        except Exception as e:
            if is_foreign(e):
                raise foreign_error(path, real(e, path, view)) from None
            why = f"RocksDB cannot open it ({real(e, path, view)})"
            raise BankDamagedError(_damaged(path, why)) from None
    finally:
        if db is not None:
            with contextlib.suppress(Exception):
                db.close()


def _manifest_of(db: Any, names: set[str]) -> _Manifest:
    """`_Manifest` of `db`, open read-only with its families `names`."""
    empty = all(_empty(db.get_column_family(name)) for name in names)
    meta = db.get_column_family(MARKER_FAMILY)
    unmarked = not _empty(meta) and meta.get(FORMAT_KEY) is None
    live = {str(f["name"]).lstrip("/") for f in db.live_files()}
    blobs_named = 0
    for name in names:
        v = db.get_column_family(name).property_int_value("rocksdb.num-blob-files")
        blobs_named += int(v or 0)
    return _Manifest(empty, unmarked, live, blobs_named)


def _check_named(path: Path, manifest: _Manifest) -> None:
    """Refuse `path` if its MANIFEST does not name table or blob files it holds, which
    a read-write open would delete."""
    live = manifest.live
    present = sorted(os.listdir(path))
    tables = _numbered(present, "sst")
    blobs = _numbered(present, "blob")
    if manifest.empty and not live and (tables or blobs):
        raise BankDamagedError(
            _damaged(
                path,
                f"its MANIFEST names no records but {len(tables)} table and {len(blobs)} "
                "blob files are present (a truncated or damaged MANIFEST)",
            )
        )
    newest = max((tables[n] for n in live if n in tables), default=0)
    # A crash during a flush or compaction leaves its new files unnamed: newer
    # than every named one, their data is still in the log. Older unnamed files,
    # or more blob files than a crash leaves, mean the MANIFEST lost them.
    lost = [n for n, num in tables.items() if n not in live and num < newest]
    extra_blobs = len(blobs) - manifest.blobs_named
    if lost or extra_blobs > 2:
        shown = ", ".join(sorted(lost)[:8]) or f"{extra_blobs} of its blob files"
        raise BankDamagedError(
            _damaged(
                path,
                f"its MANIFEST does not name {shown} (a truncated or damaged MANIFEST); "
                "opening it for writing would delete them",
            )
        )


def _empty(cf: Any) -> bool:
    for _ in cf.keys():  # noqa: SIM118 (an Rdict, not a dict)
        return False
    return True


def _damaged(path: Path, why: str) -> str:
    return (
        f"bank at {path} does not open cleanly: {why}. Nothing was changed. "
        f"`cas-bank salvage {path} NEW_DIR` copies every block that still verifies into "
        "a new bank"
    )
