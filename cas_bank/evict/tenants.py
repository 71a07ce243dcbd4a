"""Tenants: byte quotas and revocation per salt (`cache_salt`), and what each holds.

A tenant is a salt; unsalted data is the tenant of the empty salt. It is named by
the salt's digest (`tenant_id`: blake3 in derive-key mode, context
`TENANT_CONTEXT`, 16 bytes, shown as hex), never by the salt itself: nothing here
stores or prints a salt. A digest names a salt to anyone who can guess it, so a salt
should be a secret nobody guesses (as vLLM says of `cache_salt`).

Which namespaces are a tenant's: the salt enters the namespace root
(`blocks.hashing.namespace_root`), so the root alone does not say. `Bank.namespace`
records it: `meta` key `tenant/` + root, value `version u8 (1) | tenant digest 16`.
A namespace without that record (one made before it) is the unsalted tenant's when
its root is its spec's unsalted root, else a tenant of its own (`root:` + the root's
first 8 bytes in hex) until the salt is named again: opening the namespace with its
salt, `set_quota` and `revoke` recompute each namespace's root under the salt and
write the record for those that match.

Quotas (`meta` key `quota/` + digest, value `version u8 (1) | limit <u8`, written by
`cas-bank quota set`; `BankConfig.tenant_quotas` by tenant id): after every store
the bank checks each tenant with a quota and, while it holds more than its quota,
evicts that tenant's own candidates in the bank's eviction order (`evict.eviction`),
never another tenant's; pinned prefixes stay. A stored quota wins over
`BankConfig.tenant_quotas` for the same tenant (an operator's `quota set` outlives a
restart with the old config); `quota clear` removes the stored one, and the
config's applies again.

Revocation (`revoke`): the tenant's pins go in one batch, then its blocks, states and
end records in batches of at most `batch` removals, each one transaction of leaves
(a block goes only once its children are gone, in the same batch or an earlier
one): between batches the write lock is free (stores and restores go on), and a
crash between them leaves a smaller tree with no hole. Its namespace and tenant
records stay (they hold no cache data), and so does its quota.

What a tenant holds is summed from the leaf index (`LeafIndex.root_bytes`), its hits
from the per-namespace counters (`stats.Counters.root_hit`).

Here: who the tenants are, their quotas, revocation and what each holds; the removal
of a tenant's entries in eviction order (`TenantHeap`, `evict_tenant`) is
`evict.tenant_eviction`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import blake3

from cas_bank.blocks.hashing import namespace_root, salt_bytes
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import InvalidInputError
from cas_bank.evict.eviction import leaf_index
from cas_bank.evict.leaves import LeafIndex
from cas_bank.evict.pins import read_pins

# Removing a tenant's entries lives in `tenant_eviction`; its names stay importable here.
from cas_bank.evict.tenant_eviction import TenantEviction as TenantEviction
from cas_bank.evict.tenant_eviction import TenantHeap as TenantHeap
from cas_bank.evict.tenant_eviction import Victim as Victim
from cas_bank.evict.tenant_eviction import evict_tenant as evict_tenant
from cas_bank.evict.tenant_eviction import held_bytes as held_bytes
from cas_bank.index.tree import load_namespaces
from cas_bank.owner import Writer

TENANT_CONTEXT = "cas_bank 2026-12-06 tenant v1"
TENANT_PREFIX = b"tenant/"
QUOTA_PREFIX = b"quota/"
VERSION = 1
_DIGEST = 16
_QUOTA = struct.Struct("<BQ")
SHORT = 12  # hex characters of a tenant id shown in tables and metrics
_ID = re.compile(r"[0-9a-f]{32}")


def tenant_digest(salt: str | bytes | None) -> bytes:
    """The 16-byte digest naming the tenant of `salt` (None or empty: unsalted)."""
    return blake3.blake3(salt_bytes(salt), derive_key_context=TENANT_CONTEXT).digest(_DIGEST)


def tenant_id(salt: str | bytes | None) -> str:
    """The tenant of `salt` as 32 hex characters (`BankConfig.tenant_quotas` keys)."""
    return tenant_digest(salt).hex()


UNSALTED = tenant_id(None)


def short_id(tenant: str) -> str:
    """A tenant id as tables and metrics show it."""
    return tenant if tenant.startswith("root:") else tenant[:SHORT]


def check_tenant_id(tenant: str) -> str:
    if not isinstance(tenant, str) or not _ID.fullmatch(tenant):
        raise ValueError(f"a tenant id is the 32 hex characters of tenant_id(salt), got {tenant!r}")
    return tenant


def tenant_record(root: bytes, salt: str | bytes | None) -> Write:
    """The `meta` record naming `root`'s tenant."""
    return (Family.META, TENANT_PREFIX + bytes(root), bytes([VERSION]) + tenant_digest(salt))


