"""Store conformance: one test class every backend subclasses, and a state machine.

`StoreConformance` holds the behaviour the `BlockStore` interface promises; each
backend gets a subclass that says how to make (and reopen) one. The hypothesis state
machine runs random batches, deletes, reads, listings and reopens against a real
RocksDB and a plain dict, and compares them after every step.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cas_bank import BankLockedError
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Family, MemoryStore

BIG = bytes(range(256)) * 400  # 100 KiB: above BlobDB's min blob size


class StoreConformance(ABC):
    """Behaviour every `BlockStore` backend must show. Subclasses define `make`."""

    persistent = False

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        s = self.make(tmp_path)
        try:
            yield s
        finally:
            s.close()

    @abstractmethod
    def make(self, tmp_path: Path) -> BlockStore:
        """A new, empty store of the backend under test, living under `tmp_path`."""

    def test_absent_keys_read_as_none(self, store: BlockStore) -> None:
        assert store.get_many(Family.HEADERS, [b"a", b"b"]) == [None, None]
        assert store.get(Family.BLOCKS, b"a") is None
        assert store.get_many(Family.HEADERS, []) == []

    def test_batch_then_read_in_key_order_given(self, store: BlockStore) -> None:
        store.put_batch([(Family.HEADERS, b"k1", b"v1"), (Family.HEADERS, b"k2", b"v2")])
        assert store.get_many(Family.HEADERS, [b"k2", b"nope", b"k1", b"k2"]) == [
            b"v2",
            None,
            b"v1",
            b"v2",
        ]
        assert isinstance(store.get(Family.HEADERS, b"k1"), bytes)

    def test_families_are_separate(self, store: BlockStore) -> None:
        store.put_batch([(f, b"same", f.value.encode()) for f in Family])
        for f in Family:
            assert store.get(f, b"same") == f.value.encode()
        store.put_batch([(Family.BLOCKS, b"same", None)])
        assert store.get(Family.BLOCKS, b"same") is None
        assert store.get(Family.HEADERS, b"same") == b"headers"

    def test_later_writes_in_a_batch_win(self, store: BlockStore) -> None:
        store.put_batch(
            [
                (Family.META, b"a", b"1"),
                (Family.META, b"a", b"2"),
                (Family.META, b"b", b"1"),
                (Family.META, b"b", None),
            ]
        )
        assert store.get_many(Family.META, [b"a", b"b"]) == [b"2", None]

    def test_delete_absent_and_empty_batch_are_fine(self, store: BlockStore) -> None:
        store.put_batch([(Family.HEADERS, b"never", None)])
        store.put_batch([])
        assert list(store.iterate(Family.HEADERS)) == []

    def test_empty_and_large_values(self, store: BlockStore) -> None:
        store.put_batch([(Family.META, b"empty", b""), (Family.BLOCKS, b"big", BIG)])
        assert store.get(Family.META, b"empty") == b""
        assert store.get(Family.BLOCKS, b"big") == BIG

    def test_iterate_in_key_order(self, store: BlockStore) -> None:
        keys = [bytes([b]) * 3 for b in (9, 1, 200, 0, 7)]
        store.put_batch([(Family.HEADERS, k, k + b"!") for k in keys])
        assert list(store.iterate(Family.HEADERS)) == [(k, k + b"!") for k in sorted(keys)]
        assert list(store.iterate(Family.HEADERS, values=False)) == [(k, b"") for k in sorted(keys)]
        assert list(store.keys(Family.HEADERS)) == sorted(keys)
        assert list(store.keys(Family.STATES)) == []

    def test_concurrent_batches_all_land(self, store: BlockStore) -> None:
        def writer(t: int) -> None:
            for i in range(50):
                store.put_batch(
                    [
                        (Family.HEADERS, b"%d-%d" % (t, i), b"h"),
                        (Family.BLOCKS, b"%d-%d" % (t, i), BIG[: 5000 + i]),
                    ]
                )

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(list(store.keys(Family.HEADERS))) == 200
        assert store.get(Family.BLOCKS, b"3-49") == BIG[:5049]

    def test_closed_store_refuses_work(self, tmp_path: Path) -> None:
        s = self.make(tmp_path)
        s.put_batch([(Family.META, b"a", b"1")])
        s.close()
        s.close()  # closing twice is harmless
        with pytest.raises(RuntimeError, match="closed"):
            s.get(Family.META, b"a")
        with pytest.raises(RuntimeError, match="closed"):
            s.get_many(Family.META, [b"a"])
        with pytest.raises(RuntimeError, match="closed"):
            s.put_batch([(Family.META, b"b", b"2")])
        with pytest.raises(RuntimeError, match="closed"):
            list(s.iterate(Family.META))

    def test_context_manager_closes(self, tmp_path: Path) -> None:
        with self.make(tmp_path) as s:
            s.put_batch([(Family.META, b"a", b"1")])
        with pytest.raises(RuntimeError, match="closed"):
            s.get(Family.META, b"a")


class TestMemoryStore(StoreConformance):
    def make(self, tmp_path: Path) -> BlockStore:
        return MemoryStore()


class TestRocksStore(StoreConformance):
    persistent = True

    def make(self, tmp_path: Path) -> BlockStore:
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
        s.put_batch([(Family.HEADERS, b"%d" % i, b"h") for i in range(5)])
        walk = s.iterate(Family.HEADERS)
        assert next(walk) == (b"0", b"h")
        s.close()
        with RocksStore(tmp_path / "db") as again:
            assert len(list(again.keys(Family.HEADERS))) == 5
        assert list(walk) == []  # the old walk ended with its store

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


# -- the state machine ------------------------------------------------------------
FAMILIES = st.sampled_from([Family.HEADERS, Family.BLOCKS])
KEYS = st.binary(min_size=0, max_size=3)
VALUES = st.one_of(st.binary(max_size=40), st.sampled_from([BIG, BIG[:4096], BIG[:4095]]))


class RocksAgainstDict(RuleBasedStateMachine):
    """RocksStore and a dict must agree after any sequence of operations."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cas_bank_sm_")
        self.store = RocksStore(self.dir)
        self.model: dict[Family, dict[bytes, bytes]] = {Family.HEADERS: {}, Family.BLOCKS: {}}

    @rule(
        writes=st.lists(
            st.tuples(FAMILIES, KEYS, st.one_of(st.none(), VALUES)), min_size=0, max_size=8
        )
    )
    def put_batch(self, writes: list[tuple[Family, bytes, bytes | None]]) -> None:
        self.store.put_batch(writes)
        for f, k, v in writes:
            if v is None:
                self.model[f].pop(k, None)
            else:
                self.model[f][k] = v

    @rule(family=FAMILIES, keys=st.lists(KEYS, max_size=4))
    def delete(self, family: Family, keys: list[bytes]) -> None:
        self.store.put_batch([(family, k, None) for k in keys])
        for k in keys:
            self.model[family].pop(k, None)

    @rule(family=FAMILIES, keys=st.lists(KEYS, max_size=6))
    def get_many(self, family: Family, keys: list[bytes]) -> None:
        assert self.store.get_many(family, keys) == [self.model[family].get(k) for k in keys]

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data(), family=FAMILIES)
    def get_stored(self, data: st.DataObject, family: Family) -> None:
        if self.model[family]:
            k = data.draw(st.sampled_from(sorted(self.model[family])))
            assert self.store.get(family, k) == self.model[family][k]

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = RocksStore(self.dir)

    @invariant()
    def listings_agree(self) -> None:
        for f, d in self.model.items():
            assert list(self.store.iterate(f)) == sorted(d.items())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


RocksAgainstDict.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# The 100 KiB values make hypothesis's step log long; that is expected here.
TestRocksAgainstDict = pytest.mark.filterwarnings("ignore:Generating overly large repr")(
    RocksAgainstDict.TestCase
)
