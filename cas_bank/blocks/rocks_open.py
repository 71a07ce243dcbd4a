"""Opening a bank's RocksDB database (`RocksStore`): RocksDB's access type for a mode,
the families a mode opens, the open itself, and what an open's errors mean as
cas_bank's errors (a foreign database, damage, a read-only file system, a full disk,
the writer's lock held)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Options, Rdict

from cas_bank.blocks import bankdir
from cas_bank.blocks.damage import View, is_corruption, is_no_space, open_full_error, real
from cas_bank.blocks.rocks_options import db_options, family_options
from cas_bank.blocks.store import Family
from cas_bank.errors import BankLockedError, CasBankError, CorruptDataError


def access_type(mode: str, view: View | None) -> Any:
    """RocksDB's access type for a store opened in `mode` (a secondary's `view` holds
    its scratch directory)."""
    if mode == "read_write":
        return AccessType.read_write()
    if mode == "read_only":
        return AccessType.read_only()
    assert view is not None
    return AccessType.secondary(str(view.scratch))


def families_to_open(
    path: Path, where: Path | str, mode: str, view_path: Path | None
) -> dict[str, Any]:
    """Each family's options by name: all of them for the writer; for a reader, the
    families the writer made (an old bank may lack new ones). `path`: the bank's
    directory; `where`: what is opened (a reader's view of it, at `view_path`)."""
    families = {f.value: family_options(f) for f in Family}
    if mode == "read_write":
        return families
    try:
        existing = set(Rdict.list_cf(str(where)))
    except Exception as e:
        why = real(e, path, view_path)
        raise CorruptDataError(
            f"bank at {path} is damaged: its CURRENT or MANIFEST is unreadable ({why})"
        ) from None
    bankdir.check_families(path, existing)  # the writer's preflight does too
    return {k: v for k, v in families.items() if k in existing}


def open_error(path: Path, e: Exception, view_path: Path | None) -> Exception | None:
    """The cas_bank error an open of the bank at `path` that raised `e` means; None: `e`
    as it is."""
    if bankdir.is_foreign(e):
        return bankdir.foreign_error(path, real(e, path, view_path))
    if is_corruption(e):
        return CorruptDataError(
            f"bank at {path} is damaged: {real(e, path, view_path)}. "
            f"Nothing was changed; `cas-bank salvage {path} NEW_DIR` copies what "
            "still verifies into a new bank"
        )
    if "Read-only file system" in str(e) or "os error 30" in str(e):
        return CasBankError(
            f"bank at {path} is on a read-only file system: it cannot be "
            "opened for writing; open it read-only (mode='read_only')"
        )
    if is_no_space(e):
        return open_full_error(path, real(e, path, view_path))
    # Match the LOCK file, not the word: "block checksum mismatch" holds "lock".
    if "/LOCK" not in str(e):
        return None
    if "current process" in str(e):
        return BankLockedError(
            f"bank at {path} is already open for writing in this process; "
            f"close that Bank first ({e})"
        )
    return BankLockedError(
        f"bank at {path} is held by another writer process; open it "
        f"read-only or as a secondary to read it ({e})"
    )


def open_db(where: Path, families: dict[str, Options], durability: str, access: Any) -> Any:
    """The database at `where` with `families`, opened with `access`."""

    def attempt() -> Any:
        return Rdict(
            str(where),
            options=db_options(durability),
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
