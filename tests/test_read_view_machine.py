"""A hypothesis state machine: stores (queued for the background writer, or inline),
restores, flushes, evictions and reopens against a plain model of what the bank has
accepted; every restore and `match` covers exactly what the model says, bit for bit.

The model: the full-block prefixes of every prompt stored, and the prompts whose end
record was stored (with their blocks). A restore covers the longest prefix the query
shares with any of them: the matched blocks, an end record, or a partial block (the
child of the last matched block sharing the most of the query's next tokens).

The writer can be held (a job that waits, queued first): stores queued then stay
queued, deterministically, while restores, inline stores and evictions run. An
eviction of everything then leaves exactly what is still queued.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from conftest import attention_spec, kv_prefix_bits, layers_bits, prefix_layers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from cas_bank import Bank, BankConfig
from cas_bank.index.evict import evict_to_budget
from cas_bank.namespace import Namespace

SPEC = attention_spec(n_layers=1)
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


class Accepted:
    """What the bank holds for a restore: block prefixes and end-record prompts."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, ...]] = set()
        self.ends: set[tuple[int, ...]] = set()

    def add(self, prompt: tuple[int, ...], end: bool) -> None:
        full = len(prompt) // B
        self.blocks.update(prompt[: (i + 1) * B] for i in range(full))
        if end:
            self.ends.add(prompt)

    def covered(self, query: tuple[int, ...]) -> int:
        return max((shared(query, s) for s in self.blocks | self.ends), default=0)


class ReadViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cas_bank_view_"))
        self.hot = 0
        self.bank = self._open()
        self.accepted = Accepted()
        self.gate: threading.Event | None = None  # set: the writer is held
        self.queued: list[tuple[tuple[int, ...], bool]] = []  # stored while held

    def _open(self) -> Bank:
        config = BankConfig(block_size=B, write_behind=DEPTH, hot_bytes=self.hot)
        return Bank.open(self.dir / "bank", config)

    @property
    def ns(self) -> Namespace:
        return self.bank.namespace(SPEC)

    @rule(prompt=prompts, end=st.booleans())
    def store_queued(self, prompt: list[int], end: bool) -> None:
        layers = prefix_layers(SPEC, prompt)
        self.ns.store_later(prompt, layers)
        if end:
            self.ns.store_end_later(prompt, layers)
        self.accepted.add(tuple(prompt), end)
        if self.gate is not None:
            self.queued.append((tuple(prompt), end))

    @rule(prompt=prompts, end=st.booleans())
    def store_inline(self, prompt: list[int], end: bool) -> None:
        layers = prefix_layers(SPEC, prompt)
        self.ns.store(prompt, layers)
        if end:
            self.ns.store_end(prompt, layers)
        self.accepted.add(tuple(prompt), end)

    @rule(query=prompts)
    def restore(self, query: list[int]) -> None:
        want = self.accepted.covered(tuple(query))
        hit = self.ns.restore(query)
        got = hit.tokens if hit is not None else 0
        assert got == want, (query, got, want)
        if hit is not None:
            expected = kv_prefix_bits(prefix_layers(SPEC, query), SPEC, got)
            assert layers_bits(hit.layers, SPEC) == expected
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
        self.accepted = Accepted()
        for prompt, end in self.queued if self.gate is not None else []:
            self.accepted.add(prompt, end)

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


ReadViewMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_read_view_machine = ReadViewMachine.TestCase
