"""The store conformance suite: what every `BlockStore` backend, and every wrapper of
one, must do. A backend outside this repository runs it too:

    from cas_bank.testing import StoreConformance, store_machine

    class TestMyStore(StoreConformance):
        def make(self, tmp_path):
            return MyStore(...)            # new and empty, living under tmp_path

    TestMyStoreAgainstDict = store_machine(MyStoreFactory())   # random operations

`StoreConformance` holds the behaviour of the interface (`cas_bank.blocks.store`):
reads, batches, families, key order, concurrency, closing, and each capability the
store declares. `store_machine` runs random batches, reads, listings (and reopens,
for a persistent store) against a plain dict and compares them after every step.

Needs pytest and hypothesis (the `dev` extra of cas_bank).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cas_bank.arrays import dtype_named
from cas_bank.blocks import codec
from cas_bank.blocks.store import BlockStore, Capability, Family

BIG = bytes(range(256)) * 400  # 100 KiB: above RocksDB's min blob size


def codec_payload(seed: int, n: int = 20_000) -> bytes:
    """A real codec payload (`blocks.codec`) of `n` float32 values (80 KiB by default):
    the shape a bank writes, so a file tier (`blocks.files`, payloads of 64 KiB and
    more) keeps it as a file."""
    a = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return codec.encode([a], [dtype_named("float32")], "none")


PAYLOAD_A, PAYLOAD_B = codec_payload(1), codec_payload(2, 24_000)


class StoreConformance(ABC):
    """Behaviour every `BlockStore` must show. Subclasses define `make`; a persistent
    store also `reopen`."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        s = self.make(tmp_path)
        try:
            yield s
        finally:
            s.close()

    @abstractmethod
    def make(self, tmp_path: Path) -> BlockStore:
        """A new, empty, writable store of the backend under test, under `tmp_path`."""

    def reopen(self, tmp_path: Path) -> BlockStore | None:
        """The store `make(tmp_path)` made, opened again after it was closed; None
        (the default) for a store that keeps nothing after close."""
        return None

    def test_absent_keys_read_as_none(self, store: BlockStore) -> None:
        assert store.get_many(Family.HEADERS, [b"a", b"b"]) == [None, None]
        assert store.get(Family.BLOCKS, b"a") is None
        assert store.get_many(Family.HEADERS, []) == []

    def test_batch_then_read_in_key_order_given(self, store: BlockStore) -> None:
        store.put_batch([(Family.HEADERS, b"k1", b"v1"), (Family.HEADERS, b"k2", b"v2")])
        got = store.get_many(Family.HEADERS, [b"k2", b"nope", b"k1", b"k2"])
        assert got == [b"v2", None, b"v1", b"v2"]
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

    def test_codec_payloads_written_overwritten_and_deleted(self, store: BlockStore) -> None:
        """Payloads as a bank writes them (a file tier keeps these as files)."""
        store.put_batch([(Family.BLOCKS, b"k", PAYLOAD_A), (Family.STATES, b"k", PAYLOAD_B)])
        assert store.get_many(Family.BLOCKS, [b"k"]) == [PAYLOAD_A]
        assert store.get(Family.STATES, b"k") == PAYLOAD_B
        store.put_batch([(Family.BLOCKS, b"k", PAYLOAD_B), (Family.BLOCKS, b"j", PAYLOAD_A)])
        assert list(store.iterate(Family.BLOCKS)) == [(b"j", PAYLOAD_A), (b"k", PAYLOAD_B)]
        store.put_batch([(Family.BLOCKS, b"k", b"small"), (Family.STATES, b"k", None)])
        assert store.get_many(Family.BLOCKS, [b"j", b"k"]) == [PAYLOAD_A, b"small"]
        assert store.get(Family.STATES, b"k") is None
        store.put_batch([(Family.BLOCKS, b"j", None), (Family.BLOCKS, b"k", None)])
        assert list(store.iterate(Family.BLOCKS)) == []
        assert list(store.iterate(Family.STATES)) == []

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        keys=st.sets(st.binary(min_size=0, max_size=4), max_size=12),
        suffix=st.binary(max_size=4),
        prefix=st.binary(max_size=2),
    )
    def test_prefixed_and_around(
        self, store: BlockStore, keys: set[bytes], suffix: bytes, prefix: bytes
    ) -> None:
        """`prefixed` lists the keys under a prefix in order; `around` the one before a
        key and the first at or after it, among them (the children index's seek)."""
        store.put_batch([(Family.CHILDREN, k, None) for k in store.keys(Family.CHILDREN)])
        store.put_batch([(Family.CHILDREN, k, k + b"!") for k in keys])
        probe = prefix + suffix
        under = sorted(k for k in keys if k.startswith(prefix))
        assert list(store.prefixed(Family.CHILDREN, prefix)) == [(k, k + b"!") for k in under]
        below = [k for k in under if k < probe][-1:]
        above = [k for k in under if k >= probe][:1]
        want = [(k, k + b"!") for k in below + above]
        assert store.around(Family.CHILDREN, probe, prefix) == want

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

    def test_an_atomic_store_shows_no_half_batch(self, store: BlockStore) -> None:
        """A reader never sees a header without the payload of its batch (any store),
        nor one family of a batch without the other (a store declaring atomic batches)."""
        atomic = Capability.ATOMIC_BATCHES in store.capabilities
        stop = threading.Event()
        # (batch of the header, batch of the payload), read in this order or the other
        header_first: list[tuple[int, int]] = []
        payload_first: list[tuple[int, int]] = []

        def writer() -> None:
            try:
                for i in range(1, 300):
                    store.put_batch(
                        [(Family.BLOCKS, b"k", b"%d" % i), (Family.HEADERS, b"k", b"%d" % i)]
                    )
            finally:
                stop.set()

        def batch(value: bytes | None) -> int:
            return int(value) if value is not None else 0

        thread = threading.Thread(target=writer)
        thread.start()
        while not stop.is_set():
            header = batch(store.get(Family.HEADERS, b"k"))
            header_first.append((header, batch(store.get(Family.BLOCKS, b"k"))))
            payload = batch(store.get(Family.BLOCKS, b"k"))
            payload_first.append((batch(store.get(Family.HEADERS, b"k")), payload))
        thread.join()
        # Any store: a header is never seen before the payload of its batch.
        assert all(payload >= header for header, payload in header_first)
        if atomic:  # nor a payload before the header of its batch
            assert all(header >= payload for header, payload in payload_first)

    def test_capabilities_are_declared_and_work(self, store: BlockStore) -> None:
        caps = store.capabilities
        assert isinstance(caps, frozenset) and all(isinstance(c, Capability) for c in caps)
        assert isinstance(store.location, str) and store.location
        assert not store.read_only  # `make` gives a writable store
        store.put_batch([(Family.BLOCKS, b"%d" % i, BIG) for i in range(4)])
        if Capability.FLUSH in caps:
            store.flush()
        if Capability.DISK_BYTES in caps:
            size = store.disk_bytes()
            assert isinstance(size, int) and size >= 0
        else:
            assert store.disk_bytes() is None
        store.put_batch([(Family.BLOCKS, b"%d" % i, None) for i in range(4)])
        if Capability.COMPACT in caps:
            store.compact()
        assert list(store.keys(Family.BLOCKS)) == []
        store.refresh()  # a no-op for a writer; never an error

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

    def test_data_survives_close_and_reopen(self, tmp_path: Path) -> None:
        s = self.make(tmp_path)
        s.put_batch([(Family.BLOCKS, b"k", BIG), (Family.HEADERS, b"k", b"h")])
        s.close()
        again = self.reopen(tmp_path)
        if again is None:
            pytest.skip("the store keeps nothing after close")
        with again:
            assert again.get(Family.BLOCKS, b"k") == BIG
            assert again.get(Family.HEADERS, b"k") == b"h"


