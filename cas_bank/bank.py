"""`Bank`: open (or create) a bank directory, hand out namespaces, report stats.

Opening reads a handful of meta keys and checks them against the config: no scan and
no index rebuild, so its cost does not grow with the number of blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from cas_bank.arrays import cpu_fillable, dtype_named
from cas_bank.bank_format import BLAKE3_ONLY_VERSION as BLAKE3_ONLY_VERSION  # re-exported
from cas_bank.bank_format import FORMAT_VERSION as FORMAT_VERSION  # re-exported: its old home
from cas_bank.bank_format import check_settings, record_files
from cas_bank.blocks.backends import open_store
from cas_bank.blocks.files import FileTier
from cas_bank.blocks.hashing import Check, namespace_root, salt_bytes
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import AccessMode
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.config import BankConfig
from cas_bank.errors import (
    BankFullError,
    InvalidInputError,
)
from cas_bank.evict.access import AccessLog
from cas_bank.evict.evicted import EvictionMemory
from cas_bank.evict.eviction import EvictionReport, evict_to_budget, leaf_index
from cas_bank.evict.tenants import (
    TENANT_PREFIX,
    RevokeReport,
    TenantEviction,
    Tenants,
    TenantStats,
    clear_quota,
    enforce_quotas,
    revoke,
    roots_of_salt,
    set_quota,
    tenant_record,
    tenant_stats,
)
from cas_bank.index.chain_record_writes import run_writes
from cas_bank.index.children import index_writes
from cas_bank.index.ends import header_bytes
from cas_bank.index.lease import Leases
from cas_bank.namespace import Namespace
from cas_bank.native import warn_if_missing
from cas_bank.restore.assemble import prime_shapes
from cas_bank.restore.resources import Resources
from cas_bank.restore.spares import capacities_of, decode_wanted, encode_wanted
from cas_bank.spec import ModelSpec
from cas_bank.stats import BankStats, Counters, RestoreClock, RestoreTotals
from cas_bank.write.admission import SeenBlocks
from cas_bank.write.txn import Suspects, Transaction
from cas_bank.write.writer import BackgroundWriter

if TYPE_CHECKING:
    from cas_bank.remote.tier import RemoteTier

log = logging.getLogger("cas_bank")

_KEY_REMOTE = b"remote_url"  # the shared tier last opened with (password hidden)
_KEY_SPARES = b"spare_shapes"  # what the spares' pool would hold at the last close
_PRIMED = 8  # restore capacities a new namespace makes the shapes of (`_ready_restores`)
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
        self._closed = False  # `close` ran
        # Blocks and states whose payload failed to verify: the next store rewrites them.
        self.suspects = Suspects()
        # The hot tier, when `store` is one (Bank.open wraps the backend if hot_bytes > 0).
        self.hot = store if isinstance(store, HotStore) else None
        # The file tier of large payloads, when one is under the store (Bank.open puts it).
        self.files = _file_tier_under(store)
        # The background writer of `Namespace.store_later`, if the config asks for one.
        self.writer = (
            BackgroundWriter(config.write_behind)
            if config.write_behind > 0 and not self.read_only
            else None
        )
        # Blocks stores offered in this process (BankConfig.admit="second_use").
        self.seen = SeenBlocks()
        # Where this process's restores spent their time (`restore_times`).
        self.restore_clock = RestoreClock()
        # Chains stored or restored in this process, handed out again without a copy.
        # They share the hot tier's memory budget (`hot_bytes` bounds the two together).
        self.leases = (
            Leases(
                config.hot_bytes,
                config.block_size,
                budget=self.hot.budget if self.hot is not None else None,
            )
            if config.hot_bytes > 0
            else None
        )
        # What its restores use beside their arrays (spares and their thread, the shape
        # memo, copy-run tables, scratch buffers, GPU prefetch): the bank's own, stopped by
        # `close`.
        self.resources = Resources(config.spare_bytes, run_table_bytes=config.run_table_bytes)
        # What the last session's spares would hold (`Spares.wanted_recently`, written by
        # `close`): made again by the spares' thread from the end of this open on.
        self._spare_record = store.get(Family.META, _KEY_SPARES)
        self._spares_recorded = decode_wanted(self._spare_record) if config.spare_bytes else []
        # Last uses, recorded in memory and written in batches (see evict.eviction).
        self.access = AccessLog(
            config.access_flush_interval,
            enabled=not self.read_only,
            policy=config.eviction_policy,
        )
        # What was removed, when and why (for explain), written with the removals.
        self.evictions = self._eviction_memory()
        self._namespaces: dict[str, Namespace] = {}
        # Tenants (salts): their namespaces and quotas (evict.tenants), read on first use.
        self.tenants = Tenants(config.block_size, config.tenant_quotas)
        # The shared tier (config.remote): restores continue from it, stores publish to it.
        self.remote: RemoteTier | None = None
        if config.remote is not None:
            self._connect_remote()
        self._make_spares_ahead()  # last: nothing after it may fail the open

    def _eviction_memory(self) -> EvictionMemory:
        """What was removed, when and why, recorded from this open on (a writer's)."""
        memory = EvictionMemory(self.config.eviction_memory)
        if not self.read_only:
            try:
                memory.start(self.store, self.counters.values()["blocks_evicted"], time.time())
            except BankFullError as e:  # recording begins at the next open with room
                log.warning("cas_bank: %s; removals are not recorded yet", e)
        return memory

    def _make_spares_ahead(self) -> None:
        """The spare arrays the bank's last session ended with, made by its spares'
        thread (`Spares.make_ahead`, within `spare_bytes`; it stops once a restore takes
        or at `close`) while the caller goes on (a `PrefixCache` probing its model: 47-65
        ms here, against 38 ms to make 107 MB), so that a reopened bank's first restore,
        too, fills arrays already in memory, not fresh pages. None where restores use no
        spares (`spare_bytes` 0, as the tools open banks; `arrays.cpu_fillable` false:
        staged destinations)."""
        if self._spares_recorded and cpu_fillable():
            self.resources.spares.make_ahead(self._spares_recorded)

    def _connect_remote(self) -> None:
        """Start the shared tier of `config.remote`, and name it in the bank's meta
        so that tools reading the bank later can name it."""
        from cas_bank.remote.tier import RemoteTier

        self.remote = RemoteTier(self)
        if not self.read_only:
            with self.transaction(budget=False) as tx:
                tx.put(Family.META, _KEY_REMOTE, self.remote.url.encode())

    @classmethod
    def open(
        cls,
        path: str | Path | BlockStore,
        config: BankConfig | None = None,
        *,
        mode: AccessMode = "read_write",
    ) -> Bank:
        """Create or reopen the bank at `path`, or in the store given.

        `path`: a bank directory (RocksDB, the default), a store URL (`rocksdb:///dir`,
        or a scheme another backend registered: `blocks.backends`), or a `BlockStore`
        of any backend, which the bank owns from then on and closes. `mode`:
        `read_write` (the one writer), `read_only` (frozen at open) or `secondary`
        (follows a live writer, see `refresh`); a store given brings its own. A
        `block_size` left unset in `config` is taken from the bank on disk; one set
        explicitly must match it.
        """
        config = config or BankConfig()
        warn_if_missing(log)  # once a process: the slower Python paths are never silent
        if config.remote is not None:  # a missing TLS file: refused before anything opens
            from cas_bank.remote.client import tls_options

            tls_options(config)
        if isinstance(path, BlockStore):
            store: BlockStore = path
            built = False
        else:
            if not str(path).strip():  # Path("") is the current directory
                raise InvalidInputError("the bank path is empty; name a directory")
            if mode not in ("read_write", "read_only", "secondary"):
                raise InvalidInputError(
                    f"mode {mode!r} is not one of 'read_write', 'read_only', 'secondary'"
                )
            if isinstance(path, Path) or "://" not in str(path):
                path = Path(path).expanduser()  # "~/banks/x" as a shell would read it
            store = open_store(path, mode=mode, durability=config.durability)
            built = True
        where = Path(store.location)
        try:  # anything failing here must not keep the directory's LOCK
            config = check_settings(store, where, config)
            if built and Path(store.location).is_dir():
                # Large payloads live in files beside the database (blocks.files),
                # fsync'd before their batch commits under durability="wal".
                store = FileTier(
                    store,
                    where / "payloads",
                    min_bytes=_NEVER if config.file_min_bytes is None else config.file_min_bytes,
                    durable=config.durability == "wal",
                    record_digests=record_files(config),
                    head_bytes={Family.ENDS: header_bytes},
                )
            if config.hot_bytes > 0:
                store = HotStore(store, config.hot_bytes)
            return cls(where, config, store)
        except BaseException:
            store.close()
            raise

    # -- namespaces ----------------------------------------------------------------
    def namespace(self, spec: ModelSpec, *, salt: str | bytes | None = None) -> Namespace:
        """The namespace of `spec`'s model: its blocks share a chain root nobody else has.

        `salt`: a tenant's salt (vLLM's `cache_salt`). It enters the root, so prompts
        with the same salt share every block and different salts share none: one
        tenant cannot learn from restore timing what another sent.
        """
        try:
            salted = salt_bytes(salt)
        except TypeError as e:
            raise InvalidInputError(str(e)) from None
        key = spec.fingerprint + (":" + salted.hex() if salted else "")
        ns = self._namespaces.get(key)
        if ns is None:
            root = namespace_root(spec.fingerprint, self.config.block_size, salted)
            if not self.read_only:
                # The namespace record (for tools) and its tenant's (`evict.tenants`).
                record = self.store.get(Family.NAMESPACES, root)
                tenant = self.store.get(Family.META, TENANT_PREFIX + root)
                if record is None or tenant is None:
                    with self.transaction(budget=False) as tx:
                        if record is None:
                            tx.put(Family.NAMESPACES, root, spec.model_dump_json().encode())
                        if tenant is None:
                            tx.extend([tenant_record(root, salted)])
                self.tenants.noted(root, salted)
            ns = Namespace(self, spec, root)
            self._namespaces[key] = ns
            self._ready_restores(spec)
        return ns

    def _ready_restores(self, spec: ModelSpec) -> None:
        """At a new namespace: the shapes its restores into the capacities the recorded
        spares hold check and allocate (`assemble.prime_shapes`, the most recent
        `_PRIMED`), made now rather than by its first restore."""
        recorded = self._spares_recorded
        if not recorded or not cpu_fillable():
            return
        one = [(a.with_tokens(1), dtype_named(a.dtype)) for a in spec.block_arrays[:1]]
        capacities = capacities_of(one, recorded)[-_PRIMED:]
        prime_shapes(self.resources, spec, self.config.block_size, capacities)

    def _record_spares(self) -> None:
        """Keep what the spares' pool would hold now (`Spares.wanted_recently`) for the
        next open, where it changed; a session that restored nothing keeps the last."""
        recent = self.resources.spares.wanted_recently()
        if self.read_only or not recent:
            return
        raw = encode_wanted(recent)
        if raw == self._spare_record:
            return
        try:
            with self.transaction(budget=False) as tx:
                tx.put(Family.META, _KEY_SPARES, raw)
        except BankFullError as e:  # advice: the counters and last uses are tried next
            log.warning("cas_bank: %s; the spares' shapes are not kept for the next open", e)
            return
        self._spare_record = raw

    # -- writing -------------------------------------------------------------------
    @contextmanager
    def transaction(self, *, budget: bool = True) -> Iterator[Transaction]:
        """The one way to change the bank: `with bank.transaction() as tx:`.

        Holds the write lock; gather writes, counter deltas, uses, forgets and suspect
        clears on `tx`. Leaving the block commits them in one batch (an exception
        aborts: nothing is written, nothing in memory changes); then, with `budget`,
        the bank is evicted down to `config.max_bytes` (a transaction of its own).
        See `write.txn`. Transactions do not nest.
        """
        if self.read_only:
            raise RuntimeError(f"bank at {self.path} is open read-only: it cannot write")
        with self.write_lock:
            if self._in_transaction:
                raise RuntimeError("a transaction is already open on this bank")
            tx = Transaction(
                self.store,
                self.counters,
                self.access,
                self.suspects,
                self.evictions,
                follow=_indexes,  # the children index and chain records follow it
            )
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
                        states = [k for f, k, v in tx.writes if f is Family.STATES and v is None]
                        if states:
                            self.leases.forget_states(states)
                        ends = [k for f, k, v in tx.writes if f is Family.ENDS and v is None]
                        if ends:
                            self.leases.forget_ends(ends)
            finally:
                self._in_transaction = False
            if budget:
                self._enforce_budget()

    def _enforce_budget(self) -> EvictionReport | None:
        """Evict if the counters say the bank is over `config.max_bytes`."""
        if self.tenants.quotas(self.store):
            enforce_quotas(self, self.tenants)  # each tenant down to its quota first
        limit = self.config.max_bytes
        if limit is None:
            return None
        if self.access.index is None and self.access.policy == "lfu":
            leaf_index(self.store, self.access)  # lfu counts uses from the first store on
        v = self.counters.values()
        if v["payload_bytes"] + v["state_bytes"] + v["end_bytes"] <= limit:
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
            hot_tier_bytes=self.hot.used_bytes if self.hot is not None else 0,
            leased_bytes=self.leases.used_bytes if self.leases is not None else 0,
            live_bytes=self.leases.live_bytes if self.leases is not None else 0,
            hot_bytes=self.config.hot_bytes,
            spare_held_bytes=self.resources.held_bytes,
            spare_bytes=self.config.spare_bytes,
            run_table_held_bytes=self.resources.run_tables.bytes,
            run_table_bytes=self.config.run_table_bytes,
            remote=self.remote.url if self.remote is not None else _remote_of(self.store),
            **v,
        )

    # -- tenants ---------------------------------------------------------------------
    def set_quota(self, salt: str | bytes | None, limit_bytes: int) -> list[TenantEviction]:
        """Store a byte quota for the tenant of `salt` (None: unsalted data), kept across
        restarts and winning over `BankConfig.tenant_quotas`; enforced at once (what
        it evicted) and after every store (`evict.tenants`)."""
        self.flush()
        return set_quota(self, self.tenants, salt, limit_bytes, self.config.block_size)

    def clear_quota(self, salt: str | bytes | None) -> bool:
        """Remove the stored quota of `salt`'s tenant (a `BankConfig` one applies
        again); False if none was stored."""
        return clear_quota(self, self.tenants, salt)

    def quotas(self) -> dict[str, int]:
        """The quota in force per tenant id (`tenant_id(salt)`)."""
        return self.tenants.quotas(self.store)

    def revoke(
        self, salt: str | bytes | None, *, batch: int = 1024, batches: int | None = None
    ) -> RevokeReport:
        """Remove everything the tenant of `salt` holds (blocks, states, end records,
        pins), queued stores first written, in transactions of at most `batch`
        removals: the bank serves meanwhile, and a crash between them leaves no hole
        (`evict.tenants`). `batches`: stop after that many (`RevokeReport.done`).

        With a shared tier, first every key of the tenant's namespaces there
        (`RemoteTier.purge`, after this bank's queued publishes are written), then the
        local records (fetches adopted meanwhile written first, then removed too). A
        cluster that is down or a master that fails does not stop the local revoke
        nor raise: `RevokeReport.remote_purged` is False and `remote_failed` names the
        masters; revoking again finishes the purge. Other hosts' banks are revoked
        each on its own (docs/design.md, "Eviction order", Tenants)."""
        self.flush()
        purge = None
        if self.remote is not None:
            purge = self.remote.purge(roots_of_salt(self.store, self.config.block_size, salt))
            self.remote.wait()  # fetches adopted during the purge: written, then revoked
        report = revoke(
            self, self.tenants, salt, self.config.block_size, batch=batch, batches=batches
        )
        if purge is None:
            return report
        return replace(
            report,
            remote_purged=purge.complete,
            remote_keys=purge.keys,
            remote_failed=purge.failed,
        )

    def tenant_stats(self) -> list[TenantStats]:
        """Bytes, hits and quota per tenant (by `tenant_id`, never the salt), most bytes
        first. The first call builds the leaf index (a walk of the headers, ends and
        access families, under the write lock), kept current from then on."""
        with self.write_lock:  # the index changes with every batch, under this lock
            held = dict(leaf_index(self.store, self.access).root_bytes)
            roots = dict(self.tenants.roots(self.store))
            quotas = self.quotas()
        return tenant_stats(held, roots, self.counters.root_hits(self.store), quotas)

    def restore_times(self) -> RestoreTotals:
        """Where this process's restores on this bank spent their time: the sums of
        every restore's `Hit.timings` (misses too) since it opened. Process-local, unlike
        `stats()`: a runtime's metrics divide them by `restores` for means."""
        return self.restore_clock.totals()

    @property
    def payload_check(self) -> Check:
        """The check this bank's new payloads carry (`BankConfig.payload_check`, as the
        open resolved it); reads check every record by the one it carries."""
        return self.config.payload_check or "blake3"

    @property
    def degraded(self) -> str | None:
        """Why stores are refused right now (a full disk: `BankFullError`), or None.
        Restores keep working; the bank writes again once space is freed."""
        return self.store.degraded()

    def refresh(self) -> None:
        """For a secondary open: catch up with the writer (data and counters)."""
        self.store.refresh()
        self.counters.reload(self.store)

    def flush(self, *, wait: bool = True) -> None:
        """Persist the activity counters and last uses now (they also ride along stores).

        With a shared tier, it first waits until every queued publish (and every local
        write of fetched blocks) is done. `wait=False` (a restore's periodic flush)
        skips the flush while a store holds the write lock: that store's batch carries
        the same records, and cutting in between its recording of uses and its write
        would write them without its blocks.
        """
        if self.writer is not None and wait and not _owned(self.write_lock):
            self.writer.flush()  # every queued store written (its failure raised here)
        if wait and self.remote is not None:
            self.remote.wait()  # outside the write lock: the local writes of fetches take it
        if self.read_only or not self.write_lock.acquire(blocking=wait):
            return
        try:
            if not self._in_transaction:  # a flush inside a transaction is its commit
                with self.transaction(budget=False):
                    pass
        finally:
            self.write_lock.release()

    def close(self) -> None:
        """Write what is queued, persist counters and last uses, close the shared tier
        and release the directory (its lock too); a second close does nothing.

        Also when a store failed or the disk is full: a store's failure is raised once
        the rest is closed (a full disk's is logged, not raised), and the counters and
        last uses are saved if there is room (lost otherwise, with a warning). From the
        background writer's own thread (a `when_written` callback): `RuntimeError`, and
        nothing is closed (it would wait for itself)."""
        if self._closed:
            return
        if self.writer is not None:
            self.writer.refuse_own_thread("Bank.close()")
        self._closed = True
        failed: Exception | None = None
        try:
            try:
                if self.writer is not None:
                    self.writer.close()
            except Exception as e:  # a queued store's: raised once the rest is closed
                failed = e
            if self.remote is not None:
                self.remote.close()  # finishes queued publishes and local writes first
            self._record_spares()
            self.flush()
        except BankFullError as e:
            log.warning("cas_bank: %s; closing without the last counters", e)
        finally:
            self.resources.close()  # the spares' thread joined, its arrays released
            if self.leases is not None:
                self.leases.clear()  # the arrays it held released with the bank
            self.store.close()
            self._namespaces.clear()
        if isinstance(failed, BankFullError):
            log.warning("cas_bank: %s", failed)
        elif failed is not None:
            raise failed

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


def _remote_of(store: BlockStore) -> str | None:
    raw = store.get(Family.META, _KEY_REMOTE)
    return raw.decode(errors="replace") if raw else None


def _owned(lock: threading.RLock) -> bool:
    """Whether this thread holds `lock` (then waiting for the writer would deadlock)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


def _indexes(store: BlockStore, writes: list[Write]) -> list[Write]:
    """The writes that keep the bank's indexes true to a batch: the children index
    (`index.children`) and the chain records (`index.chain`)."""
    return [*index_writes(store, writes), *run_writes(store, writes)]


def _file_tier_under(store: object) -> FileTier | None:
    """The file tier of large payloads under `store` (Bank.open puts one), if any."""
    inner = store
    while not isinstance(inner, FileTier) and hasattr(inner, "inner"):
        inner = inner.inner
    return inner if isinstance(inner, FileTier) else None
