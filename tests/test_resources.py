"""A bank's own restore resources (`cas_bank.restore.resources`): spares, their thread and
copies ahead come with `Bank.open` and its defaults (no process-wide call), stay
within `BankConfig.spare_bytes` (shown by `stats()`), belong to one bank, and stop
with `close()` (the thread joined, the arrays released). Real MLX, a real bank."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import kv_prefix_bits, prefix_layers

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.restore.spares import keep_spare_destinations

SPEC = ModelSpec(
    name="owned",
    layers=tuple(LayerSpec.attention(kv_heads=4, head_dim=256, dtype="float16") for _ in "ab"),
    weights_digest="w-owned",
)
TOKENS = [int(t) for t in np.arange(256) % 97]


def _spares_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cas_bank-spares"]


def test_a_bank_with_default_settings_restores_into_arrays_made_ahead(
    bank_path: Path,
) -> None:
    """No process setting: the second restore takes every array from the bank's own
    spares, bit-exact; stats show what they hold within their bound; close joins the
    thread and releases them."""
    assert not _spares_threads()
    layers = prefix_layers(SPEC, TOKENS)
    bank = Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0))
    try:
        spares = bank.resources.spares
        ns = bank.namespace(SPEC)
        ns.store(TOKENS, layers)
        first = ns.restore(TOKENS, room_for=300)
        bank.resources.settle()
        held = bank.stats()
        assert 0 < held.spare_held_bytes <= held.spare_bytes == BankConfig().spare_bytes
        second = ns.restore(TOKENS, room_for=300)
        assert first is not None and second is not None
        assert spares.taken == 4  # every array of the second restore made ahead
        want = kv_prefix_bits(layers, SPEC, 256)
        assert kv_prefix_bits(second.layers, SPEC, 256) == want
        assert len(_spares_threads()) == 1
    finally:
        bank.close()
    assert not _spares_threads()  # joined
    assert spares.bytes == 0 and not spares._pool and not spares._filled
    assert kv_prefix_bits(second.layers, SPEC, 256) == want  # handed out: still the caller's


def test_spare_bytes_zero_keeps_nothing_and_starts_no_thread(bank_path: Path) -> None:
    layers = prefix_layers(SPEC, TOKENS)
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0, spare_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(TOKENS, layers)
        for _ in range(2):
            hit = ns.restore(TOKENS, room_for=300)
            assert hit is not None
            assert kv_prefix_bits(hit.layers, SPEC, 256) == kv_prefix_bits(layers, SPEC, 256)
            bank.resources.settle()
        assert bank.stats().spare_held_bytes == 0 and bank.resources.spares.made == 0
        assert not _spares_threads()


def test_spares_stay_within_their_bound(bank_path: Path) -> None:
    """A bound below one restore's set (2 MiB here, the set 4 x 1.2 MiB): nothing made."""
    layers = prefix_layers(SPEC, TOKENS)
    config = BankConfig(block_size=64, hot_bytes=0, spare_bytes=2 << 20)
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(SPEC)
        ns.store(TOKENS, layers)
        for _ in range(3):
            assert ns.restore(TOKENS, room_for=300) is not None
            bank.resources.settle()
            assert bank.stats().spare_held_bytes <= 2 << 20
        assert bank.resources.spares.made == 0


def test_each_bank_has_its_own_pool_and_closing_one_leaves_the_other(
    tmp_path: Path,
) -> None:
    layers = prefix_layers(SPEC, TOKENS)
    banks = [Bank.open(tmp_path / name, BankConfig(block_size=64, hot_bytes=0)) for name in "ab"]
    try:
        for bank in banks:
            bank.namespace(SPEC).store(TOKENS, layers)
        a, b = banks
        a.namespace(SPEC).restore(TOKENS, room_for=300)
        a.resources.settle()
        assert a.resources.spares.bytes > 0 and b.resources.spares.bytes == 0
        b.namespace(SPEC).restore(TOKENS, room_for=300)  # finds none of a's
        assert b.resources.spares.taken == 0
        b.resources.settle()
        a.close()
        assert a.resources.spares.bytes == 0 and len(_spares_threads()) == 1
        hit = b.namespace(SPEC).restore(TOKENS, room_for=300)
        assert hit is not None and b.resources.spares.taken == 4
        assert kv_prefix_bits(hit.layers, SPEC, 256) == kv_prefix_bits(layers, SPEC, 256)
    finally:
        for bank in banks:
            bank.close()  # twice for a: a no-op
    assert not _spares_threads()


