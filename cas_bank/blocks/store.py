"""The store interface every backend meets, and `MemoryStore`, the plain-dict one.

A store holds raw bytes under byte keys in a few named families (docs/design.md, "Record
families"). It knows nothing of blocks or chains: the index above it does. Writes go in
batches that apply whole or not at all. Cross-cutting concerns (the hot tier, stats)
wrap a store.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from enum import Enum
from types import TracebackType


class Family(str, Enum):
    """Kinds of record, one RocksDB column family each."""

    META = "meta"
    NAMESPACES = "namespaces"
    HEADERS = "headers"
    BLOCKS = "blocks"
    STATES = "states"
    ACCESS = "access"


PAYLOAD_FAMILIES = (Family.BLOCKS, Family.STATES)

Write = tuple[Family, bytes, bytes | None]
"""One write of a batch: (family, key, value), a value of None deletes the key."""


class BlockStore(ABC):
    """Bytes under keys, in families. Thread-safe; `put_batch` is atomic."""

    read_only: bool = False

    @abstractmethod
    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of `keys` in order, None where a key is absent."""

    def get(self, family: Family, key: bytes) -> bytes | None:
        return self.get_many(family, [key])[0]

    def exists_many(self, family: Family, keys: Sequence[bytes]) -> list[bool]:
        return [v is not None for v in self.get_many(family, keys)]

    @abstractmethod
    def put_batch(self, writes: Sequence[Write]) -> None:
        """Apply every write, atomically: all or none survive a crash."""

    def delete(self, family: Family, keys: Sequence[bytes]) -> None:
        self.put_batch([(family, k, None) for k in keys])

    @abstractmethod
    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs in key order; with `values=False` the value is b""."""

    def keys(self, family: Family) -> Iterator[bytes]:
        for k, _ in self.iterate(family, values=False):
            yield k

    def refresh(self) -> None:
        """Catch up with the writer (secondary opens); a no-op elsewhere."""
        return None

    def disk_bytes(self) -> int | None:
        """Bytes the store takes on disk, where it can tell."""
        return None

    def degraded(self) -> str | None:
        """Why writes are refused right now (a full disk), or None: reads still work."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release everything; the store is unusable afterwards."""

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class MemoryStore(BlockStore):
    """A dict per family: the reference model in tests, and a throwaway bank."""

    def __init__(self) -> None:
        self._data: dict[Family, dict[bytes, bytes]] = {f: {} for f in Family}
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")

    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        self._check()
        d = self._data[family]
        return [d.get(k) for k in keys]

    def put_batch(self, writes: Sequence[Write]) -> None:
        self._check()
        with self._lock:
            for family, key, value in writes:
                if value is None:
                    self._data[family].pop(key, None)
                else:
                    self._data[family][bytes(key)] = bytes(value)

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        self._check()
        with self._lock:
            items = sorted(self._data[family].items())
        for k, v in items:
            yield k, (v if values else b"")

    def close(self) -> None:
        self._closed = True
