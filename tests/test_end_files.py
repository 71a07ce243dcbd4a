"""Large end records as files (format 5, `blocks.files`): a hybrid model's end record
holds its recurrent state (4.9 MB for medium-hybrid at 1k tokens), and rocksdict holds
the GIL while it writes, so such a record written through RocksDB stalled every Python
thread 13-20 ms. In a bank of format 5 a record of `file_min_bytes` or more is a file
named by its key and payload digest, with a stub in the `ends` family; everything that
reads records (restores, verify, eviction, bundles, sweep) sees the record itself."""

from __future__ import annotations

import struct
import tarfile
from pathlib import Path

import numpy as np
from conftest import (
    BLOCK_SIZE,
    TESTS_DIR,
    attention_spec,
    bits,
    hybrid_spec,
    prefix_layers,
    random_logits,
    state_bits,
    stored_hybrid_end,
    tokens_of,
)

from cas_bank import Bank, BankConfig
from cas_bank.blocks.files import stub_of
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.maintenance.bundle import chain_for_tokens, export_chain, import_bundle
from cas_bank.maintenance.verify import verify

B = BLOCK_SIZE
HYBRID = hybrid_spec()
SMALL_FILES = 1024  # every end record of these tests is a file


def _end_files(path: Path) -> list[Path]:
    folder = path / "payloads" / "ends"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _raw_ends(path: Path) -> list[bytes]:
    with RocksStore(path, mode="read_only") as raw:
        return [v for _, v in raw.iterate(Family.ENDS)]


def test_a_large_end_record_is_a_file_and_restores_exactly(bank_path: Path) -> None:
    config = BankConfig(block_size=B, file_min_bytes=SMALL_FILES, hot_bytes=0)
    with Bank.open(bank_path, config) as bank:
        tokens, _, state = stored_hybrid_end(bank, 2 * B + 3, logits=random_logits(1))
    (stub,) = _raw_ends(bank_path)
    assert stub_of(stub) is not None and len(_end_files(bank_path)) == 1
    with Bank.open(bank_path, config) as bank:
        hit = bank.namespace(HYBRID).restore(tokens)
        assert hit is not None and hit.exact and hit.tokens == len(tokens)
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert bits(hit.logits) == bits(random_logits(1))  # type: ignore[arg-type]
        assert verify(bank).ok
        stats = bank.stats()
        assert stats.ends == 1 and stats.end_bytes > SMALL_FILES
        # Rewritten with more (a hidden state): one file, the new one.
        ns = bank.namespace(HYBRID)
        layers = prefix_layers(HYBRID, tokens)
        assert (
            ns.store_end(tokens, layers, state, logits=random_logits(1), hidden=random_logits(2))
            > 0
        )
        assert len(_end_files(bank_path)) == 1
        hit = ns.restore(tokens)
        assert hit is not None and bits(hit.hidden) == bits(random_logits(2))  # type: ignore[arg-type]
        evict_to_budget(bank, 0)
        assert bank.stats().ends == 0
    assert _end_files(bank_path) == [] and _raw_ends(bank_path) == []


def test_a_damaged_or_orphaned_end_file_is_found_and_swept(bank_path: Path) -> None:
    config = BankConfig(block_size=B, file_min_bytes=SMALL_FILES, hot_bytes=0)
    with Bank.open(bank_path, config) as bank:
        tokens, _, _ = stored_hybrid_end(bank, 2 * B + 5, logits=random_logits(3))
        (file,) = _end_files(bank_path)
        orphan = file.with_name("00" * 64 + ".0011223344556677")
        orphan.write_bytes(b"left by a crash")
        assert verify(bank, fix=True).removed_orphans == 1
        assert _end_files(bank_path) == [file]
        data = bytearray(file.read_bytes())
        data[-3] ^= 0x10
        file.write_bytes(bytes(data))
        hit = bank.namespace(HYBRID).restore(tokens)
        assert hit is None or not hit.end  # a counted miss, never the damaged state
        assert bank.stats().corrupt_reads == 1
        assert [p.kind for p in verify(bank).problems] == ["corrupt_end"]
        assert verify(bank, fix=True).fixed
        assert verify(bank).ok and _end_files(bank_path) == []


def test_end_files_travel_in_bundles(tmp_path: Path) -> None:
    config = BankConfig(block_size=B, file_min_bytes=SMALL_FILES)
    with Bank.open(tmp_path / "a", config) as bank:
        tokens, _, state = stored_hybrid_end(bank, 3 * B + 1, logits=random_logits(4))
        ns = bank.namespace(HYBRID)
        export_chain(bank, chain_for_tokens(bank, ns.root, tokens), tmp_path / "x.casb")
    with Bank.open(tmp_path / "b", config) as bank:
        import_bundle(bank, tmp_path / "x.casb")
        hit = bank.namespace(HYBRID).restore(tokens)
        assert hit is not None and hit.exact
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
    assert len(_end_files(tmp_path / "b")) == 1


def test_an_older_bank_keeps_its_end_records_in_the_database(tmp_path: Path) -> None:
    """A format-3 bank (blake3, written by the version-3 code) stays 3: its new end
    records are not files, which that code could not read."""
    with tarfile.open(TESTS_DIR / "fixtures" / "bank_v3_blake3.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / "bank"
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(11), 2 * B + 3)
    with Bank.open(path, BankConfig(file_min_bytes=64)) as bank:
        assert bank.payload_check == "blake3"
        ns = bank.namespace(spec)
        ns.store(tokens, prefix_layers(spec, tokens))
        assert ns.store_end(tokens, prefix_layers(spec, tokens), logits=random_logits(5)) > 64
    assert all(stub_of(v) is None for v in _raw_ends(path))
    assert _end_files(path) == []
    with RocksStore(path, mode="read_only") as raw:
        assert raw.get(Family.META, b"format_version") == struct.pack("<I", 3)
