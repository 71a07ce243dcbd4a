"""A hypothesis state machine over store / restore / evict / reopen on a tiny hybrid
model (block_size 2-4, a budget of a few blocks, with and without a hot tier).

KV and states are a pure function of the token prefix (as a model's are), so the
machine knows what every restore must return. After every step:
- every stored block's parent is stored, or it is a namespace root;
- payload + state bytes are within `max_bytes`;
- the counters equal a recount from the headers; payloads, states and access
  records exist exactly for the headers that claim them;
- a built leaf index agrees with one rebuilt from disk;
- the removal records (`evict.evicted`) are at most `eviction_memory`, name nothing
  stored, fill their ring slots, and hold every removal of the newest steps that fit
  the cap (with the step's time and reason); a changed cap at reopen keeps the newest.
Every restore returns exactly the restore point the disk holds (the deepest matched
boundary with a state, so never a chain with a hole and never a state without every
block below it), with arrays equal to the stored ones for every returned token.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from conftest import bits, hybrid_spec, layers_bits, state_bits
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cas_bank import Bank, BankConfig, InvalidInputError
from cas_bank.blocks.hashing import end_hash
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.evict.evicted import Removal, horizon
from cas_bank.evict.eviction import evict_to_budget, pins
from cas_bank.evict.leaves import LeafIndex
from cas_bank.index.chain import Header
from cas_bank.index.children import expected_entries
from cas_bank.index.ends import split_record
from cas_bank.index.records import END_SUFFIX, STATE_SUFFIX

SPEC = hybrid_spec()
ATTENTION = [ls for ls in SPEC.layers if ls.kind == "attention"]
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=12)  # few ids: shared prefixes


def _rng(kind: str, prefix: tuple[int, ...]) -> np.random.Generator:
    seed = hashlib.blake2b(repr((kind, prefix)).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little"))


def kv_of(tokens: list[int]) -> list[Any]:
    """Per-layer KV where token p's rows depend only on tokens[: p + 1]."""
    rows = [
        _rng("kv", tuple(tokens[: p + 1])).standard_normal((2 * len(ATTENTION), 2, 8), np.float32)
        for p in range(len(tokens))
    ]
    stacked = (
        np.stack(rows, axis=2) if rows else np.zeros((2 * len(ATTENTION), 2, 0, 8), np.float32)
    )
    out: list[Any] = []
    j = 0
    for ls in SPEC.layers:
        if ls.kind == "recurrent":
            out.append(None)
            continue
        k = mx.array(stacked[j][None]).astype(mx.bfloat16)
        v = mx.array(stacked[j + 1][None]).astype(mx.bfloat16)
        out.append((k, v))
        j += 2
    return out


def state_of(prefix: list[int]) -> list[Any]:
    rng = _rng("state", tuple(prefix))
    return [
        tuple(
            mx.array(rng.standard_normal(s.shape, np.float32)).astype(
                mx.bfloat16 if s.dtype == "bfloat16" else mx.float32
            )
            for s in ls.arrays
        )
        if ls.kind == "recurrent"
        else None
        for ls in SPEC.layers
    ]


def disk(bank: Bank) -> BlockStore:
    """The store below the hot tier: what is really kept."""
    return bank.store.inner if isinstance(bank.store, HotStore) else bank.store


class EvictionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cas_bank_evict_machine_"))
        self.bank: Bank | None = None
        self.now = 0.0
        self.stored: list[list[int]] = []
        # Per step that removed something: (time, removals numbered, record keys).
        self.steps: list[tuple[float, int, set[bytes]]] = []
        self.relaid = False

    def clock(self) -> float:
        return self.now

    @initialize(
        block_size=st.integers(2, 4),
        max_bytes=st.integers(2000, 8000),
        hot_bytes=st.sampled_from([0, 3000, 1 << 20]),
        memory=st.integers(0, 6) | st.just(1 << 19),
    )
    def open_bank(self, block_size: int, max_bytes: int, hot_bytes: int, memory: int) -> None:
        self.config = BankConfig(
            block_size=block_size, max_bytes=max_bytes, hot_bytes=hot_bytes, eviction_memory=memory
        )
        self._open()

    def _open(self) -> None:
        self.bank = Bank.open(self.dir / "bank", self.config)
        self.bank.access.set_clock(self.clock)
        self.ns = self.bank.namespace(SPEC)

    def teardown(self) -> None:
        if self.bank is not None:
            self.bank.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def b(self) -> Bank:
        assert self.bank is not None
        return self.bank

    # -- rules ---------------------------------------------------------------------
    @rule(
        tokens=prompts,
        picks=st.sets(st.integers(1, 6), max_size=3),
        skip_last=st.booleans(),
        end=st.booleans(),
    )
    def store(self, tokens: list[int], picks: set[int], skip_last: bool, end: bool) -> None:
        self.now += 1
        bs = self.config.block_size
        boundaries = {p * bs for p in picks if p * bs <= len(tokens)}
        if not skip_last and len(tokens) >= bs:  # as the runtime does: the deepest boundary
            boundaries.add(len(tokens) // bs * bs)
        states = {b: state_of(tokens[:b]) for b in boundaries}
        evicted = self.b.counters.values()["blocks_evicted"]
        with self._step():
            self.ns.store(tokens, kv_of(tokens), states)
            if end and tokens:  # its end record, as the runtime stores after a request
                self.ns.store_end(tokens, kv_of(tokens), state_of(tokens))
        self.stored.append(tokens)
        event(f"store: evicted={self.b.counters.values()['blocks_evicted'] > evicted}")

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), max_size=3))
    def restore_stored(self, data: st.DataObject, tail: list[int]) -> None:
        """A prompt stored before, maybe with a few more tokens: the usual case."""
        self.restore(data.draw(st.sampled_from(self.stored)) + tail)

    @rule(tokens=prompts)
    def restore(self, tokens: list[int]) -> None:
        self.now += 1
        expected = self._restore_point(tokens)
        hit = self.ns.restore(tokens)
        event(f"restore: hit={expected > 0}")
        if expected == 0:
            assert hit is None
            return
        assert hit is not None and hit.tokens == expected, (hit and hit.tokens, expected)
        want_kv = [
            (bits(k[..., :expected, :]), bits(v[..., :expected, :]))
            for k, v in (layer for layer in kv_of(tokens) if layer is not None)
        ]
        assert [tuple(x) for x in layers_bits(hit.layers, SPEC)] == want_kv
        assert state_bits(hit.layers, SPEC) == state_bits(state_of(tokens[:expected]), SPEC)

    @rule(budget=st.integers(0, 8000))
    def evict(self, budget: int) -> None:
        before = self._stored_bytes()
        with self._step():
            report = evict_to_budget(self.b, budget)
        event(f"evict: removed something={bool(report.evicted)}")
        assert report.bytes_before == before
        assert report.bytes_after == self._stored_bytes() <= budget

    @rule(memory=st.none() | st.integers(0, 6))
    def reopen(self, memory: int | None) -> None:
        before = sorted(self._records().items(), key=lambda kv: kv[1].seq)
        self.b.close()
        if memory is not None and memory != self.config.eviction_memory:
            self.config = self.config.model_copy(update={"eviction_memory": memory})
            self._open()
            # The ring is laid out again: the newest records that fit stay, as they were.
            kept = before[len(before) - memory :] if memory else []
            got = self._records()
            assert set(got) == {k for k, _ in kept}
            assert all(got[k].time == r.time and got[k].reason == r.reason for k, r in kept)
            self.steps.clear()  # the records from before count as older than any step
            self.relaid = True
            return
        self._open()

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def chains_have_no_holes(self) -> None:
        if self.bank is None:
            return
        hs = self._headers()
        for h in hs.values():
            assert h.parent == self.ns.root or h.parent in hs

    @invariant()
    def within_budget(self) -> None:
        if self.bank is None:
            return
        assert self._stored_bytes() <= self.config.max_bytes  # type: ignore[operator]

    @invariant()
    def counters_match_a_recount(self) -> None:
        if self.bank is None:
            return
        hs = list(self._headers().values())
        v = self.b.counters.values()
        assert v["blocks"] == len(hs)
        assert v["states"] == sum(h.has_state for h in hs)
        assert v["payload_bytes"] == sum(h.payload_size for h in hs)
        assert v["state_bytes"] == sum(h.state_size for h in hs)
        ends = self._ends()
        assert v["ends"] == len(ends)
        assert v["end_bytes"] == sum(len(value) for value in ends.values())

    @invariant()
    def records_match_their_headers(self) -> None:
        if self.bank is None:
            return
        store = disk(self.b)
        hs = self._headers()
        assert set(store.keys(Family.BLOCKS)) == set(hs)
        assert set(store.keys(Family.STATES)) == {k for k, h in hs.items() if h.has_state}
        ends = self._ends()
        for key in ends:  # an end record never outlives its parent block
            assert key[:32] == self.ns.root or key[:32] in hs
        for key in store.keys(Family.ACCESS):
            if key[32:] == END_SUFFIX:
                assert any(k[:32] == key[:32] for k in ends), "an access record outlived its ends"
                continue
            owner = hs.get(key[:32])
            assert owner is not None, "an access record outlived its block"
            if key.endswith(STATE_SUFFIX) and len(key) == 33:
                assert owner.has_state, "an access record outlived its state"

    @invariant()
    def children_index_is_exact(self) -> None:
        """Every stored block and end record (with a tail) has its entry in the children
        index, and nothing else has one (stores, ends, eviction and reopens keep it)."""
        if self.bank is None:
            return
        ends = [(k, split_record(k, v)[0]) for k, v in self._ends().items()]
        want = expected_entries(self._headers().values(), ends)
        assert dict(disk(self.b).iterate(Family.CHILDREN)) == want

    @invariant()
    def leaf_index_matches_a_rebuild(self) -> None:
        if self.bank is None or self.b.access.index is None:
            return
        rebuilt = LeafIndex()
        rebuilt.load(disk(self.b))

        def shape(index: LeafIndex) -> dict[bytes, tuple[Any, ...]]:
            return {
                k: (n.parent, n.children, n.payload_size, n.state_size, n.has_state)
                for k, n in index.nodes.items()
            }

        assert shape(self.b.access.index) == shape(rebuilt)
        live = self.b.access.index
        assert {k: g.sizes for k, g in live.ends.items()} == {
            k: g.sizes for k, g in rebuilt.ends.items()
        }
        assert live.total == rebuilt.total

    @invariant()
    def removal_records_are_bounded_and_exact(self) -> None:
        if self.bank is None:
            return
        store, cap = disk(self.b), self.config.eviction_memory
        records, nxt = self._records(), self._next()
        assert len(records) <= cap
        hs = self._headers()
        for key, r in records.items():
            block = key[1:33]
            assert block not in hs or (len(key) == 34 and not hs[block].has_state)
            assert nxt - cap <= r.seq < nxt
            assert store.get(Family.EVICTED, b"q" + (r.seq % cap).to_bytes(8, "big")) == key

        def stored(key: bytes) -> bool:  # stored again since: its record was cleared
            h = hs.get(key[1:33])
            return h is not None and (len(key) == 33 or h.has_state)

        # Every removal of the newest steps that fit the cap has its record.
        room = cap
        for t, n, keys in reversed(self.steps):
            room -= n
            if room < 0:
                break
            for key in keys:
                if stored(key):
                    continue
                r = records.get(key)
                assert r is not None, "a removal within the cap left no record"
                assert r.time >= t and r.reason == "budget"
        reach = horizon(store, 0)
        if nxt <= cap and not self.relaid:  # nothing can have been dropped
            assert reach.complete or cap == 0
        if reach.complete and not self.relaid:  # then every removal not stored again has one
            assert all(
                key in records for _, _, keys in self.steps for key in keys if not stored(key)
            )
        else:
            assert reach.complete or reach.time is not None

    # -- helpers ---------------------------------------------------------------------
    @contextmanager
    def _step(self) -> Iterator[None]:
        """Note what the step removes (a block, or a state on its own)."""
        before, first = self._headers(), self._next()
        yield
        after = self._headers()
        gone = {b"r" + k for k in before if k not in after}
        gone |= {
            b"r" + k + STATE_SUFFIX
            for k, h in before.items()
            if h.has_state and k in after and not after[k].has_state
        }
        for _, _, keys in self.steps:  # a later removal of a key is its record
            keys -= gone
        n = self._next() - first
        if n:
            self.steps.append((self.now, n, gone))

    def _records(self) -> dict[bytes, Removal]:
        out = {}
        for key, raw in disk(self.b).iterate(Family.EVICTED):
            if key[:1] == b"r":
                r = Removal.decode(raw)
                assert r is not None
                out[key] = r
        return out

    def _next(self) -> int:
        raw = disk(self.b).get(Family.EVICTED, b"mnext")
        return int.from_bytes(raw, "little") if raw else 0

    def _headers(self) -> dict[bytes, Header]:
        return {k: Header.decode(k, v) for k, v in disk(self.b).iterate(Family.HEADERS)}

    def _ends(self) -> dict[bytes, bytes]:
        return dict(disk(self.b).iterate(Family.ENDS))

    def _stored_bytes(self) -> int:
        blocks = sum(h.payload_size + h.state_size for h in self._headers().values())
        return blocks + sum(len(v) for v in self._ends().values())

    def _restore_point(self, tokens: list[int]) -> int:
        """Tokens a restore must cover, from what is on disk."""
        hs = self._headers()
        bs = self.config.block_size
        parent, deepest, matched = self.ns.root, 0, 0
        for i, h in enumerate(self.ns.chain(tokens)):
            header = hs.get(h)
            if header is None or header.parent != parent:
                break
            parent, matched = h, i + 1
            if header.has_state:
                deepest = i + 1
        # An end record under the deepest matched block, if one prefixes the prompt.
        ends = {k[32:] for k in self._ends() if k[:32] == parent}
        base = matched * bs
        for n in range(min(len(tokens), base + bs - 1), base - 1, -1):
            if end_hash(parent, np.array(tokens[base:n], "<u4")) in ends:
                if n > deepest * bs or n == len(tokens):
                    return n
                break
        return deepest * bs


EvictionMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEvictionMachine = EvictionMachine.TestCase


class PinnedEvictionMachine(EvictionMachine):
    """The machine above with pins: `pin` a stored prompt's prefix, `unpin` one.

    Every invariant above holds, the budget as pins allow it: over `max_bytes` only when
    everything left is pinned. And after every step (reopens included): what a pin
    holds is stored (its blocks, each state stored on them since the pin, its end
    records), and the leaf index holds exactly the pins on disk.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pins: dict[tuple[int, ...], tuple[list[bytes], bytes | None]] = {}
        self.held_states: set[bytes] = set()  # pinned blocks seen with a state
        self.held_ends: set[bytes] = set()  # end records seen under a pinned parent

    @initialize(
        block_size=st.integers(2, 4),
        max_bytes=st.integers(2000, 8000),
        hot_bytes=st.sampled_from([0, 3000, 1 << 20]),
        memory=st.integers(0, 6) | st.just(1 << 19),
        share=st.sampled_from([0.3, 0.9]),
        policy=st.sampled_from(["lfu", "lru"]),
    )
    def open_bank(  # type: ignore[override]
        self,
        block_size: int,
        max_bytes: int,
        hot_bytes: int,
        memory: int,
        share: float,
        policy: str,
    ) -> None:
        self.config = BankConfig(
            block_size=block_size,
            max_bytes=max_bytes,
            hot_bytes=hot_bytes,
            eviction_memory=memory,
            pin_share=share,
            eviction_policy=policy,  # type: ignore[arg-type]
        )
        self._open()

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data(), cut=st.none() | st.integers(1, 12))
    def pin(self, data: st.DataObject, cut: int | None) -> None:
        """A prompt stored before (maybe evicted since), or a prefix of it."""
        self._pin(data.draw(st.sampled_from(self.stored))[:cut])

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=2, max_size=12),
        picks=st.sets(st.integers(1, 6), max_size=3),
        end=st.booleans(),
        cut=st.none() | st.integers(2, 12),
    )
    def store_then_pin(
        self, tokens: list[int], picks: set[int], end: bool, cut: int | None
    ) -> None:
        """A system prompt: stored (with its deepest state), then pinned."""
        self.store(tokens, picks, False, end)
        self._pin(tokens[:cut])

    def _pin(self, tokens: list[int]) -> None:
        bs = self.config.block_size
        chain = [bytes(h) for h in self.ns.chain(tokens)]
        hs = self._headers()
        stored = 0
        for h in chain:
            if h not in hs:
                break
            stored += 1
        want = self._pinned_bytes_with(tokens, chain)
        limit = int(self.config.pin_share * self.config.max_bytes)  # type: ignore[operator]
        try:
            report = self.ns.pin(tokens)
        except InvalidInputError as e:
            if not chain:
                event("pin: refused, no block")
                assert "no full block" in str(e)
            elif stored < len(chain):
                event("pin: refused, not stored")
                assert f"only {stored * bs} of" in str(e)
            else:
                event("pin: refused, over the share")
                assert want > limit and f"pins would hold {want} bytes" in str(e)
            return
        event("pin: held")
        assert chain and stored == len(chain) and report.pinned_bytes == want
        assert want <= limit or not report.new  # what a pin holds may grow after it
        parent = chain[-1]
        end_key = parent + end_hash(parent, np.array(tokens[len(chain) * bs :], "<u4"))
        self.pins[tuple(tokens)] = (chain, parent if end_key in self._ends() else None)
        self._note_held()

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(sorted(self.pins)))
        with self._step():  # what no pin holds now goes, down to the budget
            assert self.ns.unpin(list(tokens)) is True
        assert self.ns.unpin(list(tokens)) is False
        del self.pins[tokens]
        blocks, parents = self._held()
        self.held_states &= blocks
        self.held_ends = {k for k in self.held_ends if k[:32] in parents}

    @rule(budget=st.integers(0, 8000))
    def evict(self, budget: int) -> None:
        before = self._stored_bytes()
        with self._step():
            report = evict_to_budget(self.b, budget)
        assert report.bytes_before == before
        assert report.bytes_after == self._stored_bytes()
        assert report.bytes_after <= budget or self._unpinned_bytes() == 0

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def within_budget(self) -> None:
        if self.bank is None:
            return
        over = self._stored_bytes() > self.config.max_bytes  # type: ignore[operator]
        assert not over or self._unpinned_bytes() == 0

    @invariant()
    def pins_hold_what_they_pinned(self) -> None:
        if self.bank is None:
            return
        self._note_held()
        hs, ends = self._headers(), self._ends()
        blocks, _ = self._held()
        assert blocks <= set(hs), "a pinned block was removed"
        assert all(hs[b].has_state for b in self.held_states), "a pinned state was removed"
        assert self.held_ends <= set(ends), "a pinned end record was removed"
        on_disk = {p.tokens for p in pins(disk(self.b))}
        assert on_disk == set(self.pins)
        index = self.b.access.index
        if index is not None:
            assert set(index.pins) == {p.key for p in pins(disk(self.b))}

    # -- helpers ---------------------------------------------------------------------
    def _held(self) -> tuple[set[bytes], set[bytes]]:
        blocks = {b for chain, _ in self.pins.values() for b in chain}
        parents = {p for _, p in self.pins.values() if p is not None}
        return blocks, parents

    def _note_held(self) -> None:
        """What pins hold now: states and end records stored since count from then on."""
        blocks, parents = self._held()
        hs = self._headers()
        self.held_states |= {b for b in blocks if b in hs and hs[b].has_state}
        self.held_ends |= {k for k in self._ends() if k[:32] in parents}

    def _pinned_bytes_with(self, tokens: list[int], chain: list[bytes]) -> int:
        blocks, parents = self._held()
        blocks |= set(chain)
        if chain:
            parent, bs = chain[-1], self.config.block_size
            end_key = parent + end_hash(parent, np.array(tokens[len(chain) * bs :], "<u4"))
            if end_key in self._ends():
                parents.add(parent)
        hs = self._headers()
        total = sum(hs[b].payload_size + hs[b].state_size for b in blocks if b in hs)
        return total + sum(len(v) for k, v in self._ends().items() if k[:32] in parents)

    def _unpinned_bytes(self) -> int:
        blocks, parents = self._held()
        total = sum(
            (0 if k in blocks else h.payload_size) + (0 if k in blocks else h.state_size)
            for k, h in self._headers().items()
        )
        return total + sum(len(v) for k, v in self._ends().items() if k[:32] not in parents)


PinnedEvictionMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPinnedEvictionMachine = PinnedEvictionMachine.TestCase
