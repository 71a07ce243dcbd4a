"""Opening a store by URL: which backend a bank lives in.

`rocksdb:///abs/path` (or `rocksdb://relative/path`, or a plain path) is RocksDB, the
default. Another backend registers its scheme with `register_backend`: how to open a
location in a mode, and how to tell whether a bank exists there. `Bank.open` and the
tools open every bank through here (or take a `BlockStore` made by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cas_bank.blocks.rocks import AccessMode, RocksStore
from cas_bank.blocks.store import BlockStore
from cas_bank.errors import InvalidInputError

DEFAULT_SCHEME = "rocksdb"


@dataclass(frozen=True, slots=True)
class Backend:
    """How to open a store of one scheme, given the location after `scheme://`."""

    open: Callable[[str, AccessMode, str], BlockStore]
    """(location, mode, durability) -> the store; `FileNotFoundError` if a reader
    (mode `read_only` or `secondary`) finds no bank there."""
    exists: Callable[[str], bool]
    """Whether a bank is stored at the location (without opening it)."""


def _open_rocks(location: str, mode: AccessMode, durability: str) -> BlockStore:
    return RocksStore(location, mode=mode, durability=durability)


def _rocks_exists(location: str) -> bool:
    return (Path(location) / "CURRENT").exists()


_BACKENDS: dict[str, Backend] = {DEFAULT_SCHEME: Backend(_open_rocks, _rocks_exists)}


def register_backend(scheme: str, backend: Backend) -> None:
    """Open `scheme://...` URLs with `backend` from now on (a later call replaces it)."""
    if not scheme.isidentifier():
        raise InvalidInputError(f"{scheme!r} is not a URL scheme")
    _BACKENDS[scheme] = backend


def split_url(url: str | Path) -> tuple[str, str]:
    """(scheme, location): `scheme://location`, or a plain path for the default."""
    text = str(url)
    scheme, sep, location = text.partition("://")
    if not sep:
        return DEFAULT_SCHEME, text
    if scheme not in _BACKENDS:
        known = ", ".join(f"{s}://" for s in sorted(_BACKENDS))
        raise InvalidInputError(f"no store backend for {scheme}:// in {text!r} (known: {known})")
    if not location:
        raise InvalidInputError(f"{text!r} names no location after {scheme}://")
    return scheme, location


def open_store(
    url: str | Path, *, mode: AccessMode = "read_write", durability: str = "wal"
) -> BlockStore:
    """The store at `url` (see the module), opened in `mode`."""
    scheme, location = split_url(url)
    return _BACKENDS[scheme].open(location, mode, durability)


def store_exists(url: str | Path) -> bool:
    """Whether a bank is stored at `url` (nothing is opened or created)."""
    scheme, location = split_url(url)
    return _BACKENDS[scheme].exists(location)
