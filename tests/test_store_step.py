"""The store step of a prefill (`PrefixCache.prefill`'s, before it returns the logits)
does its work once: the cache is checked once (before the forward pass), the chain is
hashed once and the end record's place found once, on the caller's thread and the
writer's together; and the end record is in the read view and the live lease kept
before the prefill returns."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from cas_bank.runtime import PrefixCache, cache_io, cache_stores, prefill
from runtime_helpers import random_tokens, temp_bank, tiny

import cas_bank.index.view
import cas_bank.namespace
import cas_bank.write.end_records
import cas_bank.write.queued_turn
import cas_bank.write.storing
from cas_bank.namespace import Namespace

BLOCK = 16


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts of the calls that a store step should make once, from any thread."""
    counted: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(Namespace, "chain", counting("hash", Namespace.chain))
    for module in (prefill, cache_stores, cache_io):
        monkeypatch.setattr(module, "check_cache", counting("check", cache_io.check_cache))
    for module in (cas_bank.write.queued_turn, cas_bank.write.storing):
        monkeypatch.setattr(module, "check_layers", counting("check", module.check_layers))
    for module in (cas_bank.index.view, cas_bank.namespace, cas_bank.write.end_records):
        monkeypatch.setattr(module, "end_place", counting("place", module.end_place))
    yield counted


def test_a_prefills_store_checks_hashes_and_places_its_end_once(calls: Counter[str]) -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        tokens = random_tokens(np.random.default_rng(3), 5 * BLOCK + 3)
        pc.prefill(tokens, pc.new_cache())
        bank.flush()  # the writer's share counts too
        assert pc.last_end_pending is not None and pc.last_end_pending.result() > 0
        assert pc.last_pending is not None and pc.last_pending.blocks_written == 5
        assert calls == Counter(check=1, hash=1, place=1)


def test_the_end_record_and_live_lease_are_there_when_the_prefill_returns() -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        tokens = random_tokens(np.random.default_rng(4), 3 * BLOCK + 5)
        assert bank.writer is not None
        writing = bank.writer.queued  # the writer's overlay: what the view shows
        cache = pc.new_cache()
        pc.prefill(tokens, cache)
        assert bank.leases is not None and bank.leases.live_bytes > 0
        # A fetch right after, written or not: the whole prompt from the end record.
        assert pc.match([*tokens, 7]) == len(tokens)
        bank.flush()
        assert writing.entries == ()
        assert pc.match([*tokens, 7]) == len(tokens)
