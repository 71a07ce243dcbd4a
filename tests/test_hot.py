"""The hot tier (`HotStore`): hot restores read nothing below it, the byte bound holds,
writes and deletes through it are never hidden by stale entries, hot hits are counted.

Reads and writes of the store below are counted by `CountingStore`, a wrapper of our
own store interface around a real RocksDB (no mock of RocksDB); `fail_reads` turns
any read below into an error, so a test that passes with it set read nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    random_layers,
    random_state,
    state_bits,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig
from cas_bank.arrays import DTYPES
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Family, MemoryStore, Write
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index import header as header_py
from cas_bank.index.chain import Header, read_headers
from cas_bank.testing import StoreConformance


class CountingStore(BlockStore):
    """Counts what reaches the store below; can refuse reads, or run a hook after one."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.read_only = inner.read_only
        self.capabilities = inner.capabilities
        self.reads: list[tuple[Family, int]] = []  # (family, number of keys) per call
        self.batches: list[list[Write]] = []
        self.fail_reads = False
        self.after_read: Callable[[Family, Sequence[bytes]], None] | None = None

    def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
        if self.fail_reads:
            raise AssertionError(f"read of {len(keys)} {family.value} keys below the hot tier")
        self.reads.append((family, len(keys)))
        out = self.inner.get_many(family, keys)
        hook, self.after_read = self.after_read, None  # one shot
        if hook is not None:
            hook(family, keys)
        return out

    def put_batch(self, writes: Sequence[Write]) -> None:
        self.batches.append(list(writes))
        self.inner.put_batch(writes)

    def iterate(self, family: Family, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        if self.fail_reads:
            raise AssertionError(f"iteration of {family.value} below the hot tier")
        return self.inner.iterate(family, values=values)

    @property
    def location(self) -> str:
        return self.inner.location

    def flush(self) -> None:
        self.inner.flush()

    def compact(self) -> None:
        self.inner.compact()

    def disk_bytes(self) -> int | None:
        return self.inner.disk_bytes()

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        self.reads.clear()
        self.batches.clear()

    def writes_to(self, family: Family) -> list[Write]:
        return [w for batch in self.batches for w in batch if w[0] is family]


def open_counted(path: Path, config: BankConfig) -> tuple[Bank, CountingStore]:
    """A bank whose backend is wrapped: hot tier (if any) -> CountingStore -> RocksDB."""
    Bank.open(path, config).close()  # create it and record its settings
    counting = CountingStore(RocksStore(path))
    store: BlockStore = counting
    if config.hot_bytes > 0:
        store = HotStore(counting, config.hot_bytes)
    return Bank(path, config, store), counting


MiB = 1 << 20


class TestCountingStore(StoreConformance):
    """The tests' own wrapper meets the store interface too."""

    def make(self, tmp_path: Path) -> BlockStore:
        return CountingStore(RocksStore(tmp_path / "db"))

    def reopen(self, tmp_path: Path) -> BlockStore | None:
        return CountingStore(RocksStore(tmp_path / "db"))


# -- a hot restore reads nothing below --------------------------------------------
def test_restore_of_a_hot_prefix_reads_nothing_below(bank_path: Path) -> None:
    spec = attention_spec()
    bank, below = open_counted(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=MiB))
    with bank:
        ns = bank.namespace(spec)
        tokens = list(range(6 * BLOCK_SIZE + 1))  # six full blocks and a tail
        layers = random_layers(spec, len(tokens), seed=1)
        ns.store(tokens, layers)
        below.reset()
        for attempt in range(2):  # the first restore verifies the written-through bytes
            below.fail_reads = attempt > 0
            hit = ns.restore(tokens)
            assert hit is not None and hit.tokens == 6 * BLOCK_SIZE
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        # Below it: only the first look for the prompt's end record (its absence is
        # remembered): no header, no payload.
        assert below.reads == [(Family.ENDS, 2)] and below.batches == []
        below.fail_reads = False  # stats() counts namespaces below
        assert bank.stats().hot_hits == 12


def test_hybrid_state_is_hot_too(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, below = open_counted(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=MiB))
    with bank:
        ns = bank.namespace(spec)
        tokens = list(range(3 * BLOCK_SIZE))
        layers, state = random_layers(spec, len(tokens), seed=2), random_state(spec, 3)
        ns.store(tokens, layers, {3 * BLOCK_SIZE: state})
        below.reset()
        assert ns.restore(tokens) is not None
        assert below.reads == [(Family.ENDS, 1)]  # the end record's absence, remembered
        below.fail_reads = True
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 3 * BLOCK_SIZE
        assert state_bits(hit.layers, spec) == state_bits(state, spec)
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)


