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
