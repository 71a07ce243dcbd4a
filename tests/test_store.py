"""Every store of the package, and the hot tier over each, through the conformance
suite (`cas_bank.testing`: the interface's behaviour, and a state machine of random
batches, reads, listings and reopens compared with a dict); then what only RocksDB
does (durability modes, its lock, read-only and secondary opens, disk size) and
opening stores by URL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cas_bank import Bank, BankConfig, BankLockedError, InvalidInputError
from cas_bank.blocks.backends import open_store, split_url, store_exists
from cas_bank.blocks.files import FileTier
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Capability, Family, MemoryStore, batch_phases
from cas_bank.testing import (
    BIG,
    PAYLOAD_A,
    PAYLOAD_B,
    StoreConformance,
    StoreFactory,
    store_machine,
)

MiB = 1 << 20


class TestMemoryStore(StoreConformance):
    def make(self, tmp_path: Path) -> BlockStore:
        return MemoryStore()


class TestHotStoreOverMemory(StoreConformance):
    def make(self, tmp_path: Path) -> BlockStore:
        return HotStore(MemoryStore(), MiB)


class TestHotStoreOverRocks(StoreConformance):
    """A bound of a few entries: reads and writes keep pushing entries out."""

    def make(self, tmp_path: Path) -> BlockStore:
        return HotStore(RocksStore(tmp_path / "db"), 16 * 1024)

    def reopen(self, tmp_path: Path) -> BlockStore | None:
        return HotStore(RocksStore(tmp_path / "db"), 16 * 1024)


class TestFileTierOverRocks(StoreConformance):
    """Payloads of 4 KiB and more as files beside the database (the default bank's stack)."""

    def make(self, tmp_path: Path) -> BlockStore:
        return FileTier(RocksStore(tmp_path / "db"), tmp_path / "payloads", min_bytes=4096)

    def reopen(self, tmp_path: Path) -> BlockStore | None:
        return FileTier(RocksStore(tmp_path / "db"), tmp_path / "payloads", min_bytes=4096)

    def test_codec_payloads_are_files(self, tmp_path: Path) -> None:
        """The suite's codec payloads take the file path: written, replaced, unlinked."""
        files = lambda: sorted(p.name for p in (tmp_path / "payloads").rglob("*.*"))  # noqa: E731
        with self.make(tmp_path) as tier:
            assert isinstance(tier, FileTier)
            tier.put_batch([(Family.BLOCKS, b"k", PAYLOAD_A), (Family.STATES, b"k", PAYLOAD_B)])
            assert tier.files_written == 2 and len(files()) == 2
            tier.put_batch([(Family.BLOCKS, b"k", PAYLOAD_B)])  # the old file goes
            assert len(files()) == 2 and tier.get(Family.BLOCKS, b"k") == PAYLOAD_B
            tier.put_batch([(Family.BLOCKS, b"k", None), (Family.STATES, b"k", None)])
            assert files() == []


class TestRocksStore(StoreConformance):
    def make(self, tmp_path: Path) -> BlockStore:
        return RocksStore(tmp_path / "db")

    def reopen(self, tmp_path: Path) -> BlockStore | None:
        return RocksStore(tmp_path / "db")

    def test_data_survives_close_and_reopen_in_one_process(self, tmp_path: Path) -> None:
        for round_ in range(3):
            with RocksStore(tmp_path / "db") as s:
                s.put_batch([(Family.BLOCKS, b"r%d" % round_, BIG)])
                assert len(list(s.keys(Family.BLOCKS))) == round_ + 1
        with RocksStore(tmp_path / "db") as s:
            assert s.get(Family.BLOCKS, b"r0") == BIG

    def test_fast_durability_keeps_data_after_close(self, tmp_path: Path) -> None:
        with RocksStore(tmp_path / "db", durability="fast") as s:
            s.put_batch([(Family.BLOCKS, b"k", BIG), (Family.HEADERS, b"k", b"h")])
        with RocksStore(tmp_path / "db") as s:
            assert s.get(Family.BLOCKS, b"k") == BIG
            assert s.get(Family.HEADERS, b"k") == b"h"

    def test_second_writer_in_this_process_is_refused_naming_the_path(self, tmp_path: Path) -> None:
        with RocksStore(tmp_path / "db"):
            with pytest.raises(BankLockedError) as err:
                RocksStore(tmp_path / "db")
            assert f"bank at {tmp_path / 'db'} is already open for writing in this process" in str(
                err.value
            )

    def test_an_unfinished_listing_does_not_keep_the_lock(self, tmp_path: Path) -> None:
        s = RocksStore(tmp_path / "db")
        s.put_batch([(Family.HEADERS, b"%04d" % i, b"h") for i in range(1000)])
        walk = s.iterate(Family.HEADERS)
        assert next(walk) == (b"0000", b"h")
        s.close()
        with RocksStore(tmp_path / "db") as again:
            assert len(list(again.keys(Family.HEADERS))) == 1000
        with pytest.raises(RuntimeError, match="closed"):  # not a quiet early end
            list(walk)

    def test_read_only_is_frozen_and_refuses_writes(self, tmp_path: Path) -> None:
        with RocksStore(tmp_path / "db") as w:
            w.put_batch([(Family.HEADERS, b"a", b"1")])
            w.flush()
            with RocksStore(tmp_path / "db", mode="read_only") as r:
                assert r.read_only
                w.put_batch([(Family.HEADERS, b"b", b"2")])
                assert r.get_many(Family.HEADERS, [b"a", b"b"]) == [b"1", None]
                with pytest.raises(RuntimeError, match="read_only"):
                    r.put_batch([(Family.HEADERS, b"c", b"3")])

    def test_secondary_follows_the_writer(self, tmp_path: Path) -> None:
        with RocksStore(tmp_path / "db") as w:
            w.put_batch([(Family.HEADERS, b"a", b"1")])
            with RocksStore(tmp_path / "db", mode="secondary") as r:
                assert r.get(Family.HEADERS, b"a") == b"1"
                w.put_batch([(Family.HEADERS, b"b", b"2"), (Family.BLOCKS, b"b", BIG)])
                r.refresh()
                assert r.get(Family.HEADERS, b"b") == b"2"
                assert r.get(Family.BLOCKS, b"b") == BIG

    def test_readers_need_an_existing_bank(self, tmp_path: Path) -> None:
        for mode in ("read_only", "secondary"):
            with pytest.raises(FileNotFoundError, match="no bank at"):
                RocksStore(tmp_path / "missing", mode=mode)  # type: ignore[arg-type]
        assert not (tmp_path / "missing").exists()

    def test_disk_bytes_grows_with_payloads(self, tmp_path: Path) -> None:
        with RocksStore(tmp_path / "db") as s:
            before = s.disk_bytes() or 0
            s.put_batch([(Family.BLOCKS, b"%d" % i, BIG) for i in range(10)])
            s.flush()
            assert (s.disk_bytes() or 0) >= before + 10 * len(BIG)


# -- opening by URL, capabilities, the phases of a non-atomic batch ------------------
def test_urls_and_paths_open_rocksdb(tmp_path: Path) -> None:
    assert split_url(tmp_path / "a") == ("rocksdb", str(tmp_path / "a"))
    assert split_url(f"rocksdb://{tmp_path}/a") == ("rocksdb", f"{tmp_path}/a")
    assert not store_exists(f"rocksdb://{tmp_path}/a")
    with open_store(f"rocksdb://{tmp_path}/a") as s:
        assert isinstance(s, RocksStore) and s.location == f"{tmp_path}/a"
        s.put_batch([(Family.META, b"k", b"v")])
    assert store_exists(tmp_path / "a")
    with open_store(tmp_path / "a", mode="read_only") as r:
        assert r.read_only and r.get(Family.META, b"k") == b"v"


def test_a_bad_url_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"no store backend for nosuch:// .*rocksdb://"):
        open_store("nosuch://x")
    with pytest.raises(InvalidInputError, match="names no location"):
        open_store("rocksdb://")
    assert not (tmp_path / "x").exists()


