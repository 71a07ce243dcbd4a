"""What a reviewer found by racing restores against stores and eviction, pinned down
deterministically: restored arrays are usable on any thread; a restore's periodic
flush never cuts into a store; a late restore's last uses never outlive evicted
blocks; a damaged header is repaired without counting its block twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import (
    flat_arrays,
    hybrid_spec,
    prefix_layers,
    random_state,
)
from test_evict import counted, recount

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.evict.eviction import evict_to_budget

B = 4


def test_restored_arrays_evaluate_on_another_thread(bank_path: Path) -> None:
    spec = hybrid_spec()  # bf16 KV (a view) and float32 states
    tokens = list(range(3 * B))
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, layers, {2 * B: random_state(spec, 1)})
        with ThreadPoolExecutor(1) as pool:  # a runtime restoring on an executor thread
            hit = pool.submit(ns.restore, tokens).result()
        assert hit is not None and hit.tokens == 2 * B
        mx.eval([a for layer in hit.layers if layer is not None for a in flat_arrays(layer)])
        for i in spec.attention_layers:
            for got, stored in zip(hit.layers[i], layers[i], strict=True):
                assert mx.array_equal(got, stored[..., : 2 * B, :]).item()


def test_a_restores_flush_does_not_cut_into_a_store(bank_path: Path) -> None:
    spec = hybrid_spec()
    with Bank.open(bank_path, BankConfig(block_size=B, access_flush_interval=0)) as bank:
        ns = bank.namespace(spec)
        tokens = list(range(2 * B))
        ns.store(tokens, prefix_layers(spec, tokens))
        key = ns.chain(tokens)[0]
        held, release = threading.Event(), threading.Event()

        def store_in_flight() -> None:
            with bank.write_lock:  # a store between recording its uses and writing them
                bank.access.touch([key])
                held.set()
                release.wait(10)

        t = threading.Thread(target=store_in_flight)
        t.start()
        held.wait(10)
        bank.flush(wait=False)  # what a restore does when its interval is due
        assert bank.access.pending(key) is not None  # left for the store's own batch
        release.set()
        t.join()
        bank.flush()
        assert bank.access.pending(key) is None


def test_uses_recorded_after_an_eviction_are_not_written(bank_path: Path) -> None:
    spec = hybrid_spec()
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        tokens = list(range(3 * B))
        ns.store(tokens, prefix_layers(spec, tokens))
        chain = ns.chain(tokens)
        evict_to_budget(bank, 0)
        bank.access.touch(chain)  # a restore that read the chain just before it went
        bank.flush()
        assert list(bank.store.keys(Family.ACCESS)) == []
        assert list(bank.store.keys(Family.HEADERS)) == []


def test_a_damaged_header_is_repaired_without_counting_its_block_twice(bank_path: Path) -> None:
    spec = hybrid_spec()
    tokens = list(range(3 * B))
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, prefix_layers(spec, tokens))
        key = ns.chain(tokens)[1]
    with RocksStore(bank_path) as raw:  # an unknown header version: unreadable, present
        value = bytearray(raw.get(Family.HEADERS, key) or b"")
        value[0] = 9
        raw.put_batch([(Family.HEADERS, key, bytes(value))])
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        report = ns.store(tokens, prefix_layers(spec, tokens))
        assert report.blocks_written == 1  # the damaged block, rewritten
        assert counted(bank) == recount(bank)


class RefusingWrites(BlockStore):
    """Our own store wrapper whose writes fail (a full disk, say); reads pass through."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner

    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.inner.get_many(family, keys)

    def put_batch(self, writes: Sequence[Write]) -> None:
        raise OSError("No space left on device")

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.iterate(family, values=values)

    def close(self) -> None:
        self.inner.close()


def test_last_uses_survive_a_failed_write(bank_path: Path) -> None:
    spec = hybrid_spec()
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        tokens = list(range(2 * B))
        key = ns.store(tokens, prefix_layers(spec, tokens)).chain[0]
        bank.access.touch([key])
        inner, bank.store = bank.store, RefusingWrites(bank.store)
        with pytest.raises(OSError):
            bank.flush()
        assert bank.access.pending(key) is not None  # kept for the next batch
        bank.store = inner
        bank.flush()
        assert bank.access.pending(key) is None
        assert bank.store.get(Family.ACCESS, key) is not None
