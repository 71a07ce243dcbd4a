"""The eviction policies (`BankConfig.eviction_policy`): `lfu` (the default) keeps what
is used often over what was used once more recently, and ages (a block popular once
goes when newer blocks have outranked it); `lru` is least recently used first. Use
counts count each use once. The benchmark (`benchmarks/eviction_policy.py`) runs.
The orders of tests/test_evict.py and the invariants of tests/test_evict_machine.py
hold under the default; the machine with pins runs both policies.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, REPO_ROOT, attention_spec
from pydantic import ValidationError
from test_evict import FakeClock, order, store_at

from cas_bank import Bank, BankConfig
from cas_bank.evict.eviction import evict_to_budget

if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level package beside cas_bank
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import eviction_policy

B = BLOCK_SIZE


def open_bank(path: Path, policy: str | None) -> tuple[Bank, FakeClock]:
    """A bank with a budget (never reached here): lfu counts uses from the first store."""
    settings = {} if policy is None else {"eviction_policy": policy}
    config = BankConfig(block_size=B, max_bytes=1 << 30, **settings)  # type: ignore[arg-type]
    bank = Bank.open(path, config)
    clock = FakeClock()
    bank.access.set_clock(clock)
    return bank, clock


@pytest.mark.parametrize("policy", [None, "lfu", "lru"])
def test_a_block_used_often_outlives_a_newer_one_used_once_under_lfu(
    bank_path: Path, policy: str | None
) -> None:
    bank, clock = open_bank(bank_path, policy)
    with bank:
        assert bank.access.policy == (policy or "lfu")
        ns = bank.namespace(attention_spec())
        shared = store_at(clock, 1, ns, [1] * B, 1).chain  # a system prompt...
        for t in (2, 3, 4):
            clock.now = t  # ...restored by three agents
            assert ns.restore([1] * B) is not None
        once = store_at(clock, 5, ns, [2] * B, 2).chain  # a one-off prompt, newer
        report = evict_to_budget(bank, 0)
        if policy == "lru":
            assert order(report.evicted) == [("block", shared[0]), ("block", once[0])]
        else:
            assert order(report.evicted) == [("block", once[0]), ("block", shared[0])]


def test_lfu_ages_what_was_popular_once(bank_path: Path) -> None:
    """A use ranks a block at the aging floor (the last victim's rank) plus its uses:
    a block used twice long ago goes once one-off blocks stored since rank with it."""
    bank, clock = open_bank(bank_path, "lfu")
    with bank:
        ns = bank.namespace(attention_spec())
        old = store_at(clock, 1, ns, [1] * B, 1).chain[0]
        clock.now = 2
        ns.restore([1] * B)  # two uses: rank 2
        one_block = bank.stats().payload_bytes
        ones, gone = [], []
        for k in range(4):  # a one-off each turn; the bank keeps one block
            ones.append(store_at(clock, 3 + k, ns, [10 + k] * B, k).chain[0])
            gone += [e.chain_hash for e in evict_to_budget(bank, one_block).evicted]
        # o0 (rank 1) goes: the floor is 1. o1 (rank 2) ties with old, which is older:
        # old goes, the floor is 2. Then each one-off goes before the next.
        assert gone == [ones[0], old, ones[1], ones[2]]
        assert bank.access.index is not None and bank.access.index.age == 3


def test_a_use_counts_once_however_often_it_is_written(bank_path: Path) -> None:
    bank, clock = open_bank(bank_path, "lfu")
    with bank:
        ns = bank.namespace(attention_spec())
        chain = store_at(clock, 1, ns, [1] * 2 * B, 1).chain
        index = bank.access.index  # built by the first store: one use each

        assert index is not None and [index.nodes[h].uses for h in chain] == [1, 1]
        clock.now = 2
        ns.restore([1] * 2 * B)  # a restore's use, in memory...
        bank.flush()  # ...then written: the same use
        store_at(clock, 2, ns, [1] * 2 * B, 1)  # a store at the same time: the same use
        assert [index.nodes[h].uses for h in chain] == [2, 2]
        store_at(clock, 3, ns, [1] * 2 * B, 1)
        assert [index.nodes[h].uses for h in chain] == [3, 3]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValidationError, match="eviction_policy"):
        BankConfig(eviction_policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="pin_share"):
        BankConfig(pin_share=1.5)


def test_the_benchmark_runs_and_counts_every_token() -> None:
    s = eviction_policy.Settings(requests=120, budgets_tokens=(4096,), conversations=4)
    out = eviction_policy.run(s)
    assert {r["policy"] for r in out["results"]} == {"lfu", "lru"}
    for r in out["results"]:
        kinds = r["by_kind"].values()
        assert r["requests"] == 120 == sum(k["requests"] for k in kinds)
        assert r["prefilled_tokens"] == r["prompt_tokens"] - r["restored_tokens"] > 0
        assert r["by_kind"]["one_off"]["restored_tokens"] == 0  # never sent again
        assert r["blocks_evicted"] > 0  # the budget was reached
    assert "lfu" in eviction_policy.table(out)