def test_bank_open_takes_a_url_or_a_store(tmp_path: Path) -> None:
    with Bank.open(f"rocksdb://{tmp_path}/bank", BankConfig(block_size=8)) as bank:
        assert bank.path == tmp_path / "bank" and bank.config.block_size == 8
    with Bank.open(tmp_path / "bank", mode="read_only") as bank:
        assert bank.config.block_size == 8  # the same bank, by path
    store = MemoryStore()
    with Bank.open(store, BankConfig(block_size=4, hot_bytes=0)) as bank:
        assert bank.store is store and str(bank.path) == "memory"
        assert bank.stats().block_size == 4
    with pytest.raises(RuntimeError, match="closed"):
        store.get(Family.META, b"x")  # the bank owned it and closed it


def test_capabilities_are_declared_not_guessed(tmp_path: Path) -> None:
    with RocksStore(tmp_path / "db") as rocks:
        assert rocks.capabilities == frozenset(Capability)
        hot = HotStore(rocks, MiB)
        assert hot.capabilities == rocks.capabilities and hot.location == rocks.location
    assert MemoryStore().capabilities == {Capability.ATOMIC_BATCHES}
    assert HotStore(MemoryStore(), MiB).disk_bytes() is None


def test_batch_phases_put_what_a_header_names_first_and_delete_it_last() -> None:
    batch = [
        (Family.HEADERS, b"gone", None),
        (Family.BLOCKS, b"gone", None),
        (Family.ACCESS, b"new", b"t"),
        (Family.META, b"counter", b"1"),
        (Family.HEADERS, b"new", b"h"),
        (Family.BLOCKS, b"new", b"p"),
        (Family.STATES, b"new", b"s"),
        (Family.NAMESPACES, b"root", b"spec"),
        (Family.STATES, b"old", None),
        (Family.HEADERS, b"old", b"h without state"),
    ]
    assert batch_phases(batch) == [
        [
            (Family.BLOCKS, b"new", b"p"),
            (Family.STATES, b"new", b"s"),
            (Family.NAMESPACES, b"root", b"spec"),
        ],
        [
            (Family.HEADERS, b"gone", None),
            (Family.HEADERS, b"new", b"h"),
            (Family.HEADERS, b"old", b"h without state"),
        ],
        [(Family.BLOCKS, b"gone", None), (Family.STATES, b"old", None)],
        [(Family.ACCESS, b"new", b"t"), (Family.META, b"counter", b"1")],
    ]
    assert batch_phases([]) == []


