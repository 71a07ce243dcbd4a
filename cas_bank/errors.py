"""The few exception types of cas_bank. Each is also a built-in one, so callers may
catch `ValueError` / `RuntimeError` without importing these."""

from __future__ import annotations


class CasBankError(Exception):
    """Base of every error cas_bank raises on purpose."""


class InvalidInputError(CasBankError, ValueError):
    """Bad arguments: token ids, array shapes or dtypes, boundaries. Nothing was stored."""


class BankSettingsError(CasBankError, ValueError):
    """The bank on disk was created with other settings or a newer format."""


class BankLockedError(CasBankError, RuntimeError):
    """Another process holds the bank directory as its writer."""


class CorruptDataError(CasBankError, ValueError):
    """Stored bytes failed their digest or could not be decoded."""


class BankDamagedError(CorruptDataError):
    """The bank's RocksDB files do not open cleanly (or hold another database): refused,
    and nothing changed. `cas-bank salvage` copies what still verifies into a new bank."""


class NotABankError(BankDamagedError):
    """The path is no bank and no place for a new one: a file, a directory of other
    files, or another program's RocksDB database (`blocks.bankdir`). Refused, and
    nothing there changed."""


class BankFullError(CasBankError, OSError):
    """A write failed because the disk is full. Restores keep working; the bank resumes
    writing once space is freed. `path` and `needed` (bytes) say where and how much."""

    def __init__(self, message: str, *, path: object = None, needed: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.needed = needed

    def __str__(self) -> str:
        return str(self.args[0])
