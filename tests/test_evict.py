"""Eviction: the documented order exactly, the budget, counters in step with the
headers, batched last-use bookkeeping, and the races eviction opens (a payload gone
under a restore is a miss, a block gone under a store is written again).

Last uses come from a fake clock (`AccessLog.set_clock`), so orders are exact.
Writes below the bank are counted with `CountingStore` (tests/test_hot.py), a
wrapper of our own store interface around a real RocksDB.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    BLOCK_SIZE,
    PYTHON,
    attention_spec,
    child_env,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    random_layers,
    random_state,
)
from test_hot import open_counted

from cas_bank import Bank, BankConfig, InvalidInputError, Namespace, StoreReport
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.evict.access import last_use
from cas_bank.evict.eviction import Evicted, evict_to_budget
from cas_bank.evict.leaves import LeafIndex
from cas_bank.index.chain import Header
from cas_bank.index.records import TIME, access_key

B = BLOCK_SIZE


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def open_bank(path: Path, **settings: object) -> tuple[Bank, FakeClock]:
    bank = Bank.open(path, BankConfig(block_size=B, **settings))  # type: ignore[arg-type]
    clock = FakeClock()
    bank.access.set_clock(clock)
    return bank, clock


def headers(store: BlockStore) -> dict[bytes, Header]:
    return {k: Header.decode(k, v) for k, v in store.iterate(Family.HEADERS)}


def recount(bank: Bank) -> dict[str, int]:
    hs = headers(bank.store).values()
    return {
        "blocks": len(hs),
        "states": sum(h.has_state for h in hs),
        "payload_bytes": sum(h.payload_size for h in hs),
        "state_bytes": sum(h.state_size for h in hs),
    }


def counted(bank: Bank) -> dict[str, int]:
    v = bank.stats().model_dump()
    return {k: v[k] for k in ("blocks", "states", "payload_bytes", "state_bytes")}


def order(evicted: list[Evicted]) -> list[tuple[str, bytes]]:
    return [(e.kind, e.chain_hash) for e in evicted]


def store_at(
    clock: FakeClock,
    t: float,
    ns: Namespace,
    tokens: list[int],
    seed: int,
    states: dict[int, list[Any]] | None = None,
) -> StoreReport:
    """Store `tokens` (random KV from `seed`) with the clock at `t`."""
    clock.now = t
    return ns.store(tokens, random_layers(ns.spec, len(tokens), seed=seed), states)


# -- the order, exactly -------------------------------------------------------------
def test_leaves_go_least_recently_used_first_and_parents_follow(bank_path: Path) -> None:
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(attention_spec())
        a = list(range(1, 4 * B + 1))  # A0..A3
        b = a[: 2 * B] + list(range(100, 100 + 2 * B))  # shares A0, A1; then B2, B3
        c = list(range(200, 200 + 2 * B))  # C0, C1
        ha = store_at(clock, 1, ns, a, 1).chain
        hb = store_at(clock, 2, ns, b, 2).chain
        hc = store_at(clock, 3, ns, c, 3).chain
        clock.now = 4
        assert ns.restore(a) is not None  # A0..A3 used at 4
        size = headers(bank.store)[ha[0]].payload_size
        assert bank.stats().payload_bytes == 8 * size

        first = evict_to_budget(bank, 8 * size - 1)
        assert order(first.evicted) == [("block", hb[3])]
        assert (first.bytes_before, first.bytes_after) == (8 * size, 7 * size)

        rest = evict_to_budget(bank, 0)
        assert order(rest.evicted) == [
            ("block", hb[2]),
            ("block", hc[1]),
            ("block", hc[0]),
            ("block", ha[3]),
            ("block", ha[2]),
            ("block", ha[1]),
            ("block", ha[0]),
        ]
        assert [e.last_use for e in rest.evicted] == [2, 3, 3, 4, 4, 4, 4]
        assert recount(bank) == counted(bank) == dict.fromkeys(counted(bank), 0)
        assert list(bank.store.iterate(Family.ACCESS)) == []
        assert list(bank.store.iterate(Family.BLOCKS)) == []


def test_states_go_on_their_own_before_blocks_of_the_same_age(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        h_toks = list(range(1, 3 * B + 1))
        g_toks = list(range(50, 50 + B))
        h = store_at(
            clock, 1, ns, h_toks, 1, {B: random_state(spec, 1), 3 * B: random_state(spec, 2)}
        )
        g = store_at(clock, 2, ns, g_toks, 2, {B: random_state(spec, 3)})
        clock.now = 3
        hit = ns.restore(h_toks)  # resumes from the state at 3B: blocks and that state at 3
        assert hit is not None and hit.tokens == 3 * B

        report = evict_to_budget(bank, 0)
        assert order(report.evicted) == [
            ("state", h.chain[0]),  # used at 1, never resumed from since
            ("state", g.chain[0]),  # at 2: the state before its block
            ("block", g.chain[0]),
            ("state", h.chain[2]),  # at 3
            ("block", h.chain[2]),
            ("block", h.chain[1]),
            ("block", h.chain[0]),
        ]
        assert report.states_evicted == 3 and report.blocks_evicted == 4
        assert not any(e.with_state for e in report.evicted)
        assert recount(bank) == counted(bank) == dict.fromkeys(counted(bank), 0)
        assert list(bank.store.iterate(Family.STATES)) == []


def test_a_lone_state_eviction_clears_the_header_flag(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        toks = list(range(1, 3 * B + 1))
        layers = random_layers(spec, len(toks), seed=1)
        clock.now = 1
        chain = ns.store(
            toks, layers, {B: random_state(spec, 1), 3 * B: random_state(spec, 2)}
        ).chain
        clock.now = 2
        assert ns.restore(toks) is not None
        state_size = headers(bank.store)[chain[0]].state_size
        total = bank.stats().payload_bytes + bank.stats().state_bytes

        report = evict_to_budget(bank, total - state_size)
        assert order(report.evicted) == [("state", chain[0])]
        kept = headers(bank.store)
        assert not kept[chain[0]].has_state and kept[chain[2]].has_state
        assert bank.store.get(Family.STATES, chain[0]) is None
        assert recount(bank) == counted(bank)
        hit = ns.restore(toks)  # the deeper state is intact: still a full restore
        assert hit is not None and hit.tokens == 3 * B
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 3 * B)

        evict_to_budget(bank, bank.stats().payload_bytes)  # only the deep state goes
        assert ns.restore(toks) is None  # KV without any state is not a restore point
        assert ns.match(toks) == 0


def test_a_block_older_than_its_state_takes_the_state_with_it(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        chain = store_at(clock, 5, ns, list(range(B)), 1, {B: random_state(spec, 1)}).chain
        # As in a bank written before access records: the block's own record is lost.
        bank.store.put_batch([(Family.ACCESS, access_key(chain[0]), None)])
        bank.access.index = None
        report = evict_to_budget(bank, 0)
        assert order(report.evicted) == [("block", chain[0])]
        assert report.evicted[0].with_state and report.evicted[0].last_use == 0.0
        assert bank.stats().states_evicted == 1 and bank.stats().blocks_evicted == 1
        assert recount(bank) == counted(bank) == dict.fromkeys(counted(bank), 0)
        assert list(bank.store.iterate(Family.ACCESS)) == []


# -- the budget and the counters ----------------------------------------------------
def test_a_store_over_max_bytes_evicts_down_to_it(bank_path: Path) -> None:
    spec = attention_spec()
    probe, _ = open_bank(bank_path.with_name("probe"))
    with probe:
        size = probe.namespace(spec).store(list(range(B)), random_layers(spec, B)).bytes_written
    bank, clock = open_bank(bank_path, max_bytes=5 * size)
    with bank:
        ns = bank.namespace(spec)
        chains = [store_at(clock, k + 1, ns, [k + 1] * 3 * B, k).chain for k in range(4)]
        s = bank.stats()
        assert s.payload_bytes <= 5 * size and s.blocks == 5
        # 12 blocks offered, the least recently used leaves went first: chain 0 and
        # chain 1 leaf by leaf, then the leaf of chain 2.
        assert s.blocks_evicted == 7 and s.bytes_evicted == 7 * size
        kept = set(headers(bank.store))
        assert kept == {chains[2][0], chains[2][1], *chains[3]}
        assert recount(bank) == counted(bank)
    with Bank.open(bank_path) as again:  # counters persisted with the deletes
        assert counted(again) == recount(again)
        assert again.stats().blocks_evicted == 7


def test_an_unset_budget_never_evicts_and_never_walks(bank_path: Path) -> None:
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        for k in range(3):
            toks = [k] * 2 * B
            ns.store(toks, random_layers(spec, len(toks), seed=k))
            ns.restore(toks)
        assert bank.access.index is None  # nothing walked the headers
        assert bank.stats().blocks == 6 and bank.stats().blocks_evicted == 0


def test_the_leaf_index_is_built_lazily_and_kept_equal_to_a_rebuild(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        for k in range(3):
            store_at(clock, k + 1, ns, [k] * 2 * B, k, {2 * B: random_state(spec, k)})
        assert bank.access.index is None  # not at open, not on stores
        evict_to_budget(bank, bank.stats().payload_bytes + bank.stats().state_bytes - 1)
        assert bank.access.index is not None
        for k in range(3, 6):  # stores and restores after the build keep it current
            toks = [k % 4] * 3 * B
            store_at(clock, k + 1, ns, toks, k, {3 * B: random_state(spec, k)})
            clock.now = k + 1.5
            ns.restore(toks)
        evict_to_budget(bank, bank.stats().payload_bytes)
        bank.flush()
        rebuilt = LeafIndex()
        rebuilt.load(bank.store)
        live = bank.access.index
        assert live is not None
        view = {
            k: (n.parent, n.children, n.payload_size, n.state_size, n.used, n.state_used)
            for k, n in live.nodes.items()
        }
        fresh = {
            k: (n.parent, n.children, n.payload_size, n.state_size, n.used, n.state_used)
            for k, n in rebuilt.nodes.items()
        }
        assert view == fresh
        assert (live.payload_bytes, live.state_bytes) == (
            rebuilt.payload_bytes,
            rebuilt.state_bytes,
        )


def test_bad_budgets_and_read_only_banks_are_refused(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        with pytest.raises(InvalidInputError, match="non-negative"):
            evict_to_budget(bank, -1)
        with pytest.raises(InvalidInputError):
            evict_to_budget(bank, 1.5)  # type: ignore[arg-type]
    with (
        Bank.open(bank_path, mode="read_only") as reader,
        pytest.raises(RuntimeError, match="read-only"),
    ):
        evict_to_budget(reader, 0)


# -- last-use bookkeeping ------------------------------------------------------------
def test_restores_write_nothing_until_the_flush_interval(bank_path: Path) -> None:
    spec = attention_spec()
    config = BankConfig(block_size=B, hot_bytes=0, access_flush_interval=10.0)
    bank, below = open_counted(bank_path, config)
    clock = FakeClock()
    bank.access.set_clock(clock)
    with bank:
        ns = bank.namespace(spec)
        toks = list(range(3 * B))
        chain = ns.store(toks, random_layers(spec, len(toks))).chain
        below.reset()
        for i in range(50):
            clock.now = i * 0.1  # 50 restores within 5 s
            assert ns.restore(toks) is not None
        assert below.batches == []
        clock.now = 10.0
        ns.restore(toks)  # the interval has passed: one batch with the last uses
        assert len(below.batches) == 1
        assert sorted(k for _, k, _ in below.writes_to(Family.ACCESS)) == sorted(chain)
        assert last_use(bank.store, bank.access, chain) == [10.0] * 3
        clock.now = 11.0
        ns.restore(toks)
        # pending
        assert len(below.batches) == 1 and last_use(bank.store, bank.access, chain) == [11.0] * 3
    assert len(below.batches) == 2  # close wrote them
    with Bank.open(bank_path) as again:
        assert last_use(again.store, again.access, chain) == [11.0] * 3


def test_pending_uses_ride_along_the_next_store(bank_path: Path) -> None:
    spec = attention_spec()
    config = BankConfig(block_size=B, hot_bytes=0, access_flush_interval=60.0)
    bank, below = open_counted(bank_path, config)
    clock = FakeClock()
    bank.access.set_clock(clock)
    with bank:
        ns = bank.namespace(spec)
        old = ns.store([1] * B, random_layers(spec, B, seed=1)).chain
        clock.now = 7.0
        ns.restore([1] * B)
        below.reset()
        clock.now = 8.0
        new = ns.store([2] * B, random_layers(spec, B, seed=2)).chain
        assert len(below.batches) == 1  # the store's own batch carried the restore's use
        written = {k: TIME.unpack(v)[0] for _, k, v in below.writes_to(Family.ACCESS) if v}
        assert written == {old[0]: 7.0, new[0]: 8.0}


def test_last_use_reader(bank_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        chain = store_at(clock, 3, ns, list(range(2 * B)), 1, {2 * B: random_state(spec)}).chain
        clock.now = 9
        ns.restore(list(range(2 * B)))
        assert last_use(bank.store, bank.access, chain) == [9.0, 9.0]
        assert last_use(bank.store, bank.access, chain, states=True) == [None, 9.0]
        assert last_use(bank.store, bank.access, [BlockHash(bytes(32))]) == [None]
    with Bank.open(bank_path, mode="read_only") as reader:
        assert last_use(reader.store, reader.access, chain) == [9.0, 9.0]
        assert reader.access.enabled is False


# -- races eviction opens -------------------------------------------------------------
def test_a_payload_evicted_under_a_restore_is_a_miss_not_corruption(bank_path: Path) -> None:
    spec = attention_spec()
    bank, below = open_counted(bank_path, BankConfig(block_size=B, hot_bytes=0))
    with bank:
        ns = bank.namespace(spec)
        toks = list(range(3 * B))
        layers = random_layers(spec, len(toks))
        chain = ns.store(toks, layers).chain
        # After the restore has read the headers, the last two blocks are evicted.
        below.after_read = lambda family, keys: evict_to_budget(
            bank, bank.stats().payload_bytes // 3
        )
        hit = ns.restore(toks)
        assert hit is not None and hit.tokens == B and hit.blocks == chain[:1]
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, B)
        assert bank.stats().corrupt_reads == 0 and not bank.suspects.blocks()


def test_a_block_evicted_under_a_store_is_written_again(bank_path: Path) -> None:
    spec = attention_spec()
    bank, below = open_counted(bank_path, BankConfig(block_size=B, hot_bytes=0))
    with bank:
        ns = bank.namespace(spec)
        toks = list(range(3 * B))
        layers = random_layers(spec, len(toks))
        ns.store(toks[: 2 * B], layers)
        # The store's first look sees two blocks; they are evicted before it writes.
        below.after_read = lambda family, keys: evict_to_budget(bank, 0)
        report = ns.store(toks, layers)
        stored = headers(bank.store)
        assert set(stored) == set(report.chain)
        for i, h in enumerate(report.chain):
            assert stored[h].parent == (ns.root if i == 0 else report.chain[i - 1])
        assert recount(bank) == counted(bank)
        hit = ns.restore(toks)
        assert hit is not None and hit.tokens == 3 * B


# -- cas-bank gc ------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "cas_bank.tools.cli", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


def test_gc_command_evicts_offline_in_order_and_reports(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        first = store_at(clock, 1, ns, [1] * 2 * B, 1).chain
        second = store_at(clock, 2, ns, [2] * 2 * B, 2).chain
        size = headers(bank.store)[first[0]].payload_size
    done = run_cli("gc", str(bank_path), "--max-bytes", str(3 * size), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["hash"] for r in out["removed"]] == [first[1].hex()]
    assert (out["bytes_before"], out["bytes_after"], out["blocks_evicted"]) == (
        4 * size,
        3 * size,
        1,
    )
    human = run_cli("gc", str(bank_path), "--max-bytes", "0")
    assert human.returncode == 0 and "blocks evicted" in human.stdout
    assert first[0].hex()[:12] in human.stdout and second[0].hex()[:12] in human.stdout
    with Bank.open(bank_path) as again:
        assert counted(again) == recount(again) == dict.fromkeys(counted(again), 0)
        assert again.stats().blocks_evicted == 4


@pytest.mark.parametrize("size", ["-5", "12parsecs", "lots"])
def test_gc_command_rejects_bad_sizes(bank_path: Path, size: str) -> None:
    Bank.open(bank_path, BankConfig(block_size=B)).close()
    done = run_cli("gc", str(bank_path), "--max-bytes", size)
    assert done.returncode == 2 and "--max-bytes" in done.stderr


def test_gc_command_on_a_missing_bank_is_one_line(tmp_path: Path) -> None:
    done = run_cli("gc", str(tmp_path / "nothing"), "--max-bytes", "1M")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0
    assert "no bank" in done.stderr


def test_a_payload_evicted_and_stored_again_during_a_restore_is_a_miss_not_damage(
    tmp_path: Path,
) -> None:
    """A restore reads a block's header, then its payload; an eviction and a store of
    the same block between the two leave the payload absent to the first read and there
    again by the check of why: a miss of that block, never a corrupt read (the race an
    eviction beside restores and re-stores makes; a payload lost under its header stays
    lost, and is counted)."""
    from cas_bank.blocks.rocks import RocksStore

    class Racing(RocksStore):
        raced = False

        def get_many(self, family: Family, keys: Sequence[bytes]) -> list[bytes | None]:
            if family is Family.BLOCKS and not self.raced:  # gone at that read only
                Racing.raced = True
                return [None] * len(keys)
            return super().get_many(family, keys)

    spec = attention_spec()
    tokens = list(range(3 * BLOCK_SIZE))
    config = BankConfig(block_size=BLOCK_SIZE, hot_bytes=0, file_min_bytes=None)
    with Bank.open(Racing(tmp_path / "bank"), config) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)))
        bank.flush()
        hit = ns.restore(tokens)
        assert Racing.raced
        assert hit is None or hit.tokens < len(tokens)
        assert bank.stats().corrupt_reads == 0
        hit = ns.restore(tokens)  # read again: all there
        assert hit is not None and hit.tokens == len(tokens)