# -- the state machine ------------------------------------------------------------
class RocksFactory(StoreFactory):
    def make(self, directory: Path) -> BlockStore:
        return RocksStore(directory)

    def reopen(self, directory: Path) -> BlockStore | None:
        return RocksStore(directory)


class HotOverRocksFactory(RocksFactory):
    """A hot tier small enough that the machine's values churn through it."""

    def make(self, directory: Path) -> BlockStore:
        return HotStore(RocksStore(directory), 64 * 1024)

    def reopen(self, directory: Path) -> BlockStore | None:
        return HotStore(RocksStore(directory), 64 * 1024)


class FileTierOverRocksFactory(RocksFactory):
    """The default bank's stack: codec payloads of 64 KiB and more become files."""

    def make(self, directory: Path) -> BlockStore:
        return FileTier(RocksStore(directory / "db"), directory / "payloads")

    def reopen(self, directory: Path) -> BlockStore | None:
        return self.make(directory)


class MemoryFactory(StoreFactory):
    def make(self, directory: Path) -> BlockStore:
        return MemoryStore()


TestRocksAgainstDict = store_machine(RocksFactory(), max_examples=15)
TestHotOverRocksAgainstDict = store_machine(HotOverRocksFactory(), max_examples=15)
TestMemoryAgainstDict = store_machine(MemoryFactory(), max_examples=15)
TestFileTierOverRocksAgainstDict = store_machine(FileTierOverRocksFactory(), max_examples=15)