def test_the_old_process_wide_switch_warns_and_checks_its_input() -> None:
    with pytest.warns(DeprecationWarning, match="BankConfig.spare_bytes"):
        keep_spare_destinations(1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
            keep_spare_destinations(-1)


def test_spare_bytes_is_a_setting_of_non_negative_bytes() -> None:
    assert BankConfig(spare_bytes=0).spare_bytes == 0
    with pytest.raises(ValueError, match="spare_bytes"):
        BankConfig(spare_bytes=-1)


def _alive_native_ids() -> set[int | None]:
    return {t.native_id for t in threading.enumerate()}


def test_each_bank_has_its_own_helper_threads_and_close_joins_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the helper threads on (`CAS_BANK_RESTORE_THREADS=2`), a bank's restore
    shares its copies with that bank's helper threads (`restore.workers`, here: blocks
    of the hot tier, 8 MiB, copied on two threads); two banks, two sets; closing one
    joins its threads while the other restores on."""
    monkeypatch.setenv("CAS_BANK_RESTORE_THREADS", "2")
    tokens = [int(t) for t in np.arange(1024) % 97]
    layers = prefix_layers(SPEC, tokens)
    config = BankConfig(block_size=64, file_min_bytes=None, write_behind=0)
    for name in "ab":
        with Bank.open(tmp_path / name, config) as bank:
            bank.namespace(SPEC).store(tokens, layers)
    want = kv_prefix_bits(layers, SPEC, 1024)
    banks = [Bank.open(tmp_path / name, config) for name in "ab"]
    try:
        for bank in banks:
            for _ in range(2):  # the second from the hot tier: copied on two threads
                hit = bank.namespace(SPEC).restore(tokens, room_for=1100)
                assert hit is not None and kv_prefix_bits(hit.layers, SPEC, 1024) == want
        a, b = (set(bank.resources.workers.tids) for bank in banks)
        assert len(a) == len(b) == 3 and not a & b  # the pool's two and the partner each
        assert a | b <= _alive_native_ids()
        banks[0].close()
        assert not a & _alive_native_ids()  # joined
        assert b <= _alive_native_ids()
        hit = banks[1].namespace(SPEC).restore(tokens, room_for=1100)
        assert hit is not None and kv_prefix_bits(hit.layers, SPEC, 1024) == want
        assert set(banks[1].resources.workers.tids) == b
    finally:
        for bank in banks:
            bank.close()
    assert not (a | b) & _alive_native_ids()


def test_restore_threads_is_one_or_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CAS_BANK_RESTORE_THREADS=1` (the default): no helper threads at all; 2 turns
    them on; anything but 1 or 2 is an error naming the variable."""
    from cas_bank.restore.resources import Resources

    monkeypatch.setenv("CAS_BANK_RESTORE_THREADS", "1")
    alone = Resources(0)
    assert alone.threads == 1 and alone.workers.threads == 0
    alone.close()
    monkeypatch.setenv("CAS_BANK_RESTORE_THREADS", "3")
    with pytest.raises(ValueError, match="CAS_BANK_RESTORE_THREADS must be 1 or 2"):
        Resources(0)
    monkeypatch.setenv("CAS_BANK_RESTORE_THREADS", "2")
    assert Resources(0).threads == 2
    monkeypatch.delenv("CAS_BANK_RESTORE_THREADS")
    assert Resources(0).threads == 1
    with pytest.raises(ValueError, match="threads must be 1 or 2"):
        Resources(0, threads=0)