# -- the state machine ----------------------------------------------------------------
FAMILIES = st.sampled_from([Family.HEADERS, Family.BLOCKS])
KEYS = st.binary(min_size=0, max_size=3)
VALUES = st.one_of(
    st.binary(max_size=40), st.sampled_from([BIG, BIG[:4096], BIG[:4095], PAYLOAD_A, PAYLOAD_B])
)


class StoreFactory(ABC):
    """Makes the stores a `store_machine` drives: one per run, in a fresh directory."""

    @abstractmethod
    def make(self, directory: Path) -> BlockStore:
        """A new, empty, writable store under `directory`."""

    def reopen(self, directory: Path) -> BlockStore | None:
        """The store of `directory` opened again after close; None if not persistent."""
        return None


class _StoreAgainstDict(RuleBasedStateMachine):
    """Random batches, reads, listings and reopens of a store of `factory`, compared with
    a dict after every step (`store_machine` binds the factory in a subclass)."""

    factory: ClassVar[StoreFactory]

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cas_bank_sm_"))
        self.store = self.factory.make(self.dir)
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
        again = self.factory.reopen(self.dir)
        if again is None:  # not persistent: a new store starts empty
            self.store = self.factory.make(self.dir)
            self.model = {f: {} for f in self.model}
        else:
            self.store = again

    @invariant()
    def listings_agree(self) -> None:
        for f, d in self.model.items():
            assert list(self.store.iterate(f)) == sorted(d.items())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def store_machine(factory: StoreFactory, *, max_examples: int = 25) -> Any:
    """A pytest test class: random operations on a store of `factory`, compared with a
    dict after every step."""

    class StoreAgainstDict(_StoreAgainstDict):
        pass

    StoreAgainstDict.factory = factory
    StoreAgainstDict.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=15,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    # The 100 KiB values make hypothesis's step log long; that is expected here.
    return pytest.mark.filterwarnings("ignore:Generating overly large repr")(
        StoreAgainstDict.TestCase
    )
