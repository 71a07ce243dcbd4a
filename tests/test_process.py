"""A serving process's startup objects frozen out of the garbage collector's passes
(`cas_bank.runtime.process`); the servers' /metrics show how many (test_server.py,
test_mlx_lm_server.py)."""

from __future__ import annotations

import gc
import weakref

from cas_bank.runtime.metrics import bank_metrics, render
from cas_bank.runtime.process import freeze_startup_objects

from cas_bank import Bank


class _Node:
    me: object


def test_garbage_is_collected_first_and_the_rest_frozen(bank: Bank) -> None:
    cycle = _Node()
    cycle.me = cycle  # garbage only a collection frees
    gone = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_startup_objects()
        assert gone() is None  # collected, not frozen
        assert frozen == gc.get_freeze_count() > 1000
        assert f"cas_bank_gc_frozen_objects {frozen}" in render(bank_metrics(bank.stats()))
        later = _Node()
        later.me = later  # made after the freeze: collected as before
        gone_later = weakref.ref(later)
        del later
        gc.collect()
        assert gone_later() is None and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