def test_cold_restore_reads_below_then_fills_the_tier(bank_path: Path) -> None:
    spec = attention_spec()
    tokens = list(range(4 * BLOCK_SIZE))
    layers = random_layers(spec, len(tokens), seed=4)
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as first:
        first.namespace(spec).store(tokens, layers)
    bank, below = open_counted(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=MiB))
    with bank:
        ns = bank.namespace(spec)
        assert ns.restore(tokens) is not None
        payload_reads = sum(n for f, n in below.reads if f is Family.BLOCKS)
        assert payload_reads == 4 and bank.stats().hot_hits == 0
        below.fail_reads = True
        hit = ns.restore(tokens)
        assert hit is not None
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        below.fail_reads = False
        assert bank.stats().hot_hits == 4


def test_hot_tier_off_means_a_plain_store(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=0)) as bank:
        assert bank.hot is None and not isinstance(bank.store, HotStore)
    with Bank.open(bank_path, BankConfig(hot_bytes=MiB)) as bank:
        assert bank.hot is bank.store and isinstance(bank.store, HotStore)


# -- the byte bound ---------------------------------------------------------------
def test_byte_bound_and_lru_order() -> None:
    inner = MemoryStore()
    inner.put_batch([(Family.BLOCKS, bytes([i]) * 32, bytes(1000)) for i in range(10)])
    hot = HotStore(inner, 3 * 1200)  # room for three 1000-byte values and their overhead
    for i in range(10):
        hot.get(Family.BLOCKS, bytes([i]) * 32)
        assert hot.used_bytes <= hot.max_bytes
    assert len(hot) == 3
    hot.get(Family.BLOCKS, bytes([7]) * 32)  # 7 becomes the most recent
    hot.get(Family.BLOCKS, bytes([0]) * 32)  # evicts the least recent: 8
    cached = {k[0] for (_, k) in hot._entries}
    assert cached == {7, 9, 0}


def test_a_value_larger_than_the_bound_is_not_cached() -> None:
    inner = MemoryStore()
    inner.put_batch([(Family.BLOCKS, b"k" * 32, bytes(5000))])
    hot = HotStore(inner, 4000)
    assert hot.get(Family.BLOCKS, b"k" * 32) == bytes(5000)
    assert len(hot) == 0 and hot.used_bytes == 0


def test_bank_hot_tier_respects_hot_bytes(bank_path: Path) -> None:
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=4000)) as bank:
        ns = bank.namespace(spec)
        for k in range(5):
            toks = [k + 1] * (3 * BLOCK_SIZE)
            ns.store(toks, random_layers(spec, len(toks), seed=k))
            ns.restore(toks)
            assert bank.hot is not None and 0 < bank.hot.used_bytes <= 4000


# -- coherence --------------------------------------------------------------------
def _payload(seed: int) -> bytes:
    return codec.encode([np.full((2, 4), seed, dtype=np.float32)], [DTYPES["float32"]])


def test_delete_through_the_tier_invalidates() -> None:
    hot = HotStore(MemoryStore(), MiB)
    key, raw = b"a" * 32, _payload(1)
    hot.put_batch([(Family.BLOCKS, key, raw)])
    assert hot.get(Family.BLOCKS, key) == raw
    hot.put_batch([(Family.BLOCKS, key, None)])
    assert hot.get(Family.BLOCKS, key) is None
    assert hot.lookup(Family.BLOCKS, key, codec.embedded_digest(raw)) is None


def test_overwrite_replaces_raw_and_decoded() -> None:
    hot = HotStore(MemoryStore(), MiB)
    key, old, new = b"a" * 32, _payload(1), _payload(2)
    hot.put_batch([(Family.BLOCKS, key, old)])
    raw = hot.get(Family.BLOCKS, key)
    assert raw is not None
    hot.keep_decoded(Family.BLOCKS, key, raw, codec.embedded_digest(old), codec.decode(raw))
    assert isinstance(hot.lookup(Family.BLOCKS, key, codec.embedded_digest(old)), codec.Decoded)
    hot.put_batch([(Family.BLOCKS, key, new)])
    assert hot.lookup(Family.BLOCKS, key, codec.embedded_digest(old)) == new  # raw: re-verify
    assert hot.get(Family.BLOCKS, key) == new


