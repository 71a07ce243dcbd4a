"""A hypothesis state machine: stores (queued for the background writer, or inline),
restores, flushes, evictions and reopens against a plain model of what the bank has
accepted; every restore and `match` covers exactly what the model says, bit for bit.

The model: the full-block prefixes of every prompt stored, and the prompts whose end
record was stored (with their blocks). On an attention model a restore covers the
longest prefix the query shares with any of them: the matched blocks, an end record,
or a partial block (the child of the last matched block sharing the most of the
query's next tokens). On a hybrid model (recurrent states, stored at every boundary
of some prompts and at the end of an end record's) it covers the deepest matched
boundary with a state, or an end record under the last matched block that prefixes
the query, whichever reaches further.

The writer can be held (a job that waits, queued first): stores queued then stay
queued, deterministically, while restores, inline stores and evictions run. An
eviction of everything then leaves exactly what is still queued.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from conftest import (
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    state_bits,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from cas_bank import Bank, BankConfig, ModelSpec
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.namespace import Namespace

B = 4
DEPTH = 64  # the writer's queue: more than a run queues while held
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=13)  # few ids: shared prefixes


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def state_of(spec: ModelSpec, prefix: tuple[int, ...]) -> list[Any]:
    """A recurrent state that is a function of the prefix it ends (as a model's is)."""
    return random_state(spec, seed=hash(prefix) & 0xFFFFFFFF)


class Accepted:
    """What the bank holds for a restore: block prefixes, prefixes with a boundary
    state (hybrid) and end-record prompts."""

    def __init__(self, hybrid: bool) -> None:
        self.hybrid = hybrid
        self.blocks: set[tuple[int, ...]] = set()
        self.states: set[tuple[int, ...]] = set()
        self.ends: set[tuple[int, ...]] = set()

    def add(self, prompt: tuple[int, ...], end: bool, states: bool) -> None:
        full = len(prompt) // B
        self.blocks.update(prompt[: (i + 1) * B] for i in range(full))
        if states:
            self.states.update(prompt[: (i + 1) * B] for i in range(full))
        if end:
            self.ends.add(prompt)

    def covered(self, query: tuple[int, ...]) -> int:
        if not self.hybrid:
            return max((shared(query, s) for s in self.blocks | self.ends), default=0)
        m = 0
        while m < len(query) // B and query[: (m + 1) * B] in self.blocks:
            m += 1
        state = max((b * B for b in range(1, m + 1) if query[: b * B] in self.states), default=0)
        ends = [len(e) for e in self.ends if len(e) // B == m and query[: len(e)] == e]
        return max([state, *ends])


Stored = tuple[tuple[int, ...], bool, bool]  # a prompt, with its end record, with states


class ReadViewMachine(RuleBasedStateMachine):
    spec: ModelSpec = attention_spec(n_layers=1)

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cas_bank_view_"))
        self.hot = 0
        self.bank = self._open()
        self.accepted = Accepted(self.spec.is_hybrid)
        self.gate: threading.Event | None = None  # set: the writer is held
        self.queued: list[Stored] = []  # stored while held
        self.stored: list[list[int]] = []  # every prompt stored: queries go near them

    def _open(self) -> Bank:
        config = BankConfig(block_size=B, write_behind=DEPTH, hot_bytes=self.hot)
        return Bank.open(self.dir / "bank", config)

    @property
    def ns(self) -> Namespace:
        return self.bank.namespace(self.spec)

    def _input(self, prompt: list[int], states: bool) -> tuple[Any, Any, Any]:
        """The prompt's KV, its boundary states (hybrid, if asked) and its end state."""
        if not self.spec.is_hybrid:
            return prefix_layers(self.spec, prompt), None, None
        offered = {
            b: state_of(self.spec, tuple(prompt[:b]))
            for b in range(B, len(prompt) + 1, B)
            if states
        }
        return prefix_layers(self.spec, prompt), offered, state_of(self.spec, tuple(prompt))

    @rule(prompt=prompts, end=st.booleans(), states=st.booleans())
    def store_queued(self, prompt: list[int], end: bool, states: bool) -> None:
        layers, offered, at_end = self._input(prompt, states)
        self.ns.store_later(prompt, layers, offered)
        if end:
            self.ns.store_end_later(prompt, layers, at_end)
        self.accepted.add(tuple(prompt), end, states)
        self.stored.append(prompt)
        if self.gate is not None:
            self.queued.append((tuple(prompt), end, states))

    @rule(prompt=prompts, end=st.booleans(), states=st.booleans())
    def store_inline(self, prompt: list[int], end: bool, states: bool) -> None:
        layers, offered, at_end = self._input(prompt, states)
        self.ns.store(prompt, layers, offered)
        if end:
            self.ns.store_end(prompt, layers, at_end)
        self.accepted.add(tuple(prompt), end, states)
        self.stored.append(prompt)

    @precondition(lambda self: bool(self.stored))
    @rule(which=st.integers(0, 1 << 16), cut=st.integers(0, 13), extra=prompts)
    def restore_near(self, which: int, cut: int, extra: list[int]) -> None:
        """A query that shares a prefix with a prompt stored: its first `cut` tokens."""
        self.restore(self.stored[which % len(self.stored)][:cut] + extra)

    @rule(query=prompts)
    def restore(self, query: list[int]) -> None:
        spec = self.spec
        want = self.accepted.covered(tuple(query))
        hit = self.ns.restore(query)
        got = hit.tokens if hit is not None else 0
        assert got == want, (query, got, want)
        if hit is not None:
            expected = kv_prefix_bits(prefix_layers(spec, query), spec, got)
            assert layers_bits(hit.layers, spec) == expected
            if spec.is_hybrid:
                state = state_of(spec, tuple(query[:got]))
                assert state_bits(hit.layers, spec) == state_bits(state, spec)
        assert self.ns.match(query) == want

    @precondition(lambda self: self.gate is None)
    @rule()
    def hold(self) -> None:
        """Hold the writer: a job queued first that waits (what follows stays queued)."""
        self.bank.flush()
        gate = threading.Event()
        writer = self.bank.writer
        assert writer is not None
        writer.submit(lambda: gate.wait(60))
        self.gate, self.queued = gate, []

    @precondition(lambda self: self.gate is not None)
    @rule()
    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self.gate = None
        self.bank.flush()

    @precondition(lambda self: self.gate is None)
    @rule()
    def flush(self) -> None:
        self.bank.flush()

    @rule()
    def evict_everything(self) -> None:
        """Evict every written record: what is still queued (held) is all that stays."""
        if self.gate is None:
            self.bank.flush()
        evict_to_budget(self.bank, 0)
        self.accepted = Accepted(self.spec.is_hybrid)
        for prompt, end, states in self.queued if self.gate is not None else []:
            self.accepted.add(prompt, end, states)

    @precondition(lambda self: self.gate is None)
    @rule(hot=st.sampled_from([0, 1 << 20]))
    def reopen(self, hot: int) -> None:
        self.bank.close()
        self.hot = hot
        self.bank = self._open()

    def teardown(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.bank.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class HybridReadViewMachine(ReadViewMachine):
    spec = hybrid_spec()


def machine_settings(examples: int) -> settings:
    """Small runs, the same every time (a failure here is one to reproduce as it is)."""
    return settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


ReadViewMachine.TestCase.settings = machine_settings(25)
HybridReadViewMachine.TestCase.settings = machine_settings(35)
test_read_view_machine = ReadViewMachine.TestCase
test_read_view_machine_hybrid = HybridReadViewMachine.TestCase
