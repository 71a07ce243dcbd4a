"""Review of the live lease's one-store rule (e619164, a0106f0): two stores of the same
tokens whose numerics differ (every store here has its own seeded KV, state, logits
and hidden state, so a mix is visible), written at once or queued, the one holding
more first or last; every hit must hand out the KV, recurrent state, logits and hidden
state of one store, and an exact repeat the logits its record holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    bits,
    flat_arrays,
    hybrid_spec,
    quantized_spec,
    random_layers,
    random_logits,
    random_state,
    state_bits,
    tokens_of,
)
from runtime_helpers import bit_equal, forward, random_tokens, temp_bank, tiny
from test_next_turn import BLOCK, NEW, turn_one

from cas_bank import Bank, BankConfig
from cas_bank.arrays import to_numpy
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.namespace import EndOf
from cas_bank.spec import ModelSpec

N = 2 * BLOCK_SIZE + 3  # two full blocks and a tail of three tokens
SPECS = {"attention": attention_spec, "hybrid": hybrid_spec, "quantized": quantized_spec}


@dataclass
class Store:
    """One store's numerics, all of its own seed."""

    layers: list[Any]
    state: list[Any] | None
    logits: mx.array | None
    hidden: mx.array | None


def store_of(
    spec: ModelSpec, seed: int, *, logits: bool, hidden: bool = False, n: int = N
) -> Store:
    """A store of `n` tokens: its cache with room after them, as a runtime's has."""
    state = random_state(spec, seed) if spec.is_hybrid else None
    store = Store(
        random_layers(spec, n, seed, pad=5),
        state,
        random_logits(seed) if logits else None,
        random_logits(seed + 1000)[:16] if hidden else None,
    )
    mx.eval(store.layers, store.state, store.logits, store.hidden)  # bound to no stream
    return store


def put(ns: Any, tokens: list[int], store: Store, *, queued: bool) -> None:
    """The store of a turn: its blocks and its end record (as a runtime stores them)."""
    if queued:
        end = EndOf(store.state, store.logits, store.hidden)
        ns.store_turn_later(tokens, store.layers, end=end)
        return
    ns.store(tokens, store.layers)
    ns.store_end(tokens, store.layers, store.state, logits=store.logits, hidden=store.hidden)


def rows_bits(layers: list[Any], spec: ModelSpec, lo: int, hi: int) -> list[list[bytes]]:
    """Bytes of each attention layer's arrays, rows `lo:hi`."""
    return [
        [bits(a[..., lo:hi, :]) for a in flat_arrays(layer)]
        for layer, ls in zip(layers, spec.layers, strict=True)
        if ls.kind == "attention"
    ]


def whose(hit: Any, spec: ModelSpec, stores: list[Store]) -> dict[str, int | None]:
    """Which store each part of `hit` is from (its index; None: no store's)."""

    def of(same: Any) -> int | None:
        return next((i for i, s in enumerate(stores) if same(s)), None)

    n = hit.tokens
    base = n - n % BLOCK_SIZE
    blocks, tail = rows_bits(hit.layers, spec, 0, base), rows_bits(hit.layers, spec, base, n)
    parts = {}  # an empty part is every store's: not asked
    if base:
        parts["blocks"] = of(lambda s: rows_bits(s.layers, spec, 0, base) == blocks)
    if n > base:
        parts["tail"] = of(lambda s: rows_bits(s.layers, spec, base, n) == tail)
    if spec.is_hybrid:
        parts["state"] = of(lambda s: state_bits(s.state, spec) == state_bits(hit.layers, spec))
    if hit.logits is not None:
        parts["logits"] = of(lambda s: s.logits is not None and bits(s.logits) == bits(hit.logits))
    if hit.hidden is not None:
        parts["hidden"] = of(lambda s: s.hidden is not None and bits(s.hidden) == bits(hit.hidden))
    return parts


def check_one_store(hit: Any, spec: ModelSpec, stores: list[Store], *, live: bool) -> int:
    """The store `hit` is of: its tail, state, logits and hidden state are that one's,
    and a live hit's blocks too. (A record's restore takes its full blocks from
    whatever store of their tokens leased them last: blocks are content-addressed, and
    a store that finds them held still leases its own arrays as them; not the live
    lease's doing, so not asserted here.)"""
    parts = whose(hit, spec, stores)
    judged = parts if live else {k: v for k, v in parts.items() if k != "blocks"} or parts
    found = set(judged.values())
    assert len(found) == 1 and None not in found, parts
    return int(found.pop())