def test_a_reopened_bank_makes_the_spares_it_closed_with_from_its_open(
    bank_path: Path,
) -> None:
    """The shapes a bank's restores wanted are kept at close; the next open has them
    made (within the bound) by its spares' thread, so that its first restore takes
    every array from them, bit-exact; its namespace makes the shapes that restore
    checks; a tool's open (no spares) makes none; close joins the thread and frees them."""
    layers = prefix_layers(SPEC, TOKENS)
    want = kv_prefix_bits(layers, SPEC, 256)
    config = BankConfig(block_size=64, hot_bytes=0)
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(SPEC)
        ns.store(TOKENS, layers)
        assert ns.restore(TOKENS, room_for=300) is not None
        recorded = bank.resources.spares.wanted_recently()
    assert [n for _, n in recorded] == [4]  # one shape (K and V of both layers), 4 arrays
    tools = BankConfig(block_size=64, hot_bytes=0, spare_bytes=0)  # as tools/common.py opens
    with Bank.open(bank_path, tools) as bank:
        bank.namespace(SPEC)
        assert not _spares_threads() and bank.resources.spares.made == 0
    bank = Bank.open(bank_path, config)
    try:
        spares = bank.resources.spares
        assert len(_spares_threads()) == 1  # started by the open, before any namespace
        assert len(bank.resources.shapes) == 0
        ns = bank.namespace(SPEC)
        assert len(bank.resources.shapes) == 1  # what a restore into 512 rows allocates
        bank.resources.settle()
        held = bank.stats()
        assert spares.made == 4 and held.spare_held_bytes == 4 * 512 * 4 * 256 * 2
        assert held.spare_held_bytes <= held.spare_bytes
        hit = ns.restore(TOKENS, room_for=300)
        assert hit is not None and spares.taken == 4  # the first restore: all made ahead
        assert len(bank.resources.shapes) == 1  # and its shapes found made
        assert kv_prefix_bits(hit.layers, SPEC, 256) == want
        assert spares.wanted_recently() == recorded
    finally:
        bank.close()
    assert not _spares_threads() and spares.bytes == 0 and not spares._pool
    assert kv_prefix_bits(hit.layers, SPEC, 256) == want  # handed out: the caller's


def test_spares_made_at_open_stay_within_the_reopened_banks_bound(bank_path: Path) -> None:
    """Recorded under a large bound, reopened under one that holds only the most recent
    restore's set: that set is made, nothing of the older one (and its close keeps what
    it held); with 0, nothing and no thread, and the record is left as it was."""
    config = BankConfig(block_size=64, hot_bytes=0)
    long_tokens = TOKENS * 4  # 1024 tokens: arrays of 1280 rows, another shape
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(SPEC)
        ns.store(long_tokens, prefix_layers(SPEC, long_tokens))
        assert ns.restore(long_tokens, room_for=1100) is not None
        assert ns.restore(TOKENS, room_for=300) is not None  # the most recent
        recorded = bank.resources.spares.wanted_recently()
    assert [w[0][-2] for w, _ in recorded] == [1280, 512]
    small = 4 * 512 * 4 * 256 * 2  # the 512-row set's bytes
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0, spare_bytes=small)) as bank:
        bank.resources.settle()
        assert bank.stats().spare_held_bytes == small
        assert [w[0][-2] for w, _ in bank.resources.spares.wanted_recently()] == [512]
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0, spare_bytes=0)) as bank:
        assert not _spares_threads() and bank.stats().spare_held_bytes == 0
    with Bank.open(bank_path, config) as bank:  # the small bound's record, not the 0's
        bank.resources.settle()
        assert [w[0][-2] for w, _ in bank.resources.spares.wanted_recently()] == [512]


def test_a_record_that_does_not_read_makes_no_spares(bank_path: Path) -> None:
    from cas_bank.bank import _KEY_SPARES
    from cas_bank.blocks.store import Family

    config = BankConfig(block_size=64, hot_bytes=0)
    for raw in (b"not json", b'[[[4, 0], "float16", 1]]', b'[[[4], "float99", 1]]', b"7"):
        with Bank.open(bank_path, config) as bank, bank.transaction(budget=False) as tx:
            tx.put(Family.META, _KEY_SPARES, raw)
        with Bank.open(bank_path, config) as bank:
            assert not _spares_threads() and bank.resources.spares.made == 0


def test_close_stops_a_making_under_way_at_its_next_array() -> None:
    from cas_bank.arrays import DTYPES
    from cas_bank.restore import spares as spares_module

    wanted = [((1, 4, 256, 256), DTYPES["float16"])] * 5
    asked = iter([False, False, True])
    made = spares_module._made_ahead(wanted, lambda: next(asked))
    assert len(made) == 2 and all(d.view.shape == (1, 4, 256, 256) for d in made)


def test_capacities_of_recorded_spares_are_those_of_the_specs_arrays() -> None:
    from cas_bank.arrays import DTYPES
    from cas_bank.restore.spares import capacities_of

    f16, f32 = DTYPES["float16"], DTYPES["float32"]
    one = [((1, 4, 1, 256), f16)]
    recorded = [
        (((1, 4, 512, 256), f16), 4),
        (((1, 4, 1280, 256), f32), 4),  # another dtype
        (((1, 8, 768, 256), f16), 2),  # another head count
        (((1, 4, 1280, 256), f16), 4),
        (((4, 256), f16), 1),  # a state's
        (((1, 4, 512, 256), f16), 2),  # again
    ]
    assert capacities_of(one, recorded) == [512, 1280]
    assert capacities_of([], recorded) == []