def tenant_map(store: BlockStore, block_size: int) -> dict[bytes, str]:
    """The tenant id of every namespace root the bank knows (see the module)."""
    recorded: dict[bytes, str] = {}
    for key, raw in store.iterate(Family.META):
        if key.startswith(TENANT_PREFIX) and len(raw) == 1 + _DIGEST and raw[0] == VERSION:
            recorded[key[len(TENANT_PREFIX) :]] = raw[1:].hex()
    specs, _ = load_namespaces(store)
    out = dict(recorded)
    for root, spec in specs.items():
        if root in out:
            continue
        unsalted = namespace_root(spec.fingerprint, block_size) == root
        out[root] = UNSALTED if unsalted else "root:" + root[:8].hex()
    return out


def roots_of_salt(store: BlockStore, block_size: int, salt: str | bytes | None) -> set[bytes]:
    """Every namespace root of the tenant of `salt`: recorded as its, or recomputed
    from a namespace record's spec under the salt."""
    wanted = tenant_id(salt)
    salted = salt_bytes(salt)
    specs, _ = load_namespaces(store)
    roots = {
        r for r, spec in specs.items() if namespace_root(spec.fingerprint, block_size, salted) == r
    }
    roots |= {r for r, t in tenant_map(store, block_size).items() if t == wanted}
    return roots


def _read_quotas(store: BlockStore) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, raw in store.iterate(Family.META):
        if key.startswith(QUOTA_PREFIX) and len(raw) == _QUOTA.size and raw[0] == VERSION:
            out[key[len(QUOTA_PREFIX) :].hex()] = _QUOTA.unpack(raw)[1]
    return out


class Tenants:
    """A bank's tenants: which roots are whose, the quotas in force (config and
    stored), read on first use and kept current by this bank's own changes."""

    def __init__(self, block_size: int, config_quotas: Iterable[tuple[str, int]]) -> None:
        self.block_size = block_size
        self.config_quotas = {check_tenant_id(t): int(n) for t, n in config_quotas}
        self._roots: dict[bytes, str] | None = None
        self._stored: dict[str, int] | None = None
        # Per tenant, the bytes an enforcement could not go below (all that is left is
        # pinned): no new walk of its entries until it holds more than that.
        self.floor: dict[str, int] = {}
        # Each quota tenant's candidate heap, kept between stores (`TenantHeap`).
        self.heaps: dict[str, TenantHeap] = {}

    def roots(self, store: BlockStore) -> dict[bytes, str]:
        if self._roots is None:
            self._roots = tenant_map(store, self.block_size)
        return self._roots

    def noted(self, root: bytes, salt: str | bytes | None) -> None:
        """`Bank.namespace` opened (and recorded) `root` for `salt`."""
        if self._roots is not None:
            self._roots[bytes(root)] = tenant_id(salt)

    def forget_roots(self) -> None:
        self._roots = None

    def stored_quotas(self, store: BlockStore) -> dict[str, int]:
        if self._stored is None:
            self._stored = _read_quotas(store)
        return self._stored

    def quotas(self, store: BlockStore) -> dict[str, int]:
        """The quota in force per tenant id: the stored one, else the config's."""
        return {**self.config_quotas, **self.stored_quotas(store)}

    def roots_of(self, store: BlockStore, tenant: str, index: LeafIndex) -> set[bytes]:
        roots = self.roots(store)
        if any(r not in roots for r in index.root_bytes):  # a namespace made elsewhere
            self._roots = None
            roots = self.roots(store)
            for r in index.root_bytes:  # blocks without a namespace record: not looked
                roots.setdefault(r, "root:" + r[:8].hex())  # for again at every store
        # A copy first: `noted` (a namespace opened on another thread) may add a root.
        return {r for r, t in list(roots.items()) if t == tenant}


def enforce_quotas(bank: Writer, tenants: Tenants) -> list[TenantEviction]:
    """Evict every tenant over its quota down to it (after a store)."""
    quotas = tenants.quotas(bank.store)
    for tenant in [t for t in tenants.heaps if t not in quotas]:  # a quota cleared
        tenants.heaps.pop(tenant).close()
    if not quotas:
        return []
    index = leaf_index(bank.store, bank.access)
    out = []
    for tenant, limit in quotas.items():
        roots = tenants.roots_of(bank.store, tenant, index)
        kept = tenants.heaps.get(tenant)
        if kept is not None and not kept.fresh(index, roots):  # bounded, or gone if stale
            tenants.heaps.pop(tenant).close()
        held = held_bytes(index, roots) if roots else 0
        if held <= limit or held <= tenants.floor.get(tenant, -1):
            continue
        went = evict_tenant(bank, tenant, roots, limit=limit, heaps=tenants.heaps)
        out.append(went)
        if went.bytes_after > limit:
            tenants.floor[tenant] = went.bytes_after
        else:
            tenants.floor.pop(tenant, None)
    return out