def _header(index: int, state: bool = False) -> Header:
    return Header(
        chain_hash=BlockHash(bytes([index + 1]) * 32),
        parent=bytes(32),
        index=index,
        root=bytes(32),
        payload_digest=bytes([7]) * 32,
        payload_size=100,
        tokens=bytes(4 * BLOCK_SIZE),
        state_digest=bytes([9]) * 32 if state else None,
        state_size=10 if state else 0,
    )


def test_parsed_headers_are_kept_and_never_outlive_their_value() -> None:
    hot = HotStore(MemoryStore(), MiB)
    h = _header(0)
    hot.put_batch([(Family.HEADERS, h.chain_hash, h.encode())])
    before = hot.used_bytes
    first = read_headers(hot, [h.chain_hash])[0]
    assert first == h and hot.used_bytes > before  # charged against the bound
    assert read_headers(hot, [h.chain_hash])[0] is first  # not decoded again
    # A write of the key (a state added) replaces the value: the old parse is gone.
    with_state = h.with_state(bytes([9]) * 32, 10)
    hot.put_batch([(Family.HEADERS, h.chain_hash, with_state.encode())])
    again = read_headers(hot, [h.chain_hash])[0]
    assert again == with_state and again is not first and again is not None and again.has_state
    hot.put_batch([(Family.HEADERS, h.chain_hash, None)])
    assert read_headers(hot, [h.chain_hash]) == [None]
    # A store that keeps no values remembers nothing: each read decodes.
    plain = MemoryStore()
    plain.put_batch([(Family.HEADERS, h.chain_hash, h.encode())])
    first_plain = read_headers(plain, [h.chain_hash])[0]
    assert first_plain == h and read_headers(plain, [h.chain_hash])[0] is not first_plain
    assert read_headers(plain, [h.chain_hash])[0] == h


def test_a_header_read_from_below_is_kept_with_its_parse_in_one_pass() -> None:
    """A header the hot tier did not hold (a reopened bank's): read below, cached and
    kept parsed by the same read, charged as one cached and parsed by two reads."""
    h = _header(0)
    inner = MemoryStore()
    inner.put_batch([(Family.HEADERS, h.chain_hash, h.encode())])
    cold = HotStore(inner, MiB)
    first = read_headers(cold, [h.chain_hash])[0]
    assert first == h and cold.misses == 1
    assert read_headers(cold, [h.chain_hash])[0] is first and cold.hits == 1
    warm = HotStore(MemoryStore(), MiB)
    warm.put_batch([(Family.HEADERS, h.chain_hash, h.encode())])
    read_headers(warm, [h.chain_hash])
    assert cold.used_bytes == warm.used_bytes


def test_a_damaged_header_is_never_kept_parsed() -> None:
    hot = HotStore(MemoryStore(), MiB)
    h = _header(0)
    hot.put_batch([(Family.HEADERS, h.chain_hash, h.encode()[:20])])  # truncated
    damaged: set[int] = set()
    assert read_headers(hot, [h.chain_hash], damaged) == [None] and damaged == {0}
    damaged.clear()
    assert read_headers(hot, [h.chain_hash], damaged) == [None] and damaged == {0}


def test_decoded_view_needs_the_expected_digest() -> None:
    hot = HotStore(MemoryStore(), MiB)
    key, raw = b"a" * 32, _payload(1)
    hot.put_batch([(Family.BLOCKS, key, raw)])
    hot.keep_decoded(Family.BLOCKS, key, raw, codec.embedded_digest(raw), codec.decode(raw))
    assert hot.lookup(Family.BLOCKS, key, b"\0" * 32) == raw  # another digest: raw, re-checked


def test_a_read_racing_a_delete_never_caches_the_deleted_value() -> None:
    below = CountingStore(MemoryStore())
    hot = HotStore(below, MiB)
    key = b"a" * 32
    below.put_batch([(Family.HEADERS, key, b"header")])  # written below, so not cached
    # The read below returns the value, then a delete lands before the tier inserts it.
    below.after_read = lambda family, keys: hot.put_batch([(Family.HEADERS, key, None)])
    assert hot.get(Family.HEADERS, key) == b"header"  # what that read saw
    assert (Family.HEADERS, key) not in hot
    assert hot.get(Family.HEADERS, key) is None


def test_refresh_forgets_everything() -> None:
    hot = HotStore(MemoryStore(), MiB)
    hot.put_batch([(Family.HEADERS, b"a" * 32, b"h")])
    assert len(hot) == 1
    hot.refresh()
    assert len(hot) == 0 and hot.used_bytes == 0


