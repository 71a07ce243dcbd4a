"""One memory budget (`blocks.hot.MemoryBudget`): the hot tier and the leases share
`BankConfig.hot_bytes`, so what they hold together never passes it, whatever a caller
stores, restores or is handed out; the least recently used entry of either goes first."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from conftest import attention_spec, prefix_layers, tokens_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig
from cas_bank.blocks.hot import MemoryBudget

B = 4
BUDGET = 12 * 1024  # a few prompts' worth: stores and restores keep evicting
SPEC = attention_spec()
_rng = np.random.default_rng(21)
_BASE = tokens_of(_rng, 6 * B)
# Prompts sharing prefixes of different lengths, and one of their own.
PROMPTS = [
    _BASE[: 3 * B] + tokens_of(_rng, 5 * B + 1),
    _BASE + tokens_of(_rng, 2 * B + 3),
    _BASE + tokens_of(_rng, 9 * B),
    tokens_of(_rng, 12 * B + 2),
]

OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store_later", "restore", "handout"]),
        st.integers(0, len(PROMPTS) - 1),
    ),
    min_size=1,
    max_size=14,
)


def _held(bank: Bank) -> tuple[int, int]:
    assert bank.hot is not None and bank.leases is not None
    return bank.hot.used_bytes, bank.leases.used_bytes


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_hot_tier_and_leases_together_stay_within_hot_bytes(ops: list[tuple[str, int]]) -> None:
    config = BankConfig(block_size=B, hot_bytes=BUDGET, write_behind=2)
    with tempfile.TemporaryDirectory() as tmp, Bank.open(Path(tmp) / "bank", config) as bank:
        ns = bank.namespace(SPEC)
        peak = 0
        for op, i in ops:
            tokens = PROMPTS[i]
            if op == "store":
                ns.store(tokens, prefix_layers(SPEC, tokens, pad=7))
            elif op == "store_later":
                ns.store_later(tokens, prefix_layers(SPEC, tokens))
            elif op == "restore":  # a runtime's: room for the rest of its prompt
                ns.restore(tokens[:-1], room_for=len(tokens))
            else:  # no room: the lease is handed out (or the read kept as one)
                ns.restore(tokens)
            bank.flush()  # the writer's share lands before the sum is read
            hot, leased = _held(bank)
            assert hot + leased <= BUDGET, (op, hot, leased)
            stats = bank.stats()
            assert (stats.hot_tier_bytes, stats.leased_bytes) == (hot, leased)
            assert stats.hot_bytes == BUDGET
            peak = max(peak, hot + leased)
        assert peak > 0


def test_the_least_recently_used_entry_of_either_tier_goes_first(tmp_path: Path) -> None:
    """A chain stored, then another that does not fit beside it: the first chain's hot
    entries and lease are the oldest, and they go (the second stays leased)."""
    a, b = PROMPTS[3], PROMPTS[2]
    per_chain = len(a) * 2 * 2 * 2 * 8 * 2  # two layers' keys and values, fp16
    config = BankConfig(block_size=B, hot_bytes=3 * per_chain, write_behind=0)
    with Bank.open(tmp_path / "bank", config) as bank:
        ns = bank.namespace(SPEC)
        ns.store(a, prefix_layers(SPEC, a))
        ns.store(b, prefix_layers(SPEC, b))
        hot, leased = _held(bank)
        assert hot + leased <= 3 * per_chain
        leases = bank.leases
        assert leases is not None
        assert leases.probe(ns.chain(b))[0] == len(b) // B  # the newest is still leased
        assert leases.probe(ns.chain(a))[0] == 0  # the oldest went first


def test_a_budget_balances_its_tenants_oldest_first() -> None:
    class Tier:
        def __init__(self, budget: MemoryBudget) -> None:
            self.budget = budget
            self.entries: list[tuple[int, int]] = []  # (tick, bytes), oldest first
            budget.join(self)

        @property
        def used_bytes(self) -> int:
            return sum(n for _, n in self.entries)

        def add(self, n: int) -> None:
            self.entries.append((self.budget.tick(), n))
            self.budget.balance()

        def oldest_tick(self) -> int | None:
            return self.entries[0][0] if self.entries else None

        def evict_oldest(self) -> bool:
            return bool(self.entries) and self.entries.pop(0) is not None

    budget = MemoryBudget(100)
    hot, leases = Tier(budget), Tier(budget)
    hot.add(40)
    leases.add(40)
    hot.add(30)  # 110: the oldest of either (hot's first) goes
    assert (hot.used_bytes, leases.used_bytes) == (30, 40)
    leases.add(50)  # 120: leases' first (older than hot's 30) goes
    assert (hot.used_bytes, leases.used_bytes) == (30, 50)
    assert budget.used_bytes <= 100 and not budget.fits(101)