# Per store, the extras it is given (logits, hidden), the first store's then the second's;
# and whether an exact repeat then declines the second's live lease for the record (the
# first's, holding more).
ORDERS = {
    "more_first": (((True, False), (False, False)), True),
    "less_first": (((False, False), (True, False)), False),
    "same": (((True, False), (True, False)), False),
    "hidden_first": (((True, True), (True, False)), True),
    "hidden_last": (((True, False), (True, True)), False),
}


def two_stores_then_restore(
    bank_path: Path, kind: str, queued: str, order: str, exact: bool, n: int
) -> None:
    """Two stores of the same `n` tokens, differing numerics, the second one `queued`
    (or both), written; then one restore, whose parts are one store's; the second
    store's live hit, unless an exact repeat finds it holding less than the record."""
    spec = SPECS[kind]()
    tokens = tokens_of(np.random.default_rng(7), n)
    extras, declines = ORDERS[order]
    stores = [
        store_of(spec, seed, logits=logits, hidden=hidden, n=n)
        for seed, (logits, hidden) in enumerate(extras, 1)
    ]
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(spec)
        put(ns, tokens, stores[0], queued=queued == "both")
        put(ns, tokens, stores[1], queued=queued != "none")
        bank.flush()
        prompt = tokens if exact else [*tokens, 5, 6]
        live_hits = bank.stats().live_hits
        hit = ns.restore(prompt)
        assert hit is not None and hit.tokens == n
        live = bank.stats().live_hits > live_hits
        store = check_one_store(hit, spec, stores, live=live)
        if exact:  # the one holding more is found
            assert hit.logits is not None
            assert (hit.hidden is not None) == any(hidden for _, hidden in extras)
        assert (live, store) == ((False, 0) if exact and declines else (live, 1))
        # An attention-only turn ending on a block: no end record past the restore
        # point, so a longer prompt restores the blocks (the live lease's, as views).
        assert live or (exact and declines) or (not exact and n % BLOCK_SIZE == 0)
        again = ns.restore(prompt)  # the record, the live lease taken (or left)
        assert again is not None and again.tokens == n
        check_one_store(again, spec, stores, live=bank.stats().live_hits > live_hits + live)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("queued", ["none", "second", "both"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("exact", [True, False])
def test_every_hit_of_two_differing_stores_is_one_stores(
    bank_path: Path, kind: str, queued: str, order: str, exact: bool
) -> None:
    two_stores_then_restore(bank_path, kind, queued, order, exact, N)


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
@pytest.mark.parametrize("order", ["more_first", "same"])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("n", [2 * BLOCK_SIZE, BLOCK_SIZE - 1])
def test_two_differing_stores_ending_on_a_block_or_inside_the_first(
    bank_path: Path, kind: str, order: str, exact: bool, n: int
) -> None:
    """No tail (the record holds only the state and extras), or no full block."""
    two_stores_then_restore(bank_path, kind, "second", order, exact, n)


def test_a_live_hits_logits_written_in_place_never_reach_its_queued_record(
    bank_path: Path,
) -> None:
    """A live hit of a store still queued: the hit's logits and hidden state are the
    caller's to write in place (`logits[eos] = -inf`), as its KV and state are. They
    must be new objects, not the lease's own: those are the queued record's, which the
    writer writes and other restores read meanwhile."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(8), N)
    store = store_of(spec, 3, logits=True, hidden=True)
    want = bits(store.logits), bits(store.hidden)
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        assert bank.writer is not None
        ns = bank.namespace(spec)
        ns.store(tokens, store.layers)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(30))  # the end record stays queued
        try:
            ns.store_end_later(tokens, store.layers, logits=store.logits, hidden=store.hidden)
            hit = ns.restore(tokens)
            assert hit is not None and hit.logits is not None and hit.hidden is not None
            assert bank.stats().live_hits == 1
            hit.logits[0] = -1e9  # the taker's own arrays: written in place
            hit.hidden[0] = -1e9
            mx.eval(hit.logits, hit.hidden)
            again = ns.restore(tokens)  # the queued record, read from the view
            assert again is not None and again.logits is not None and again.hidden is not None
            seen = bits(again.logits), bits(again.hidden)
        finally:
            gate.set()
        bank.flush()
        written = ns.restore(tokens)  # the record the writer wrote
        assert written is not None and written.logits is not None and written.hidden is not None
        assert [seen, (bits(written.logits), bits(written.hidden))] == [want, want]


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_restore_while_both_stores_are_queued_is_one_stores(bank_path: Path, order: str) -> None:
    """Both stores queued, unwritten, when the restores come."""
    spec = hybrid_spec()
    tokens = tokens_of(np.random.default_rng(9), N)
    extras, _ = ORDERS[order]
    stores = [
        store_of(spec, seed, logits=logits, hidden=hidden)
        for seed, (logits, hidden) in enumerate(extras, 1)
    ]
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, write_behind=8)) as bank:
        assert bank.writer is not None
        ns = bank.namespace(spec)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(30))
        try:
            put(ns, tokens, stores[0], queued=True)
            put(ns, tokens, stores[1], queued=True)
            for prompt in (tokens, [*tokens, 3], tokens):
                live_hits = bank.stats().live_hits
                hit = ns.restore(prompt)
                assert hit is not None and hit.tokens == N
                live = bank.stats().live_hits > live_hits
                check_one_store(hit, spec, stores, live=live)
        finally:
            gate.set()
        bank.flush()
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == N
        check_one_store(hit, spec, stores, live=False)


def test_of_two_queued_end_records_the_one_the_bank_will_keep_is_found(bank_path: Path) -> None:
    """The first queued with its logits, the second (same tokens) without: the second's
    write will find the first held and skip, so the bank keeps the logits. A restore
    while both are queued should find what the bank will hold, as it does for a queued
    record beside a written one (`tests/test_read_view.py`): the exact repeat, exact."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(10), N)
    stores = [store_of(spec, 1, logits=True), store_of(spec, 2, logits=False)]
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, write_behind=8)) as bank:
        assert bank.writer is not None
        ns = bank.namespace(spec)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(30))
        try:
            for store in stores:
                put(ns, tokens, store, queued=True)
            queued = ns.restore(tokens)
        finally:
            gate.set()
        bank.flush()
        written = ns.restore(tokens)
        assert written is not None and written.logits is not None  # the bank kept them
        assert queued is not None and queued.logits is not None


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_restores_racing_queued_stores_of_the_same_tokens_are_each_one_stores(
    bank_path: Path, kind: str
) -> None:
    """One thread queues turns of the same tokens, three stores' numerics in turn (with
    logits, without, with logits and hidden state), while this one restores them, the
    exact repeat and a longer prompt: every hit is one store's, whatever it met (queued,
    written, skipped as held, a live lease taken or left)."""
    spec = SPECS[kind]()
    tokens = tokens_of(np.random.default_rng(11), N)
    stores = [
        store_of(spec, 1, logits=True),
        store_of(spec, 2, logits=False),
        store_of(spec, 3, logits=True, hidden=True),
    ]
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, write_behind=2)) as bank:
        ns = bank.namespace(spec)
        put(ns, tokens, stores[0], queued=False)
        done = threading.Event()
        errors: list[BaseException] = []

        def storing() -> None:
            try:
                for i in range(60):
                    put(ns, tokens, stores[i % 3], queued=True)
            except BaseException as e:  # raised below, on the test's thread
                errors.append(e)
            finally:
                done.set()

        thread = threading.Thread(target=storing)
        thread.start()
        hits = lives = 0
        while not done.is_set() or hits < 20:
            prompt = tokens if hits % 2 else [*tokens, 4]
            live_hits = bank.stats().live_hits
            hit = ns.restore(prompt)
            assert hit is not None and hit.tokens == N
            live = bank.stats().live_hits > live_hits
            check_one_store(hit, spec, stores, live=live)
            hits, lives = hits + 1, lives + live
        thread.join()
        bank.flush()
        assert not errors, errors
        assert lives > 0


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_an_end_record_not_written_for_want_of_its_blocks_keeps_no_live_lease(
    bank_path: Path, kind: str
) -> None:
    """Admission writes no block of a prompt this short, so its end record is not written
    either (it would dangle): no restore will ever find that record, so nothing may stay
    leased for it (the queued store drops it, as a failed store does:
    `tests/test_live_lease.py`), here with no background writer as well."""
    spec = SPECS[kind]()
    tokens = tokens_of(np.random.default_rng(12), N)
    store = store_of(spec, 1, logits=True)
    config = BankConfig(block_size=BLOCK_SIZE, admit_min_tokens=4 * N, write_behind=0)
    with Bank.open(bank_path, config) as bank:
        assert bank.writer is None
        ns = bank.namespace(spec)
        put(ns, tokens, store, queued=True)  # with no writer: stored now, on this thread
        put(ns, tokens, store, queued=False)
        assert bank.stats().ends == 0 and ns.match([*tokens, 1]) == 0
        assert bank.stats().live_bytes == 0


