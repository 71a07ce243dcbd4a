"""The copy-run tables of small RocksDB payloads (`restore.row_runs.RunTables`) are one
bank's, kept within a byte bound (`BankConfig.run_table_bytes`): a layout of many runs
a block made 13.5 MiB at 4096 blocks, and sixteen kept by count held 27 MiB that no
budget counted. Two banks do not share them, `stats()` shows them, `close()` frees
them, and restores through them stay bit-exact.

Real RocksDB under tmp_path and real MLX arrays (the tiny layout of
test_small_payload_copy.py: 4 KiB blocks, all kept in RocksDB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import kv_prefix_bits, layers_bits, prefix_layers, tokens_of

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.restore import row_runs
from cas_bank.restore.row_runs import RunTables

SMALL = 16  # tokens per block: 2 arrays x 16 tokens x 2 heads x 32 x fp16 = 4 KiB
native = pytest.mark.skipif(not row_runs.available(), reason="no native copy (pure Python)")


def _template(runs: int) -> bytes:
    seg = np.zeros((runs, 3), dtype=np.int64)
    seg[:, 0] = np.arange(runs) * 512  # where each run starts in its view
    seg[:, 1] = 64  # its length
    seg[:, 2] = 64  # how far a block moves it
    return seg.tobytes()


def test_tables_are_kept_within_their_byte_bound_and_answer_the_same() -> None:
    tables = RunTables(8 << 20)
    template = _template(144)
    for blocks in (64, 128, 256, 512, 1024, 2048, 4096):
        made_of = (template, 40, blocks)
        got = tables.get(("blocks", *made_of), lambda: row_runs._make_block_runs(*made_of))  # noqa: B023
        assert np.array_equal(got, row_runs._make_block_runs(template, 40, blocks))
        assert 0 < tables.bytes <= tables.max_bytes
    big = 4096 * 144 * 3 * 8
    assert big > tables.max_bytes  # made for its restore, never kept
    small = ("blocks", template, 40, 64)
    again = tables.get(small, lambda: row_runs._make_block_runs(template, 40, 64))
    assert again is tables.get(small, lambda: row_runs._make_block_runs(template, 40, 64))
    tables.clear()
    assert tables.bytes == 0 and len(tables) == 0
    with pytest.raises(ValueError, match="run table bound"):
        RunTables(-1)


def _spec() -> ModelSpec:
    layer = LayerSpec.attention(kv_heads=2, head_dim=32, dtype="float16")
    return ModelSpec(name="run-tables", layers=(layer,), weights_digest="w-run-tables")


def _store(bank_path: Path, n_blocks: int) -> tuple[ModelSpec, list[int], list[object]]:
    spec = _spec()
    tokens = tokens_of(np.random.default_rng(44), n_blocks * SMALL)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=SMALL, file_min_bytes=None)) as bank:
        bank.namespace(spec).store(tokens, layers)
    return spec, tokens, layers


@native
def test_each_bank_keeps_its_own_tables_shown_by_stats_and_freed_by_close(
    tmp_path: Path,
) -> None:
    """A reopened restore of small payloads (no hot tier: read from RocksDB and copied
    by the native call) fills its bank's tables, not the other bank's; stats() shows
    them within their bound; close() releases them; the restore is bit-exact."""
    spec, tokens, layers = _store(tmp_path / "a", 6)
    _store(tmp_path / "b", 6)
    config = BankConfig(block_size=SMALL, file_min_bytes=None, hot_bytes=0)
    with Bank.open(tmp_path / "a", config) as first, Bank.open(tmp_path / "b", config) as other:
        assert first.stats().run_table_held_bytes == 0
        hit = first.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == len(tokens)
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(tokens))
        held = first.stats()
        assert 0 < held.run_table_held_bytes <= held.run_table_bytes == 8 << 20
        assert held.run_table_held_bytes == first.resources.run_tables.bytes
        assert other.stats().run_table_held_bytes == 0 and len(other.resources.run_tables) == 0
        again = first.namespace(spec).restore(tokens)  # the tables found, the same rows
        assert again is not None
        assert layers_bits(again.layers, spec) == kv_prefix_bits(layers, spec, len(tokens))
        assert first.stats().run_table_held_bytes == held.run_table_held_bytes
        tables = first.resources.run_tables
    assert tables.bytes == 0 and len(tables) == 0  # released by close


@native
def test_run_table_bytes_zero_keeps_none_and_restores_the_same(bank_path: Path) -> None:
    spec, tokens, layers = _store(bank_path, 5)
    config = BankConfig(block_size=SMALL, file_min_bytes=None, hot_bytes=0, run_table_bytes=0)
    with Bank.open(bank_path, config) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == len(tokens)
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(tokens))
        assert bank.stats().run_table_held_bytes == 0
