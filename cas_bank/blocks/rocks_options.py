"""A bank's RocksDB options: each family's, and the database's (`cas_bank.blocks.rocks`
opens with them; benchmarks/ceilings.py measures RocksDB alone with them too).

Payload families and end records keep their values in BlobDB files, uncompressed (KV
does not compress; the codec decides per payload); every family has bloom filters and
RocksDB's XXH3 block checksums.
"""

from __future__ import annotations

from rocksdict import BlockBasedOptions, ChecksumType, DBCompressionType, Options

from cas_bank.blocks.store import PAYLOAD_FAMILIES, Family

MIN_BLOB_SIZE = 4096
# Families whose values go to BlobDB files: payloads, and end records (partial KV, a
# hybrid state, logits: up to MBs on real models), out of the LSM's rewrites. A
# secondary open reads them through its read-only instance (`cas_bank.blocks.rocks`).
BLOB_FAMILIES = frozenset({*PAYLOAD_FAMILIES, Family.ENDS})

# RocksDB info logs kept in a bank directory (`LOG` and the `LOG.old.*` before it).
INFO_LOGS_KEPT = 5


def family_options(family: Family) -> Options:
    """The options of `family`'s column family (raw mode: keys and values are bytes)."""
    opt = Options(raw_mode=True)
    if family in BLOB_FAMILIES:
        opt.set_enable_blob_files(True)
        opt.set_min_blob_size(MIN_BLOB_SIZE)
        opt.set_blob_compression_type(DBCompressionType.none())
        opt.set_compression_type(DBCompressionType.none())
        opt.set_enable_blob_gc(True)
    if family in (Family.CHAINS, Family.PREFIXES):
        # Read whole on every lookup: Snappy saved a third of their bytes and cost a
        # reopened 16k-token lookup's 4 records ~10-20 us of decompression.
        opt.set_compression_type(DBCompressionType.none())
    # Bloom filters: a lookup of a block that is not stored (every miss, and the binary
    # search of `stored_prefix`) is answered without reading table blocks.
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    # RocksDB's default for new tables, made explicit: the fastest checksum it offers.
    table.set_checksum_type(ChecksumType.xxh3())
    opt.set_block_based_table_factory(table)
    return opt


def db_options(durability: str) -> Options:
    """The database's options for a bank of `durability` (`wal` or `fast`)."""
    opt = family_options(Family.META)
    opt.create_if_missing(True)
    opt.create_missing_column_families(True)
    # Refuse to open when a file the MANIFEST names is missing or damaged (the default,
    # made explicit: a bank must never open as less than it is).
    opt.set_paranoid_checks(True)
    if durability == "fast":
        opt.set_atomic_flush(True)
    # Every open starts a new info log (`LOG`) and keeps the last one as `LOG.old.*`:
    # RocksDB keeps 1000 of them by default, so a bank opened by each tool call and
    # each restart gathered hundreds of files. The newest few are enough to debug.
    opt.set_keep_log_file_num(INFO_LOGS_KEPT)
    return opt