def test_eviction_through_the_bank_empties_the_tier(bank_path: Path) -> None:
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=MiB)) as bank:
        ns = bank.namespace(spec)
        tokens = list(range(4 * BLOCK_SIZE))
        ns.store(tokens, random_layers(spec, len(tokens), seed=5))
        assert ns.restore(tokens) is not None
        report = evict_to_budget(bank, 0)
        assert report.blocks_evicted == 4
        # Nothing evicted stays; only the remembered absence of the prompt's end
        # record (still absent: no end record outlives its parent) and the namespace's
        # record epoch, in `chains` and in `prefixes` (`index.chain_records`,
        # `index.prefixes`: it outlives every record).
        hashes = ns.chain(tokens)
        assert bank.hot is not None and len(bank.hot) == 3
        assert not any((f, h) in bank.hot for h in hashes for f in Family)
        assert ns.restore(tokens) is None
        assert bank.stats().corrupt_reads == 0


@pytest.mark.parametrize("hot_bytes", [0, MiB])
def test_hot_hits_count_payloads_served_from_memory(bank_path: Path, hot_bytes: int) -> None:
    spec = attention_spec()
    config = BankConfig(block_size=BLOCK_SIZE, hot_bytes=hot_bytes)
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(spec)
        tokens = list(range(2 * BLOCK_SIZE))
        ns.store(tokens, random_layers(spec, len(tokens), seed=6))
        for _ in range(3):
            ns.restore(tokens)
        assert bank.stats().hot_hits == (6 if hot_bytes else 0)


_b32 = st.binary(min_size=32, max_size=32)


@given(
    chain=_b32,
    parent=_b32,
    index=st.integers(0, 2**32 - 1),
    root=_b32,
    digest=_b32,
    size=st.integers(0, 2**64 - 1),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    state=st.one_of(st.none(), st.tuples(_b32, st.integers(0, 2**64 - 1))),
)
@settings(max_examples=200, deadline=None)
def test_any_header_decodes_to_what_was_encoded(
    chain: bytes,
    parent: bytes,
    index: int,
    root: bytes,
    digest: bytes,
    size: int,
    tokens: list[int],
    state: tuple[bytes, int] | None,
) -> None:
    """Every field comes back in its place (the decoder builds a header positionally),
    and the copy kept beside a hot value is the same header."""
    h = Header(
        chain_hash=BlockHash(chain),
        parent=parent,
        index=index,
        root=root,
        payload_digest=digest,
        payload_size=size,
        tokens=np.array(tokens, dtype="<u4").tobytes(),
        state_digest=state[0] if state else None,
        state_size=state[1] if state else 0,
    )
    assert Header.decode(chain, h.encode()) == h
    hot = HotStore(MemoryStore(), MiB)
    hot.put_batch([(Family.HEADERS, chain, h.encode())])
    assert read_headers(hot, [chain]) == [h] == read_headers(hot, [chain])


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    state=st.booleans(),
    cut=st.integers(0, 400),
    junk=st.binary(max_size=8),
    version=st.integers(0, 255),
    at=st.integers(0, 400),
    byte=st.integers(0, 255),
    numbers=st.tuples(
        st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)
    ),
)
@settings(max_examples=300, deadline=None)
def test_the_native_header_decoder_is_the_python_one(
    tokens: list[int],
    state: bool,
    cut: int,
    junk: bytes,
    version: int,
    at: int,
    byte: int,
    numbers: tuple[int, int, int],
) -> None:
    """`cas_bank._chain.header` (what a lookup decodes with where it is built) gives the
    very header `Header.decode` does, a `Header`, for any record and any damage to it:
    truncated, lengthened, another version, any byte changed; None where Python
    refuses it."""
    native = header_py.native_decoded
    if native is None:
        pytest.skip("the native helper is not built")
    index, size, state_size = numbers
    h = Header(
        BlockHash(bytes(range(32))), b"p" * 32, index, b"r" * 32, b"d" * 32, size,
        np.array(tokens, dtype="<u4").tobytes(), b"s" * 32 if state else None, state_size,
    )  # fmt: skip
    raw = h.encode()
    records = [raw, raw[:cut], raw + junk, bytes([version]) + raw[1:]]
    if at < len(raw):
        records.append(raw[:at] + bytes([byte]) + raw[at + 1 :])
    for record in records:
        want = header_py._python_decoded(h.chain_hash, record)
        got = native(h.chain_hash, record)
        assert got == want
        assert (got is None) == (want is None)
        if got is not None:
            assert type(got) is Header and got.has_state == want.has_state
            assert got.chain_hash is h.chain_hash
