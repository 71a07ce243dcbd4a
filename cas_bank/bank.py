"""`Bank`: open (or create) a bank directory, hand out namespaces, report stats.

Opening reads a handful of meta keys and checks them against the config: no scan and
no index rebuild, so its cost does not grow with the number of blocks.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from cas_bank.blocks.files import FileTier
from cas_bank.blocks.hashing import HASH_FORMAT_VERSION, namespace_root
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import AccessMode, RocksStore
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.config import BankConfig
from cas_bank.errors import BankSettingsError
from cas_bank.index.access import AccessLog
from cas_bank.index.admission import SeenBlocks
from cas_bank.index.evict import EvictionReport, evict_to_budget
from cas_bank.index.lease import Leases
from cas_bank.index.txn import Suspects, Transaction
from cas_bank.index.writer import Writer
from cas_bank.spec import ModelSpec
from cas_bank.stats import BankStats, Counters

if TYPE_CHECKING:
    from cas_bank.namespace import Namespace

log = logging.getLogger("cas_bank")

FORMAT_VERSION = 2
"""1: every payload in RocksDB. 2: payloads of 64 KiB and more may be files beside it
(`blocks.files`), their records stubs. A version-1 bank opens as it is (its payloads
stay readable where they are) and is marked version 2 by its first writer; a cas_bank
that reads only version 1 refuses a version-2 bank, naming the version."""
_KEY_FORMAT = b"format_version"
_KEY_BLOCK_SIZE = b"block_size"
_KEY_HASH_FORMAT = b"hash_format_version"
_KEY_CREATED = b"created"
_U32 = struct.Struct("<I")
_NEVER = 1 << 62  # a payload size no payload reaches


class Bank:
    """A prefix-cache bank in one directory. Use `Bank.open`; also a context manager."""

    def __init__(self, path: Path, config: BankConfig, store: BlockStore) -> None:
        self.path = path
        self.config = config
        self.store = store
        self.read_only = store.read_only
        self.counters = Counters(store)
        # One writer lock per bank: a transaction holds it (see `transaction`).
        self.write_lock = threading.RLock()
        self._in_transaction = False
        # Blocks and states whose payload failed to verify: the next store rewrites them.
        self.suspects = Suspects()
        # The hot tier, when `store` is one (Bank.open wraps the backend if hot_bytes > 0).
        self.hot = store if isinstance(store, HotStore) else None
        # The file tier of large payloads, when one is under the store (Bank.open puts it).
        inner: object = store
        while not isinstance(inner, FileTier) and hasattr(inner, "inner"):
            inner = inner.inner
        self.files = inner if isinstance(inner, FileTier) else None
        # The background writer of `Namespace.store_later`, if the config asks for one.
        self.writer = (
            Writer(config.write_behind) if config.write_behind > 0 and not self.read_only else None
        )
        # Blocks stores offered in this process (BankConfig.admit="second_use").
        self.seen = SeenBlocks()
        # Chains stored or restored in this process, handed out again without a copy.
        self.leases = Leases(config.hot_bytes, config.block_size) if config.hot_bytes > 0 else None
        # Last uses, recorded in memory and written in batches (see index.evict).
        self.access = AccessLog(config.access_flush_interval, enabled=not self.read_only)
        self._namespaces: dict[str, Namespace] = {}

    @classmethod
    def open(
        cls,
        path: str | Path | BlockStore,
        config: BankConfig | None = None,
        *,
        mode: AccessMode = "read_write",
    ) -> Bank:
        """Create or reopen the bank at `path`, or in the store given.

        `path`: a bank directory (RocksDB), or a `BlockStore` of any backend; the bank
        owns it from now on and closes it. `mode`: `read_write` (the one writer),
        `read_only` (frozen at open) or `secondary` (follows a live writer, see
        `refresh`); a store given brings its own. A `block_size` left unset in `config`
        is taken from the bank on disk; one set explicitly must match it.
        """
        config = config or BankConfig()
        if isinstance(path, BlockStore):
            store: BlockStore = path
            where = Path(getattr(store, "path", type(store).__name__))
            rocks: BlockStore | None = None
        else:
            where = Path(path)
            store = rocks = RocksStore(where, mode=mode, durability=config.durability)
        try:  # anything failing here must not keep the directory's LOCK
            config = _check_settings(store, where, config)
            if rocks is not None:
                # Large payloads live in files beside the database (blocks.files),
                # fsync'd before their batch commits under durability="wal".
                store = FileTier(
                    rocks,
                    where / "payloads",
                    min_bytes=_NEVER if config.file_min_bytes is None else config.file_min_bytes,
                    durable=config.durability == "wal",
                )
            if config.hot_bytes > 0:
                store = HotStore(store, config.hot_bytes)
            return cls(where, config, store)
        except BaseException:
            store.close()
            raise

    # -- namespaces ----------------------------------------------------------------
    def namespace(self, spec: ModelSpec) -> Namespace:
        """The namespace of `spec`'s model: its blocks share a chain root nobody else has."""
        from cas_bank.namespace import Namespace

        key = spec.fingerprint
        ns = self._namespaces.get(key)
        if ns is None:
            root = namespace_root(spec.fingerprint, self.config.block_size)
            if not self.read_only and self.store.get(Family.NAMESPACES, root) is None:
                with self.transaction(budget=False) as tx:
                    tx.put(Family.NAMESPACES, root, spec.model_dump_json().encode())
            ns = Namespace(self, spec, root)
            self._namespaces[key] = ns
        return ns

    def namespaces(self) -> dict[bytes, ModelSpec]:
        """Every namespace recorded in the bank, by root."""
        return {
            root: ModelSpec.model_validate(json.loads(raw))
            for root, raw in self.store.iterate(Family.NAMESPACES)
        }

    # -- writing -------------------------------------------------------------------
    @contextmanager
    def transaction(self, *, budget: bool = True) -> Iterator[Transaction]:
        """The one way to change the bank: `with bank.transaction() as tx:`.

        Holds the write lock; gather writes, counter deltas, uses, forgets and suspect
        clears on `tx`. Leaving the block commits them in one batch (an exception
        aborts: nothing is written, nothing in memory changes); then, with `budget`,
        the bank is evicted down to `config.max_bytes` (a transaction of its own).
        See `index.txn`. Transactions do not nest.
        """
        if self.read_only:
            raise RuntimeError(f"bank at {self.path} is open read-only: it cannot write")
        with self.write_lock:
            if self._in_transaction:
                raise RuntimeError("a transaction is already open on this bank")
            tx = Transaction(self.store, self.counters, self.access, self.suspects)
            self._in_transaction = True
            try:
                try:
                    yield tx
                except BaseException:
                    tx.abort()
                    raise
                if not tx.done:  # the body may have aborted it (nothing to write)
                    tx.commit()
                    if self.leases is not None:  # removed blocks are not handed out
                        gone = [k for f, k, v in tx.writes if f is Family.HEADERS and v is None]
                        if gone:
                            self.leases.forget(gone)
            finally:
                self._in_transaction = False
            if budget:
                self._enforce_budget()

    def _enforce_budget(self) -> EvictionReport | None:
        """Evict if the counters say the bank is over `config.max_bytes`."""
        limit = self.config.max_bytes
        if limit is None:
            return None
        v = self.counters.values()
        if v["payload_bytes"] + v["state_bytes"] <= limit:
            return None
        return evict_to_budget(self, limit)

    def stats(self) -> BankStats:
        v = self.counters.values()
        n_ns = sum(1 for _ in self.store.keys(Family.NAMESPACES))
        return BankStats(
            block_size=self.config.block_size,
            namespaces=n_ns,
            unique_tokens=v["blocks"] * self.config.block_size,
            disk_bytes=self.store.disk_bytes(),
            **v,
        )

    def refresh(self) -> None:
        """For a secondary open: catch up with the writer (data and counters)."""
        self.store.refresh()
        self.counters.reload(self.store)

    def flush(self, *, wait: bool = True) -> None:
        """Persist the activity counters and last uses now (they also ride along stores).

        `wait=False` (a restore's periodic flush) skips the flush while a store holds the
        write lock: that store's batch carries the same records, and cutting in between
        its recording of uses and its write would write them without its blocks.
        """
        if self.writer is not None and wait and not _owned(self.write_lock):
            self.writer.flush()  # every queued store written (its failure raised here)
        if self.read_only or not self.write_lock.acquire(blocking=wait):
            return
        try:
            if not self._in_transaction:  # a flush inside a transaction is its commit
                with self.transaction(budget=False):
                    pass
        finally:
            self.write_lock.release()

    def close(self) -> None:
        """Write what is queued, persist counters and release the directory (its lock too)."""
        try:
            if self.writer is not None:
                self.writer.close()
            self.flush()
        finally:
            self.store.close()
            self._namespaces.clear()

    def __enter__(self) -> Bank:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bank({str(self.path)!r}, block_size={self.config.block_size})"


