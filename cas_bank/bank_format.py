"""A bank's format and the settings it keeps: the format version (what a bank on disk
may hold, and which cas_bank reads it) and the settings fixed at its creation (block
size, hash format), in `meta`; written at a bank's first open, checked at every open
(`Bank.open` calls `check_settings`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

from cas_bank.blocks.bankdir import FORMAT_KEY
from cas_bank.blocks.hashing import HASH_FORMAT_VERSION
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.config import BankConfig
from cas_bank.errors import BankDamagedError, BankSettingsError
from cas_bank.index.children import INDEXED_KEY
from cas_bank.index.ends import named_digest

FORMAT_VERSION = 5
"""1: every payload in RocksDB. 2: payloads of 64 KiB and more may be files beside it
(`blocks.files`), their records stubs. 3: the `ends` and `evicted` families (end
records, `index.ends`; the eviction memory, `evict.evicted`). 4: payloads may carry
an XXH3-128 check instead of blake3 (the digest field says which: `blocks.codec`).
5: end records of 64 KiB and more may be files too (a hybrid model's holds its state).
An older bank opens as it is (its payloads stay readable where they are, their blake3
digests checked; the writer's open creates the missing families) and is marked 3 by
its first writer, 5 only by one that writes XXH3-128 (`BankConfig.payload_check`,
which writes end-record files too); a cas_bank that reads an older version refuses a
newer bank, naming the version."""
BLAKE3_ONLY_VERSION = 3  # the newest format whose payloads are all blake3-checked
_KEY_BLOCK_SIZE = b"block_size"
_KEY_HASH_FORMAT = b"hash_format_version"
_KEY_CREATED = b"created"
_U32 = struct.Struct("<I")


def record_files(config: BankConfig) -> dict[Family, Callable[[bytes], bytes | None]]:
    """The records other than payloads a bank of `config` (as `check_settings` left it)
    writes as files when large (`blocks.files.FileTier`): end records, in a bank marked
    5 (its writer writes XXH3-128); none in an older one, which older cas_banks read."""
    return {Family.ENDS: named_digest} if config.payload_check == "xxh3" else {}


def _version_for(check: str) -> int:
    """The format version a bank whose writer writes `check` payloads is marked with:
    the oldest that reads them."""
    return FORMAT_VERSION if check == "xxh3" else BLAKE3_ONLY_VERSION


def check_settings(store: BlockStore, path: Path, config: BankConfig) -> BankConfig:
    """Compare the bank's persisted settings with `config`; write them on creation."""
    fmt, bs, hf = store.get_many(Family.META, [FORMAT_KEY, _KEY_BLOCK_SIZE, _KEY_HASH_FORMAT])
    if fmt is None:
        return _create(store, path, config)
    version = _U32.unpack(fmt)[0]
    if version > FORMAT_VERSION:
        raise BankSettingsError(
            f"bank at {path} has format version {version}; this cas_bank reads up to "
            f"{FORMAT_VERSION}: upgrade cas_bank"
        )
    # None: the bank's own check. An older bank keeps blake3 unless asked (so the
    # cas_bank that wrote it still opens it); nothing stored is rewritten.
    check = config.payload_check or ("xxh3" if version > BLAKE3_ONLY_VERSION else "blake3")
    marked = max(version, _version_for(check))
    if marked > version and not store.read_only:
        # 1 -> 2 -> 3 -> 4 -> 5 need no rewrite: new large payloads go to files, the
        # ends family was created by this open, new payloads carry XXH3-128, new large
        # end records go to files.
        store.put_batch([(Family.META, FORMAT_KEY, _U32.pack(marked))])
    config = config.model_copy(update={"payload_check": check})
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


def _create(store: BlockStore, path: Path, config: BankConfig) -> BankConfig:
    """A new bank's settings written (`check_settings` where meta holds no format): refused
    where the directory holds something else (a read-only open of no bank, a damaged
    MANIFEST, another program's database)."""
    if store.read_only:
        files = [*path.glob("*.sst"), *path.glob("*.blob")]
        if files and next(iter(store.keys(Family.HEADERS)), None) is None:
            raise BankDamagedError(
                f"bank at {path} does not open cleanly: its MANIFEST names no records "
                f"but {len(files)} table and blob files are present (a truncated or "
                f"damaged MANIFEST). `cas-bank salvage {path} NEW_DIR` copies every "
                "block that still verifies into a new bank"
            )
        raise BankSettingsError(f"{path} holds no cas_bank bank (no format record)")
    if any(next(iter(store.keys(f)), None) is not None for f in Family):
        raise BankDamagedError(
            f"{path} holds a RocksDB database with records but no cas_bank format "
            "record: not a cas_bank bank (or its meta table was lost); it was not "
            "opened. Use an empty directory, or `cas-bank salvage` for a damaged bank"
        )
    check = config.payload_check or "xxh3"
    store.put_batch(
        [
            (Family.META, FORMAT_KEY, _U32.pack(_version_for(check))),
            (Family.META, _KEY_BLOCK_SIZE, _U32.pack(config.block_size)),
            (Family.META, _KEY_HASH_FORMAT, _U32.pack(HASH_FORMAT_VERSION)),
            (Family.META, _KEY_CREATED, str(time.time()).encode()),
            (Family.META, INDEXED_KEY, b"1"),  # every record it will hold is indexed
        ]
    )
    return config.model_copy(update={"payload_check": check})