# -- quotas ---------------------------------------------------------------------------
def set_quota(
    bank: Writer, tenants: Tenants, salt: str | bytes | None, limit: int, block_size: int
) -> list[TenantEviction]:
    """Store the quota of `salt`'s tenant (it survives restarts) and enforce it now."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidInputError(f"a quota is a non-negative number of bytes, got {limit!r}")
    tenant = tenant_id(salt)
    roots = roots_of_salt(bank.store, block_size, salt)
    with bank.transaction(budget=False) as tx:
        tx.put(Family.META, QUOTA_PREFIX + tenant_digest(salt), _QUOTA.pack(VERSION, limit))
        tx.extend(tenant_record(r, salt) for r in roots)  # recorded from now on
    tenants.stored_quotas(bank.store)[tenant] = limit
    tenants.forget_roots()
    tenants.floor.clear()
    return enforce_quotas(bank, tenants)


def clear_quota(bank: Writer, tenants: Tenants, salt: str | bytes | None) -> bool:
    """Remove the stored quota of `salt`'s tenant; False if there was none."""
    key = QUOTA_PREFIX + tenant_digest(salt)
    with bank.transaction(budget=False) as tx:
        if tx.store.get(Family.META, key) is None:
            tx.abort()
            return False
        tx.delete(Family.META, key)
    tenants.stored_quotas(bank.store).pop(tenant_id(salt), None)
    return True


# -- revocation -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RevokeReport:
    """What `revoke` removed."""

    tenant: str
    namespaces: int
    pins: int
    batches: int
    blocks: int
    states: int
    ends: int
    bytes: int
    done: bool  # False: stopped after `batches` (call again to go on)
    # The shared tier (`Bank.revoke` fills these in; this layer does not reach it):
    remote_purged: bool | None = None  # None: no shared tier; False: not every master
    remote_keys: int = 0  # keys removed from the cluster
    remote_failed: tuple[str, ...] = ()  # masters not purged (revoke again to finish)


def revoke(
    bank: Writer,
    tenants: Tenants,
    salt: str | bytes | None,
    block_size: int,
    *,
    batch: int = 1024,
    batches: int | None = None,
) -> RevokeReport:
    """Remove everything the tenant of `salt` holds, in batches of at most `batch`
    removals (see the module); `batches` stops after that many (tests; the rest
    stays consistent and a second call goes on)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidInputError(f"batch must be a positive int, got {batch!r}")
    tenant = tenant_id(salt)
    roots = roots_of_salt(bank.store, block_size, salt)
    own_pins = [p for p in read_pins(bank.store) if p.root in roots]
    if roots:
        with bank.transaction(budget=False) as tx:
            tx.extend(tenant_record(r, salt) for r in roots)
            index = leaf_index(tx.store, bank.access)
            for pin in own_pins:
                tx.delete(Family.META, pin.key)
                held = index.pins.get(pin.key)
                if held is not None:
                    index.unpin(pin.key)
                    tx.on_abort(_repin(index, pin.key, held))
    tenants.forget_roots()
    n = blocks = states = ends = size = 0
    done = True
    heaps: dict[str, TenantHeap] = {}  # one heap for every batch (built once)
    try:
        while roots:
            if batches is not None and n >= batches:
                done = held_bytes(leaf_index(bank.store, bank.access), roots) == 0
                break
            went = evict_tenant(bank, tenant, roots, most=batch, revoking=True, heaps=heaps)
            if not went.evicted:
                break
            n += 1
            blocks += sum(1 for e in went.evicted if e.kind == "block")
            states += sum(1 for e in went.evicted if e.state_bytes > 0)
            ends += sum(e.ends for e in went.evicted)
            size += went.bytes_evicted
    finally:
        for heap in heaps.values():
            heap.close()
    return RevokeReport(tenant, len(roots), len(own_pins), n, blocks, states, ends, size, done)


def _repin(
    index: LeafIndex, key: bytes, held: tuple[tuple[bytes, ...], bytes | None]
) -> Callable[[], None]:
    def undo() -> None:
        index.pin(key, *held)

    return undo


# -- what each tenant holds -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TenantStats:
    tenant: str  # the id (32 hex), or `root:...` for a namespace of unknown salt
    namespaces: int
    bytes: int
    hits: int
    hit_tokens: int
    quota: int | None

    @property
    def unsalted(self) -> bool:
        return self.tenant == UNSALTED


def tenant_stats(
    held: Mapping[bytes, int],
    roots: Mapping[bytes, str],
    hits: Mapping[bytes, tuple[int, int]],
    quotas: Mapping[str, int],
) -> list[TenantStats]:
    """Bytes (`held`: by root), hits (by root) and the quota of every tenant (`roots`:
    root -> tenant id), most bytes first."""
    by: dict[str, list[int]] = {}
    every = set(roots) | set(held) | set(hits)
    for root in every:
        tenant = roots.get(root, "root:" + root[:8].hex())
        row = by.setdefault(tenant, [0, 0, 0, 0])
        row[0] += 1
        row[1] += held.get(root, 0)
        h = hits.get(root, (0, 0))
        row[2] += h[0]
        row[3] += h[1]
    for tenant in quotas:
        by.setdefault(tenant, [0, 0, 0, 0])
    out = [TenantStats(t, r[0], r[1], r[2], r[3], quotas.get(t)) for t, r in by.items()]
    return sorted(out, key=lambda s: (-s.bytes, s.tenant))
