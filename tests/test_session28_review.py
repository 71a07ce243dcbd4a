"""Session 28 review: findings in the session's diff pinned as tests (xfail, strict,
where the code is wrong today). Real RocksDB, files and MLX arrays under tmp_path."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
from conftest import BLOCK_SIZE, attention_spec, prefix_layers, random_layers, tokens_of

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks.store import Family

B = BLOCK_SIZE
# Block payloads of ~16 KiB: files at a 1 KiB file_min_bytes.
WIDE = ModelSpec(
    name="wide-attn",
    layers=tuple(LayerSpec.attention(kv_heads=8, head_dim=64, dtype="float16") for _ in range(2)),
    weights_digest="w-wide-attn",
)
SMALL_FILES = BankConfig(block_size=B, file_min_bytes=1024, hot_bytes=64 << 20)


def test_a_block_payload_written_as_a_file_is_served_hot(bank_path: Path) -> None:
    """Before b0f092c the write cached the payload whole; a read of it was a hot hit."""
    with Bank.open(bank_path, SMALL_FILES) as bank:
        tokens = tokens_of(np.random.default_rng(1), 4 * B)
        bank.namespace(WIDE).store(tokens, random_layers(WIDE, 4 * B))
        hot, files = bank.hot, bank.files
        assert hot is not None and files is not None
        keys = [k for k, _ in files.inner.iterate(Family.BLOCKS)]
        assert len(keys) == 4
        assert all(len(v) >= 1024 for v in files.get_many(Family.BLOCKS, keys) if v)
        hot.get_many(Family.BLOCKS, keys)  # a first read may fill the tier
        hits = hot.hits
        assert hot.get_many(Family.BLOCKS, keys) == files.get_many(Family.BLOCKS, keys)
        assert hot.hits - hits == len(keys)


def test_a_live_lease_does_not_pin_the_buffer_its_logits_were_sliced_from(
    bank_path: Path,
) -> None:
    """Before e619164 the live lease held no logits: the chunk's buffer went with the
    caller's last reference to it."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(2), 3 * B + 2)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=64 << 20)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        gc.collect()
        before = mx.get_active_memory()
        chunk = mx.random.normal((1, 256, 50_000))  # a chunk's logits: 51 MB of float32
        last = chunk[0, -1]
        mx.eval(last)
        del chunk
        assert ns.store_end(tokens, layers, logits=last) > 0
        del last
        gc.collect()
        assert bank.stats().live_bytes > 0  # the lease that would pin it is there
        assert mx.get_active_memory() - before < 8 << 20


def test_verify_reports_a_damaged_ends_table_instead_of_raising(tmp_path: Path) -> None:
    """Before c866696 verify reported it (a bad_end without a key) and went on."""
    from damage_kit import family_tables, flip

    from cas_bank.maintenance.verify import verify

    spec, path = attention_spec(), tmp_path / "bank"
    rng = np.random.default_rng(3)
    with Bank.open(path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        for _ in range(200):  # end records over more than one table block
            tokens = tokens_of(rng, 3 * B + 2)
            layers = prefix_layers(spec, tokens)
            ns.store(tokens, layers)
            ns.store_end(tokens, layers)
        assert bank.files is not None
    flip(path / family_tables(path)["ends"][0], 100, 16, seed=1)  # its first data block
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as bank:
        report = verify(bank)
    assert any(p.kind == "bad_end" and p.chain_hash == b"" for p in report.problems)