@pytest.mark.parametrize("removal", ["evicted", "revoked"])
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_a_removed_end_records_live_lease_goes_with_it(
    bank_path: Path, removal: str, kind: str
) -> None:
    """An end record evicted (its blocks kept where eviction takes it alone) or revoked:
    its live lease goes too, so no restore is ever a live hit of a record that is gone;
    the same tokens' next store (another's numerics) is the one handed back."""
    spec = SPECS[kind]()
    tokens = tokens_of(np.random.default_rng(13), N)
    stores = [store_of(spec, 1, logits=True), store_of(spec, 2, logits=True)]
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(spec, salt="tenant")
        put(ns, tokens, stores[0], queued=True)
        bank.flush()
        assert bank.stats().live_bytes > 0
        if removal == "revoked":
            assert bank.revoke("tenant").ends == 1
        else:
            held = bank.stats()
            budget = held.payload_bytes + held.state_bytes + held.end_bytes
            while bank.stats().ends:  # the least recently used leaf first
                budget -= 1
                evict_to_budget(bank, budget)
        assert bank.stats().live_bytes == 0
        live_hits = bank.stats().live_hits
        hit = ns.restore([*tokens, 1])
        assert hit is None or not hit.end
        put(ns, tokens, stores[1], queued=True)
        bank.flush()
        for prompt in (tokens, [*tokens, 1]):
            hit = ns.restore(prompt)
            assert hit is not None and hit.tokens == N
            live = bank.stats().live_hits > live_hits
            assert check_one_store(hit, spec, stores, live=live) == 1
            live_hits += live


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-hybrid"])
def test_two_agents_on_two_threads_branching_from_a_queued_turn_see_only_their_own(
    name: str,
) -> None:
    """The turn stored in the background and still queued; two agents, each on its own
    thread, restore a longer prompt of it (one takes the live cache, the other reads
    the queued record) and prefill their own tokens at once: each gets the logits of
    its own prompt, bit for bit, and the runtime's own cache of the turn is untouched."""
    with temp_bank(BLOCK, write_behind=64) as bank:  # no store waits for the gate
        assert bank.writer is not None
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK, background=True)
        rng = np.random.default_rng(27)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(30))  # turn one stays queued
        try:
            finished, cache, ends, _, recorder = turn_one(pc, rng)
            pc.store(finished, cache, states=recorder)
            attention = pc.spec.attention_layers[0]
            kept = np.array(to_numpy(cache[attention].keys))
            turns = [finished + random_tokens(rng, NEW) for _ in range(2)]
            got: dict[int, mx.array] = {}
            start = threading.Barrier(2)

            def agent(i: int) -> None:
                start.wait(10)
                restored, n = pc.restore(turns[i])
                assert n == len(finished)
                got[i] = pc.prefill(turns[i], restored, n, end=False)
                mx.eval(got[i])

            agents = [threading.Thread(target=agent, args=(i,)) for i in range(2)]
            for a in agents:
                a.start()
            for a in agents:
                a.join(60)
            assert sorted(got) == [0, 1] and bank.stats().live_hits == 1
        finally:
            gate.set()
        bank.flush()
        chunk_ends = pc.last_prefill.chunk_ends  # both turns are as long: chunked alike
        for turn, logits in zip(turns, [got[0], got[1]], strict=True):
            reference = forward(pc, pc.new_cache(), turn, 0, ends + chunk_ends)
            assert bit_equal(logits, reference)
        assert np.array_equal(np.array(to_numpy(cache[attention].keys)), kept)
