"""Read-ahead: the background reader alone, and restores of blocks large enough that
`Namespace.restore` reads them ahead (bit-identical results, corruption still a
counted miss, the reader stopped when a restore stops early); and hot restores large
enough that the assembler copies them on two threads.

Real RocksDB under tmp_path and real MLX arrays; blocks of 256 KiB (the smallest that
read ahead), four of them. Blocks too small to read ahead are read in one multi-get.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import kv_prefix_bits, layers_bits, prefix_layers, tokens_of
from test_bank_corruption import _corrupt

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks.store import Family
from cas_bank.index.chain import read_headers
from cas_bank.restore.assemble import _TWO_THREADS_FROM
from cas_bank.restore.payloads import worth_reading_ahead
from cas_bank.restore.workers import ReadAhead

BIG = 64  # tokens per block: 2 arrays x 64 tokens x 8 heads x 128 x fp16 = 256 KiB


def big_spec() -> ModelSpec:
    layer = LayerSpec.attention(kv_heads=8, head_dim=128, dtype="float16")
    return ModelSpec(name="readahead", layers=(layer,), weights_digest="w-readahead")


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cas_bank-readahead"]


# -- the reader alone -------------------------------------------------------------
def test_results_come_in_order() -> None:
    with ReadAhead(lambda x: x * x, list(range(50)), depth=2) as ahead:
        assert list(ahead) == [x * x for x in range(50)]
    assert not _readers()


def test_an_exception_is_raised_at_its_item_and_nothing_after_is_read() -> None:
    called: list[int] = []

    def fn(x: int) -> int:
        called.append(x)
        if x == 3:
            raise KeyError("three")
        return x

    got: list[int] = []
    with ReadAhead(fn, list(range(10))) as ahead, pytest.raises(KeyError, match="three"):
        for v in ahead:
            got.append(v)
    assert got == [0, 1, 2]
    assert called == [0, 1, 2, 3]


def test_closing_early_stops_the_reader() -> None:
    called: list[int] = []
    ahead = ReadAhead(lambda x: called.append(x) or x, list(range(1000)), depth=1)
    it = iter(ahead)
    assert next(it) == 0
    ahead.close()
    assert not _readers()
    assert len(called) <= 3  # the one consumed, one queued, one in hand


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        ReadAhead(lambda x: x, [1], depth=0)


# -- restores that read ahead -----------------------------------------------------
def _stored(bank_path: Path) -> tuple[ModelSpec, list[int], list[object], list[bytes]]:
    spec = big_spec()
    tokens = tokens_of(np.random.default_rng(40), 4 * BIG)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=BIG, file_min_bytes=None)) as bank:
        chain = bank.namespace(spec).store(tokens, layers).chain
        headers = read_headers(bank.store, chain)
        sizes = [h.payload_size for h in headers if h is not None]
        assert len(sizes) == 4 and worth_reading_ahead(sizes[1:])
    return spec, tokens, layers, chain


@pytest.mark.parametrize("hot_bytes", [0, 64 << 20])
def test_read_ahead_restore_is_bit_identical(bank_path: Path, hot_bytes: int) -> None:
    spec, tokens, layers, _ = _stored(bank_path)
    with Bank.open(bank_path, BankConfig(hot_bytes=hot_bytes)) as bank:
        ns = bank.namespace(spec)
        for _ in range(2):  # from RocksDB, then (with a hot tier) from memory
            hit = ns.restore(tokens)
            assert hit is not None and hit.tokens == 4 * BIG
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 4 * BIG)
        s = bank.stats()
        assert s.corrupt_reads == 0
        assert s.hot_hits == (4 if hot_bytes else 0)
    assert not _readers()


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_read_ahead_stops_at_a_corrupt_block(bank_path: Path, how: str) -> None:
    spec, tokens, layers, chain = _stored(bank_path)
    _corrupt(bank_path, Family.BLOCKS, chain[2], how)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 2 * BIG
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 2 * BIG)
        assert bank.stats().corrupt_reads == 1
        assert chain[2] in bank.suspects.blocks() and not bank.suspects.states()
    assert not _readers()


def test_a_large_hot_restore_copied_on_two_threads_is_bit_identical(bank_path: Path) -> None:
    spec = big_spec()
    n_blocks = _TWO_THREADS_FROM // (256 * 1024)  # just enough bytes for the second thread
    tokens = tokens_of(np.random.default_rng(41), n_blocks * BIG + 5)
    layers = prefix_layers(spec, tokens)
    config = BankConfig(block_size=BIG, hot_bytes=64 << 20, file_min_bytes=None)
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, layers)  # written through: every block is hot
        assert bank.leases is not None
        bank.leases.clear()  # the per-block hot tier, not the lease of the store
        first = ns.restore(tokens)
        bank.leases.clear()
        second = ns.restore(tokens)  # decoded views this time: no check, no read
        assert first is not None and second is not None
        want = kv_prefix_bits(layers, spec, n_blocks * BIG)
        assert layers_bits(first.layers, spec) == want == layers_bits(second.layers, spec)
        assert bank.stats().hot_hits == 2 * n_blocks
        # Fresh arrays each time: nothing shared between two restores.
        k1, k2 = first.layers[0][0], second.layers[0][0]  # type: ignore[index]
        k1[..., :1, :] = 0
        assert layers_bits(second.layers, spec) == want
        assert k2 is not k1


# -- small payloads: one multi-get -------------------------------------------------
SMALL = 16  # tokens per block: 2 arrays x 16 tokens x 2 heads x 32 x fp16 = 4 KiB


def _small_stored(bank_path: Path) -> tuple[ModelSpec, np.ndarray, list, list]:
    layer = LayerSpec.attention(kv_heads=2, head_dim=32, dtype="float16")
    spec = ModelSpec(name="small", layers=(layer,), weights_digest="w-small")
    tokens = tokens_of(np.random.default_rng(41), 6 * SMALL)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=SMALL, file_min_bytes=None)) as bank:
        chain = bank.namespace(spec).store(tokens, layers).chain
    return spec, tokens, layers, chain


def _store_reads(bank: Bank, calls: list[int]) -> None:
    """Count the keys of each BLOCKS read the restore asks of the store below the hot
    tier (a spy on the real RocksDB store: its reads still happen)."""
    inner = bank.store.inner if hasattr(bank.store, "inner") else bank.store
    get_many = inner.get_many

    def counted(family: Family, keys: list[bytes]) -> list[bytes | None]:
        if family is Family.BLOCKS:
            calls.append(len(keys))
        return get_many(family, keys)

    inner.get_many = counted


@pytest.mark.parametrize("how", [None, "flip", "delete"])
def test_small_payloads_are_read_in_one_multi_get(bank_path: Path, how: str | None) -> None:
    spec, tokens, layers, chain = _small_stored(bank_path)
    if how is not None:
        _corrupt(bank_path, Family.BLOCKS, chain[3], how)
    calls: list[int] = []
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        _store_reads(bank, calls)
        hit = bank.namespace(spec).restore(tokens)
        good = 6 if how is None else 3
        assert hit is not None and hit.tokens == good * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, good * SMALL)
        assert bank.stats().corrupt_reads == (0 if how is None else 1)
    # Every block's payload in one read, not one read a block; a missing one is read
    # once more when the restore asks why (evicted and stored again since: a miss).
    assert calls == ([6, 1] if how == "delete" else [6])


def test_small_payloads_are_asked_64_at_a_time(bank_path: Path) -> None:
    layer = LayerSpec.attention(kv_heads=2, head_dim=32, dtype="float16")
    spec = ModelSpec(name="small", layers=(layer,), weights_digest="w-small")
    tokens = tokens_of(np.random.default_rng(42), 70 * SMALL)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=SMALL, file_min_bytes=None)) as bank:
        bank.namespace(spec).store(tokens, layers)
    calls: list[int] = []
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        _store_reads(bank, calls)
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 70 * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 70 * SMALL)
    assert calls == [64, 6]  # bounded bytes held at once
