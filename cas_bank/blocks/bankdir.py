"""What a directory must be to open as a bank: a cas_bank bank, or an empty or new
directory for a writer to make one in. Every RocksDB open goes through here (the
writer's `Bank.open`, the read-only and secondary opens of the tools), so each of
them refuses the same things with the same one line, and changes nothing:

- a path that names a file;
- a directory of other files (no RocksDB `CURRENT`: a user's `config.json`,
  `notes.txt`, the current directory given as an empty path). What RocksDB writes
  before `CURRENT` (`LOCK`, `LOG`, `IDENTITY`, rocksdict's config: a first open cut
  short, or one under way) and `lost+found` are no such files;
- another program's RocksDB database: no `meta` family (every bank has one from its
  first open), a `meta` with records but no format record (`damage`'s look, before
  the writer's open adds a bank's families), or one RocksDB cannot open with a bank's
  options (a comparator other than the bytewise one a bank uses). Without `meta` but
  with nothing but a bank's families, it is a bank whose MANIFEST was cut
  (`check_families`): damaged, not foreign.

A reader finding no directory, or an empty one, raises `FileNotFoundError("no bank
at ...")`: a writer creates its bank there instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from cas_bank.blocks.store import Family
from cas_bank.errors import BankDamagedError, NotABankError

MARKER_FAMILY = "meta"
"""The column family every bank has and another program's database lacks."""
BANK_FAMILIES = frozenset(f.value for f in Family)
"""Every column family a bank has."""
FORMAT_KEY = b"format_version"
"""The key in `meta` of a bank's format version, written at its first open and checked at
every open (`cas_bank.bank_format`); defined here, in the lowest layer that reads it
(`blocks.damage`)."""

# What Finder leaves in any directory it shows; what mkfs puts in a fresh ext4/xfs volume.
_IGNORED = frozenset({".DS_Store", "lost+found"})
# What RocksDB writes before CURRENT: a first open killed part-way (SIGKILL, a full
# disk) left them, or another process is creating the bank now (its lock then says so).
_BEFORE_CURRENT = re.compile(r"^(LOCK|IDENTITY|LOG(\.old\..*)?|rocksdict-config\.json)$")
_SHOWN = 4


def check_directory(path: Path, *, create: bool) -> bool:
    """Whether a RocksDB database is at `path`; refuse what cannot become a bank.

    `create`: the caller is the writer, which makes a bank in a missing or empty
    directory (then False is returned); a reader gets `FileNotFoundError` there.
    """
    if path.exists() and not path.is_dir():
        raise NotABankError(f"{path} is a file, not a bank directory")
    if (path / "CURRENT").exists():
        return True  # RocksDB's: whether it is a bank is `check_families`' question
    others = sorted(n for n in _listing(path) if n not in _IGNORED and not _BEFORE_CURRENT.match(n))
    if others:
        shown = ", ".join(others[:_SHOWN]) + (", ..." if len(others) > _SHOWN else "")
        raise NotABankError(
            f"{path} holds no cas_bank bank but {len(others)} other "
            f"{'entry' if len(others) == 1 else 'entries'} ({shown}); it was not opened. "
            "A bank needs an empty or new directory"
        )
    if not create:
        raise FileNotFoundError(f"no bank at {path}")
    return False


def _listing(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return []


def check_families(path: Path, names: Iterable[str]) -> None:
    """Refuse a RocksDB database whose column families are not a bank's.

    Without `meta`, a database holding nothing but a bank's other families is a bank
    whose MANIFEST lost the records that made some of them (a truncated MANIFEST
    lists those written before the cut, in the order RocksDB created them, which
    varies): damaged, `BankDamagedError`, which `cas-bank salvage` takes. Any other
    name, or none of a bank's, is another program's database (`NotABankError`)."""
    names = sorted(names)
    if MARKER_FAMILY not in names:
        ours = set(names) - {"default"}
        if ours and ours <= BANK_FAMILIES:
            raise BankDamagedError(
                f"bank at {path} is damaged: its MANIFEST lists only some of a bank's "
                f"column families ({names}, no {MARKER_FAMILY!r}). Nothing was changed; "
                f"`cas-bank salvage {path} NEW_DIR` copies what still verifies into a new bank"
            )
        raise NotABankError(
            f"{path} holds a RocksDB database that is not a cas_bank bank (column "
            f"families {names}); it was not opened. Use an empty directory"
        )


def is_foreign(e: BaseException) -> bool:
    """Whether RocksDB refused an open because the database was made with options no
    bank uses (another program's comparator), not because files are damaged."""
    s = str(e)
    return s.startswith("Invalid argument") and "comparator" in s


def foreign_error(path: Path, why: str) -> NotABankError:
    return NotABankError(
        f"{path} holds a RocksDB database that is not a cas_bank bank ({why}); it was "
        "not opened. Use an empty directory"
    )