def _owned(lock: threading.RLock) -> bool:
    """Whether this thread holds `lock` (then waiting for the writer would deadlock)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


def _check_settings(store: BlockStore, path: Path, config: BankConfig) -> BankConfig:
    """Compare the bank's persisted settings with `config`; write them on creation."""
    fmt, bs, hf = store.get_many(Family.META, [_KEY_FORMAT, _KEY_BLOCK_SIZE, _KEY_HASH_FORMAT])
    if fmt is None:
        if store.read_only:
            raise BankSettingsError(f"{path} holds no cas_bank bank (no format record)")
        store.put_batch(
            [
                (Family.META, _KEY_FORMAT, _U32.pack(FORMAT_VERSION)),
                (Family.META, _KEY_BLOCK_SIZE, _U32.pack(config.block_size)),
                (Family.META, _KEY_HASH_FORMAT, _U32.pack(HASH_FORMAT_VERSION)),
                (Family.META, _KEY_CREATED, str(time.time()).encode()),
            ]
        )
        return config
    version = _U32.unpack(fmt)[0]
    if version > FORMAT_VERSION:
        raise BankSettingsError(
            f"bank at {path} has format version {version}; this cas_bank reads up to "
            f"{FORMAT_VERSION}: upgrade cas_bank"
        )
    if version < FORMAT_VERSION and not store.read_only:
        # Version 1 -> 2 needs no rewrite: new large payloads go to files from now on.
        store.put_batch([(Family.META, _KEY_FORMAT, _U32.pack(FORMAT_VERSION))])
    hash_version = _U32.unpack(hf)[0] if hf else HASH_FORMAT_VERSION
    if hash_version != HASH_FORMAT_VERSION:
        raise BankSettingsError(
            f"bank at {path} uses hash format {hash_version}, this build {HASH_FORMAT_VERSION}"
        )
    stored_bs = _U32.unpack(bs)[0] if bs else config.block_size
    if "block_size" not in config.model_fields_set:
        return config.model_copy(update={"block_size": stored_bs})
    if stored_bs != config.block_size:
        raise BankSettingsError(
            f"bank at {path} was created with block_size={stored_bs}; it cannot be opened "
            f"with block_size={config.block_size}"
        )
    return config
