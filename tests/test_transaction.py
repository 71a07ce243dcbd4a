"""The bank's one transaction: a store, an eviction, a bundle import and `verify --fix`
whose batch fails leave the counters, the suspect marks and the last uses exactly as
a recount from the records says; the retry then succeeds. An import of a good bundle
repairs a corrupt block. The store is a real RocksDB whose `put_batch` fails once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, hybrid_spec, kv_prefix_bits, layers_bits, prefix_layers
from conftest import random_state as state_of
from test_evict import FakeClock, counted, recount

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family, Write
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.evict.leaves import LeafIndex
from cas_bank.index.chain import Header, read_headers
from cas_bank.index.records import TIME
from cas_bank.maintenance.bundle import export_chain, import_bundle
from cas_bank.maintenance.verify import verify
from cas_bank.stats import Counters

B = BLOCK_SIZE
SPEC = hybrid_spec()


class FailsOnce(RocksStore):
    """A real RocksDB whose next non-empty batch fails (a full disk) once `arm`ed."""

    armed = False
    failures = 0

    def arm(self) -> None:
        self.armed = True

    def put_batch(self, writes: Sequence[Write]) -> None:
        if self.armed and writes:
            self.armed = False
            self.failures += 1
            raise OSError("No space left on device (injected)")
        super().put_batch(writes)


def open_bank(path: Path, **settings: object) -> tuple[Bank, FailsOnce, FakeClock]:
    store = FailsOnce(path)
    config = BankConfig(block_size=B, hot_bytes=0, **settings)  # type: ignore[arg-type]
    bank = Bank.open(store, config)
    clock = FakeClock()
    bank.access.set_clock(clock)
    return bank, store, clock


def corrupt(bank: Bank, family: Family, key: bytes) -> None:
    """Flip the last byte of a record (tampering below the bank, as a bad disk would)."""
    raw = bytearray(bank.store.get(family, key) or b"")
    raw[-1] ^= 0xFF
    bank.store.put_batch([(family, key, bytes(raw))])


def uses(bank: Bank) -> dict[bytes, float]:
    """Last uses as recorded: written ones, with pending ones over them."""
    out = {k: TIME.unpack(v)[0] for k, v in bank.store.iterate(Family.ACCESS)}
    out.update(bank.access.pending_items())
    return out


def assert_recounted(bank: Bank) -> None:
    """Counters, suspect marks and last uses equal a recount from the records."""
    assert counted(bank) == recount(bank)
    report = verify(bank)
    corrupt_blocks = {p.chain_hash for p in report.problems if p.kind == "payload_corrupt"}
    corrupt_states = {p.chain_hash for p in report.problems if p.kind == "state_corrupt"}
    assert set(bank.suspects.blocks()) == corrupt_blocks
    assert set(bank.suspects.states()) == corrupt_states
    # Every last use belongs to a stored block or state (none outlives what it names).
    headers = {k: h for k, h in zip(*_headers(bank), strict=True) if h is not None}
    live = set(headers) | {k + b"s" for k, h in headers.items() if h.has_state}
    assert set(uses(bank)) <= live
    index = bank.access.index
    if index is not None:  # the leaf index mirrors the records
        rebuilt = LeafIndex()
        rebuilt.load(bank.store)
        rebuilt.touch_each(bank.access.pending_items())
        assert _view(index) == _view(rebuilt)


def assert_persisted(bank: Bank) -> None:
    """After a flush, the persisted counters are the in-memory ones."""
    bank.flush()
    assert Counters(bank.store).values() == bank.counters.values()
    assert bank.access.pending_items() == []


def _headers(bank: Bank) -> tuple[list[bytes], list[Header | None]]:
    keys = list(bank.store.keys(Family.HEADERS))
    return keys, read_headers(bank.store, keys)


def _view(index: LeafIndex) -> dict[bytes, tuple[object, ...]]:
    return {
        k: (n.parent, n.children, n.payload_size, n.state_size, n.has_state, n.used, n.state_used)
        for k, n in index.nodes.items()
    }


def stored(bank: Bank, clock: FakeClock, t: float, n_blocks: int, seed: int = 0) -> list[bytes]:
    """Store a chain of `n_blocks` (a state at its end) at time `t`; its hashes."""
    clock.now = t
    tokens = list(range(seed, seed + n_blocks * B))
    ns = bank.namespace(SPEC)
    report = ns.store(tokens, prefix_layers(SPEC, tokens), {n_blocks * B: state_of(SPEC, seed)})
    return list(report.chain)


def test_a_failed_store_changes_nothing_and_its_retry_repairs(tmp_path: Path) -> None:
    bank, store, clock = open_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(SPEC)
        chain = stored(bank, clock, 1.0, 3)
        corrupt(bank, Family.BLOCKS, chain[1])
        clock.now = 2.0
        tokens = list(range(4 * B))
        assert ns.restore(tokens) is None  # block 1 fails: a counted miss, marked suspect
        assert bank.suspects.blocks() == {chain[1]}
        before_counters, before_uses = bank.counters.values(), uses(bank)

        store.arm()
        clock.now = 3.0
        layers = prefix_layers(SPEC, tokens)
        with pytest.raises(OSError, match="No space"):
            ns.store(tokens, layers, {4 * B: state_of(SPEC, 9)})
        assert store.failures == 1
        assert bank.counters.values() == before_counters
        assert uses(bank) == before_uses  # the failed store used nothing
        assert_recounted(bank)
        assert_persisted(bank)

        report = ns.store(tokens, layers, {4 * B: state_of(SPEC, 9)})
        assert report.blocks_written == 2  # the corrupt block 1, and the new block 3
        assert not bank.suspects.blocks()
        assert_recounted(bank)
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 4 * B
        assert layers_bits(hit.layers, SPEC) == kv_prefix_bits(layers, SPEC, 4 * B)
        assert_persisted(bank)


def test_a_failed_eviction_changes_nothing_and_its_retry_evicts(tmp_path: Path) -> None:
    bank, store, clock = open_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(SPEC)
        old = stored(bank, clock, 1.0, 2, seed=0)
        new = stored(bank, clock, 2.0, 2, seed=100)
        clock.now = 3.0
        assert ns.restore(list(range(2 * B))) is not None  # pending uses of `old`
        corrupt(bank, Family.STATES, new[1])
        assert ns.restore(list(range(100, 100 + 2 * B))) is None  # its state: suspect
        assert bank.suspects.states() == {new[1]}
        before_counters, before_uses = bank.counters.values(), uses(bank)

        store.arm()
        with pytest.raises(OSError, match="No space"):
            evict_to_budget(bank, 0)
        assert bank.counters.values() == before_counters
        assert uses(bank) == before_uses  # the pending uses of the chain are kept
        assert_recounted(bank)
        assert_persisted(bank)

        report = evict_to_budget(bank, 0)
        assert report.blocks_evicted == 4
        assert bank.stats().blocks == 0 and not bank.suspects.states()
        assert uses(bank) == {}
        assert_recounted(bank)
        assert_persisted(bank)
        assert old[0] not in bank.access.index.nodes  # type: ignore[union-attr]


def test_a_failed_import_changes_nothing_and_its_retry_repairs(tmp_path: Path) -> None:
    source, _, source_clock = open_bank(tmp_path / "source")
    with source:
        chain = stored(source, source_clock, 1.0, 3)
        headers = read_headers(source.store, chain)
        bundle = export_chain(source, [h for h in headers if h is not None], tmp_path / "b.casb")
    bank, store, clock = open_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(SPEC)
        assert stored(bank, clock, 1.0, 2) == chain[:2]
        corrupt(bank, Family.BLOCKS, chain[0])
        clock.now = 2.0
        tokens = list(range(3 * B))
        assert ns.restore(tokens) is None
        assert bank.suspects.blocks() == {chain[0]}
        before_counters, before_uses = bank.counters.values(), uses(bank)

        store.arm()
        clock.now = 3.0
        with pytest.raises(OSError, match="No space"):
            import_bundle(bank, bundle.path)
        assert bank.counters.values() == before_counters
        assert uses(bank) == before_uses
        assert_recounted(bank)
        assert_persisted(bank)

        report = import_bundle(bank, bundle.path)
        assert report.blocks_written == 2  # the corrupt block 0, repaired, and block 2
        assert not bank.suspects.blocks()
        assert verify(bank).ok
        assert_recounted(bank)
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 3 * B
        assert_persisted(bank)


def test_an_import_repairs_a_corrupt_block_nobody_read_yet(tmp_path: Path) -> None:
    source, _, source_clock = open_bank(tmp_path / "source")
    with source:
        chain = stored(source, source_clock, 1.0, 3)
        headers = [h for h in read_headers(source.store, chain) if h is not None]
        bundle = export_chain(source, headers, tmp_path / "b.casb")
    bank, _, clock = open_bank(tmp_path / "bank")
    with bank:
        stored(bank, clock, 1.0, 3)
        corrupt(bank, Family.BLOCKS, chain[1])
        corrupt(bank, Family.STATES, chain[2])
        kinds = {p.kind for p in verify(bank).problems}
        assert kinds == {"payload_corrupt", "state_corrupt", "unreachable"}
        report = import_bundle(bank, bundle.path)
        assert report.blocks_written == 1 and report.states_written == 1
        assert verify(bank).ok
        assert_recounted(bank)
        hit = bank.namespace(SPEC).restore(list(range(3 * B)))
        assert hit is not None and hit.tokens == 3 * B
        assert_persisted(bank)


def test_a_failed_verify_fix_changes_nothing_and_its_retry_fixes(tmp_path: Path) -> None:
    bank, store, clock = open_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(SPEC)
        chain = stored(bank, clock, 1.0, 3)
        other = stored(bank, clock, 2.0, 2, seed=100)
        corrupt(bank, Family.BLOCKS, chain[1])
        clock.now = 3.0
        assert ns.restore(list(range(3 * B))) is None
        assert ns.restore(list(range(100, 100 + 2 * B))) is not None  # pending uses
        assert bank.suspects.blocks() == {chain[1]}
        evict_to_budget(bank, 10**9)  # builds the leaf index, evicts nothing
        before_counters, before_uses = bank.counters.values(), uses(bank)

        store.arm()
        with pytest.raises(OSError, match="No space"):
            verify(bank, fix=True)
        assert bank.counters.values() == before_counters
        assert uses(bank) == before_uses
        assert_recounted(bank)
        assert_persisted(bank)

        report = verify(bank, fix=True)
        assert sorted(report.removed_blocks) == sorted(chain[1:])
        assert not bank.suspects.blocks()
        assert verify(bank).ok
        assert_recounted(bank)
        assert set(uses(bank)) == {chain[0], *other, other[1] + b"s"}
        assert_persisted(bank)


def test_transactions_do_not_nest_and_a_read_only_bank_has_none(tmp_path: Path) -> None:
    bank, _, _ = open_bank(tmp_path / "bank")
    with bank, bank.transaction() as tx:
        tx.add(stores=1)
        with pytest.raises(RuntimeError, match="already open"), bank.transaction():
            pass
    with Bank.open(tmp_path / "bank", mode="read_only") as reader:
        assert reader.stats().stores == 1
        with pytest.raises(RuntimeError, match="read-only"), reader.transaction():
            pass


def test_activity_counts_cannot_change_stored_content_counters(tmp_path: Path) -> None:
    bank, _, _ = open_bank(tmp_path / "bank")
    with bank:
        with pytest.raises(ValueError, match="only in a transaction"):
            bank.counters.count(blocks=1)
        with pytest.raises(ValueError, match="no counters named"), bank.transaction() as tx:
            tx.add(nonsense=1)
        assert bank.stats().blocks == 0
