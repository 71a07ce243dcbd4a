"""`BankConfig`: every setting of a bank, and the only place their defaults live.

Settings that change what is stored (`block_size`) are persisted at creation and
checked at every open; the rest are per-open choices (budget, hot tier, compression).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20


class BankConfig(BaseModel):
    """Settings of one bank, frozen; pass it to `Bank.open`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(default=64, ge=1, le=1 << 16)
    """Tokens per block. Persisted at creation; reopening with another value is an error."""

    compression: Literal["auto", "lz4", "none"] = "auto"
    """lz4 for payloads: `auto` keeps the compressed form only where it is clearly smaller."""

    durability: Literal["wal", "fast"] = "wal"
    """`wal`: every store survives a crash once `store` returns. `fast`: no WAL, atomic
    flushes; RocksDB flushes when a family's memtable fills (64 MiB by default) and at
    close, so a crash may lose the stores since the last flush, never half a block."""

    max_bytes: int | None = Field(default=None, ge=0)
    """Disk budget for payloads and states; None means unbounded."""

    file_min_bytes: int | None = Field(default=64 * 1024, ge=0)
    """Payloads of at least this many bytes are kept as files beside the database and
    read straight into a restore's arrays (`blocks.files`); None keeps every payload in
    RocksDB (read through rocksdict, ~1 GB/s). Files already written stay readable."""

    write_behind: int = Field(default=0, ge=0)
    """Stores `Namespace.store_later` (and `PrefixCache(background=True)`) may queue for
    the background writer; a caller waits when that many are queued. 0: no writer."""

    admit: Literal["always", "second_use"] = "always"
    """Which new blocks a store writes. `always`: every one. `second_use`: a new block
    is written the second time a store of this process offers it (the first time it is
    only remembered); so a prompt's tail is written when the next turn repeats it, and
    a shared prefix when a second prompt shares it, while tails nobody sends again are
    never written. Blocks already stored count as seen; a state is written with its
    block (or once that block is stored). Memory: 32 bytes per remembered block."""

    admit_min_tokens: int = Field(default=0, ge=0)
    """A store of fewer full-block tokens than this writes nothing new."""

    hot_bytes: int = Field(default=256 * MiB, ge=0)
    """Byte bound of the in-process hot tier of decoded blocks; 0 turns it off."""

    access_flush_interval: float = Field(default=5.0, ge=0.0)
    """Seconds between batched writes of last-use times (never a write per restore)."""

    state_stride: int | None = Field(default=None, ge=1)
    """Also capture a recurrent state every this many blocks during prefill."""
