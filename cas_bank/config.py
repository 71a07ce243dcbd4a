"""`BankConfig`: every setting of a bank, and the only place their defaults live.

Settings that change what is stored (`block_size`) are persisted at creation and
checked at every open; the rest are per-open choices (budget, hot tier, compression).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MiB = 1 << 20

EvictionPolicy = Literal["lfu", "lru"]
"""The order eviction removes candidates in (docs/design.md, "Eviction order")."""


class BankConfig(BaseModel):
    """Settings of one bank, frozen; pass it to `Bank.open`."""

    # hide_input_in_errors: an error about `remote` must not print its password.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    block_size: int = Field(default=64, ge=1, le=1 << 16, strict=True)
    """Tokens per block. Persisted at creation; reopening with another value is an error."""

    compression: Literal["auto", "lz4", "none"] = "auto"
    """lz4 for payloads: `auto` keeps the compressed form only where it is clearly smaller."""

    durability: Literal["wal", "fast"] = "wal"
    """`wal`: every store survives a crash once `store` returns. `fast`: no WAL, atomic
    flushes; RocksDB flushes when a family's memtable fills (64 MiB by default) and at
    close, so a crash may lose the stores since the last flush, never half a block."""

    max_bytes: int | None = Field(default=None, ge=0, strict=True)
    """Disk budget for payloads, states and end records; None means unbounded."""

    eviction_policy: EvictionPolicy = "lfu"
    """The order eviction to `max_bytes` (and `cas-bank gc`) removes leaves in.
    `lfu`: least frequently used first, with dynamic aging (a use counts one; a new use
    starts from the rank of the last victim, so what was popular once ages out), least
    recently used among equals; what many prompts share outlives one-off prompts stored
    later. `lru`: least recently used first. Use counts live in the process's memory
    (a reopened bank starts every count at one); last uses are on disk either way."""

    pin_share: float = Field(default=0.5, ge=0.0, le=1.0)
    """The share of `max_bytes` pinned prefixes may hold together (`Namespace.pin`,
    `cas-bank pin`): a pin that would take the pinned bytes past it is refused, naming
    the numbers. Without `max_bytes` pins are not limited."""

    tenant_quotas: tuple[tuple[str, int], ...] = ()
    """A byte quota per tenant (a `cache_salt`; unsalted data is a tenant too), keyed
    by `cas_bank.evict.tenants.tenant_id(salt)` (32 hex characters: a salt itself is never kept):
    after a store, a tenant over its quota loses its own least valuable entries, in
    the eviction order, down to it; other tenants are untouched. A quota stored in the
    bank (`Bank.set_quota`, `cas-bank quota set`) wins for the same tenant
    (`evict.tenants`). Empty: no quotas but the stored ones. Given as a dict (or
    pairs), kept as sorted pairs so that the config stays hashable."""

    file_min_bytes: int | None = Field(default=64 * 1024, ge=0, strict=True)
    """Payloads of at least this many bytes are kept as files beside the database and
    read straight into a restore's arrays (`blocks.files`); None keeps every payload in
    RocksDB (read through rocksdict, slower: docs/design.md, "Restore path"). Files
    already written stay readable."""

    payload_check: Literal["xxh3", "blake3"] | None = None
    """The check new payloads carry (docs/design.md, "Payload codec"). None: the bank's
    own, XXH3-128 in a bank created at format version 4 or later, blake3 in an older
    one (which so stays a version-3 bank that the cas_bank that wrote it still opens).
    `"xxh3"` on an older bank marks it version 4: its blake3 records stay as they are,
    new ones are XXH3-128. Every read checks each record by the check it carries."""

    write_behind: int = Field(default=4, ge=0, strict=True)
    """Stores the background writer may hold queued (`Namespace.store_later`, and every
    store of `PrefixCache`, `BankPromptCache` and the servers unless they are asked for
    inline stores); a caller waits while that many are queued. 0: no writer, every
    store is written on the caller's thread. `Namespace.store` is always synchronous."""

    admit: Literal["always", "second_use"] = "always"
    """Which new blocks a store writes. `always`: every one. `second_use`: a new block
    is written the second time a store of this process offers it (the first time it is
    only remembered); so a prompt's tail is written when the next turn repeats it, and
    a shared prefix when a second prompt shares it, while tails nobody sends again are
    never written. Blocks already stored count as seen; a state is written with its
    block (or once that block is stored). Memory: 32 bytes per remembered block."""

    admit_min_tokens: int = Field(default=0, ge=0, strict=True)
    """A store of fewer full-block tokens than this writes nothing new."""

    hot_bytes: int = Field(default=256 * MiB, ge=0, strict=True)
    """Byte bound of this process's memory for the bank: the hot tier of decoded blocks
    and the leases (chains stored or restored here, kept as MLX arrays) together, least
    recently used first out (`stats()` shows both); 0 turns both off."""

    spare_bytes: int = Field(default=1 << 30, ge=0, strict=True)
    """Byte bound of the destination arrays this process keeps made ahead of the bank's
    next restores (`cas_bank.restore.spares`): one restore's set per shape, and a lease
    restored again copied ahead (two at most, each at most half the bound). Held only
    once restores of those shapes happen, or, in a reopened bank, from its open on (the
    shapes its last session's spares held, kept in meta at close)
    (`stats().spare_held_bytes`), released by `close()`; made by one background thread
    of the bank's. 0: none, and no thread (each restore allocates and faults in fresh
    arrays); the `cas-bank` tools open banks so."""

    run_table_bytes: int = Field(default=8 * MiB, ge=0, strict=True)
    """Byte bound of the copy-run tables this process keeps for the bank's restores of
    small payloads kept in RocksDB (`restore.row_runs.RunTables`: per layout, the native
    copy's runs of its first 2^k blocks at address 0, 13.5 MiB for 4-bit KV at 16-token
    blocks and 4096 blocks: over the default, so made for its restore and not kept), the
    most recently used kept
    (`stats().run_table_held_bytes`), released by `close()`. 0: each restore makes the
    tables it uses and keeps none."""

    access_flush_interval: float = Field(default=5.0, ge=0.0)
    """Seconds between batched writes of last-use times (never a write per restore)."""

    eviction_memory: int = Field(default=1 << 19, ge=0, strict=True)
    """Removals (evictions, `verify --fix`) the bank remembers, newest first, so that
    `explain` tells a block evicted (when, why) from one never stored: at most this
    many records, about 100 bytes each on disk (52 MiB at the default 524288). 0
    remembers none (explain then says "never stored, or evicted before" the last
    removal)."""

    state_stride: int | None = Field(default=None, ge=1, strict=True)
    """Also capture a recurrent state every this many blocks during prefill."""

    partial_blocks: bool = Field(default=True, strict=True)
    """Restores take the first tokens of a stored block a prompt leaves inside it
    (attention-only models; docs/design.md, "Partial blocks"). False: whole blocks and
    end records only (the children index is kept either way)."""

    remote: str | None = Field(default=None, repr=False)
    """The shared tier: `valkey://[user][:password]@host:port` (`valkeys://` for TLS) of
    any node of a Valkey cluster, or of a single Valkey/Redis server; cluster mode is
    detected. None (the default): no shared tier, nothing changes."""

    remote_secret: str | None = Field(default=None, repr=False)
    """Fleet secret keying the MAC of every entry published to the shared tier; required
    with `remote`, and never the cluster's password. It is the only key material of the
    MAC (nothing of the URL enters it), so whoever can log into the cluster, but does
    not hold the secret, cannot write an entry any host accepts."""

    remote_tls_ca: str | None = None
    """With `valkeys://`: the PEM file of the CA (bundle) that signed the servers'
    certificates; None trusts the system's CAs. A server's certificate chain is always
    verified; its host name is not (a cluster's nodes are reached at the addresses of
    its slot map, so the CA is what is trusted: use a CA of the fleet's own)."""

    remote_tls_cert: str | None = None
    """With `valkeys://`: this host's client certificate (PEM), for servers that ask for
    one (`tls-auth-clients yes`, mutual TLS). Set with `remote_tls_key`."""

    remote_tls_key: str | None = None
    """The private key (PEM, unencrypted) of `remote_tls_cert`."""

    remote_connect_timeout: float = Field(default=0.25, gt=0.0)
    """Seconds to connect to a node of the shared tier before counting a time-out."""

    remote_timeout: float = Field(default=0.5, gt=0.0)
    """Seconds to wait for an answer of the shared tier before counting a time-out."""

    remote_retry_after: float = Field(default=5.0, ge=0.0)
    """After a failed call (an error or a time-out) the shared tier is not asked for
    this long."""

    remote_queue_bytes: int = Field(default=256 * MiB, ge=1)
    """Bound of the queue of publishes (and of fetched blocks waiting for their local
    write); past it a publish is dropped and counted, never waited for."""

    remote_fetch_bytes: int = Field(default=64 * MiB, ge=1)
    """Payload bytes fetched from the shared tier per pipelined round trip."""

    @field_validator("tenant_quotas", mode="before")
    @classmethod
    def _quota_pairs(cls, quotas: object) -> object:
        return tuple(sorted(quotas.items())) if isinstance(quotas, Mapping) else quotas

    @field_validator("tenant_quotas")
    @classmethod
    def _check_quotas(cls, quotas: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        for tenant, limit in quotas:
            if len(tenant) != 32 or any(c not in "0123456789abcdef" for c in tenant):
                raise ValueError(
                    f"tenant_quotas keys are cas_bank.evict.tenants.tenant_id(salt): 32 lowercase "
                    f"hex characters, got {tenant!r}"
                )
            if isinstance(limit, bool) or limit < 0:
                raise ValueError(f"a quota is a non-negative number of bytes, got {limit!r}")
        return quotas

    @field_validator("remote")
    @classmethod
    def _check_remote(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("valkey", "valkeys", "redis", "rediss"):
            raise ValueError(
                f"remote must be valkey://[user][:password]@host:port (or valkeys:// for "
                f"TLS); got scheme {parts.scheme!r}"
            )
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"remote has a bad port: {e}") from None
        if not parts.hostname or port is None:
            raise ValueError("remote must name a host and a port: valkey://host:port")
        return url

    @model_validator(mode="after")
    def _check_tls(self) -> BankConfig:
        given = [
            name
            for name in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key")
            if getattr(self, name) is not None
        ]
        if given and urlsplit(self.remote or "").scheme not in ("valkeys", "rediss"):
            raise ValueError(
                f"{', '.join(given)} set, but remote is not a TLS URL: use valkeys://host:port"
            )
        if (self.remote_tls_cert is None) != (self.remote_tls_key is None):
            raise ValueError("remote_tls_cert and remote_tls_key go together (mutual TLS)")
        return self

    @model_validator(mode="after")
    def _check_secret(self) -> BankConfig:
        if self.remote is None:
            return self
        if not self.remote_secret:
            raise ValueError(
                "remote needs remote_secret (cas-bank serve: $CAS_BANK_REMOTE_SECRET), a "
                "fleet secret the cluster never sees: it keys the MAC of every shared-tier "
                "entry, and without it anyone who can log into the cluster could forge "
                "entries every host accepts"
            )
        if self.remote_secret == url_credentials(self.remote)[1]:
            raise ValueError(
                "remote_secret is the cluster's password: whoever can log into the cluster "
                "could forge entries every host accepts; use a secret the cluster never sees"
            )
        return self


def url_credentials(url: str) -> tuple[str, str]:
    """The user and password of `url`: in its user part, or (as the `valkey` client
    also reads them) its `username=` and `password=` query parameters."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username or "") or query.get("username", "")
    return user, unquote(parts.password or "") or query.get("password", "")
