"""Spare destination arrays (`cas_bank.restore.spares`): a restore takes arrays made ahead of
it, each handed out once, within the byte bound, and restores stay bit-exact and never
share a buffer. Real MLX arrays and a real bank."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache, PrefixCache
from conftest import kv_prefix_bits, prefix_layers
from runtime_helpers import tiny

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.arrays import DTYPES, to_numpy
from cas_bank.restore.destinations import UNFILLED_FROM
from cas_bank.restore.spares import Filled, Spares, spare_set

F16 = DTYPES["float16"]
BIG = ((1, 4, 256, 512), F16)  # 1 MiB: kept unfilled, so spared
SMALL = ((1, 2, 4, 8), F16)  # zero-filled instead: never spared


@pytest.fixture
def spares() -> Iterator[Spares]:
    pool = Spares()
    yield pool
    pool.close()  # drops what it holds


def test_spares_are_taken_once_each_and_refilled_off_the_path(spares: Spares) -> None:
    assert spares.take([BIG], UNFILLED_FROM) == {}  # off until enabled
    spares.enable(16 << 20)
    assert spares.take([BIG, SMALL, BIG], UNFILLED_FROM) == {}  # nothing made yet
    spares.refill([BIG, SMALL, BIG], UNFILLED_FROM)
    spares.settle()
    assert (spares.made, spares.bytes) == (2, 2 << 20)
    got = spares.take([SMALL, BIG, BIG, BIG], UNFILLED_FROM)
    assert sorted(got) == [1, 2]  # two made, the third BIG and the small one not
    a, b = got[1].finish(), got[2].finish()
    assert a.shape == b.shape == BIG[0] and a.dtype == b.dtype == mx.float16
    np.asarray(a)[...] = 1  # two buffers: writing one leaves the other as it was
    np.asarray(b)[...] = 2
    assert int(np.asarray(a).max()) == 1
    assert spares.take([BIG], UNFILLED_FROM) == {} and spares.bytes == 0


def test_spares_keep_within_their_bound(spares: Spares) -> None:
    spares.enable(1 << 20)  # room for one BIG
    spares.refill([BIG, BIG], UNFILLED_FROM)  # a set over the bound: not made
    spares.settle()
    assert spares.made == 0
    other = ((1, 4, 512, 256), F16)
    spares.refill([BIG], UNFILLED_FROM)
    spares.settle()
    spares.refill([other], UNFILLED_FROM)
    spares.settle()
    assert spares.bytes <= 1 << 20  # the older shape dropped for the newer
    assert spares.take([BIG], UNFILLED_FROM) == {}
    assert list(spares.take([other], UNFILLED_FROM)) == [0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])  # bf16: a view of the bits
def test_restores_with_spares_are_bit_exact_and_share_no_buffer(
    bank_path: Path, dtype: str
) -> None:
    """The second restore's arrays all come from the pool, made on the spares' thread
    (a bf16 destination is a view of uint16 bits, evaluated there)."""
    spec = ModelSpec(
        name="spared",
        layers=tuple(LayerSpec.attention(kv_heads=4, head_dim=256, dtype=dtype) for _ in "ab"),
        weights_digest="w-spared",
    )
    tokens = [int(t) for t in np.arange(256) % 97]
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0, spare_bytes=64 << 20)) as bank:
        spares = bank.resources.spares
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        first = ns.restore(tokens, room_for=300)
        spares.settle()
        taken = spares.taken
        second = ns.restore(tokens, room_for=300)
        assert first is not None and second is not None
        assert spares.taken == taken + 4  # every array of the second from the pool
        want = kv_prefix_bits(layers, spec, 256)
        for hit in (first, second):
            assert kv_prefix_bits(hit.layers, spec, 256) == want
        to_numpy(first.layers[0][0])[...] = 0  # the first's memory, not the second's
        assert kv_prefix_bits(second.layers, spec, 256) == want
    assert spares.bytes == 0  # released by close


def test_a_set_the_pool_cannot_make_leaves_it_working(spares: Spares) -> None:
    """Making a set fails (a dtype MLX has no such type for): the failure is logged,
    the thread lives on, and the next take and refill do not wait for ever."""
    import threading
    from dataclasses import replace

    spares.enable(16 << 20)
    spares.refill([(BIG[0], replace(F16, mx_dtype="nonesuch"))], UNFILLED_FROM)
    done = threading.Event()

    def after() -> None:
        spares.settle()  # the failed set counts as done
        spares.take([BIG], UNFILLED_FROM)
        spares.refill([BIG], UNFILLED_FROM)
        spares.settle()
        done.set()

    threading.Thread(target=after, daemon=True).start()
    assert done.wait(30), "settle() waited for a refill that never finishes"
    assert list(spares.take([BIG], UNFILLED_FROM)) == [0]


# Refills on the spares' thread while this thread runs MLX and calls mx.clear_cache()
# (as mlx-lm does during prefill): with MLX's load of a Python stream on the spares'
# thread the two deadlocked within a second, every run (see cas_bank/restore/spares.py).
_BESIDE_CLEAR_CACHE = """
import sys, threading, time
import mlx.core as mx
from cas_bank.arrays import DTYPES
from cas_bank.restore.spares import Spares
SHARED_SPARES = Spares(1 << 28)
wanted = [((1, 4, 256, 64), DTYPES["float16"])] * 16
stop = time.monotonic() + 2.0
def refills():
    while time.monotonic() < stop:
        SHARED_SPARES.take(wanted, 0)
        SHARED_SPARES.refill(wanted, 0)
thread = threading.Thread(target=refills)
thread.start()
x = mx.ones((64, 64))
while time.monotonic() < stop:
    mx.eval(x @ x)
    mx.clear_cache()
thread.join()
SHARED_SPARES.settle()
SHARED_SPARES.close()
print("made", SHARED_SPARES.made)
"""


def test_refills_beside_mlx_clear_cache_on_another_thread_do_not_deadlock() -> None:
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _BESIDE_CLEAR_CACHE], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) > 16  # refills ran, more than one set


def test_a_grouped_set_takes_and_refills_as_its_list_does(spares: Spares) -> None:
    """`spare_set` (made once per set of shapes, as a restore's Assembler keeps it)
    asks the pool the same as the list it groups: the same indices come back."""
    other = ((1, 4, 512, 256), F16)
    wanted = [BIG, SMALL, other, BIG, other, BIG]
    grouped = spare_set(wanted, UNFILLED_FROM)
    assert grouped.flat == (BIG, other, BIG, other, BIG)
    assert [ix for _, ix, _ in grouped.groups] == [(0, 3, 5), (2, 4)]
    assert grouped.nbytes == 5 << 20
    spares.enable(16 << 20)
    spares.refill(grouped)
    spares.settle()
    assert spares.made == 5 and spares.bytes == 5 << 20
    got = spares.take([SMALL, BIG, other, BIG], UNFILLED_FROM)
    assert sorted(got) == [1, 2, 3]
    assert sorted(spares.take(grouped)) == [0, 2]  # one of each left
    spares.refill(grouped)  # up to three BIG and two other
    spares.settle()
    assert spares.made == 10
    assert sorted(spares.take(grouped)) == [0, 2, 3, 4, 5]
    assert spares.bytes == 0


def _hot_spec(dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec(
        name="ahead",
        layers=tuple(LayerSpec.attention(kv_heads=4, head_dim=256, dtype=dtype) for _ in "abc"),
        weights_digest="w-ahead",
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_lease_restored_again_is_copied_ahead_bit_exact(bank_path: Path, dtype: str) -> None:
    """From a lease's second restore with room, the spares' thread copies it ahead:
    the third restore takes that copy whole (no copy on its path), bit-exact, in memory
    of its own (not the lease's, not the restore's before it); a restore of other rows
    (a prefix of the lease) finds none made for it and copies as before."""
    spec = _hot_spec(dtype)
    tokens = [int(t) for t in np.arange(256) % 89]
    layers = prefix_layers(spec, tokens)
    want = kv_prefix_bits(layers, spec, 256)
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=64 << 20)) as bank:
        spares = bank.resources.spares
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        hits = []
        for round_ in range(4):
            spares.settle()
            before = spares.filled_taken
            hits.append(ns.restore(tokens, room_for=300))
            # Rounds 0 and 1 copy on the path; round 1 asks for the copy ahead.
            assert spares.filled_taken == before + (1 if round_ >= 2 else 0)
        leased = [to_numpy(a) for e in bank.leases._entries.values() for a in e.arrays]
        for hit in hits:
            assert hit is not None and hit.tokens == 256
            assert kv_prefix_bits(hit.layers, spec, 256) == want
            mine = [to_numpy(a) for layer in hit.layers for a in layer]
            assert not any(np.shares_memory(m, x) for m in mine for x in leased)
        for a, b in itertools.combinations(hits, 2):
            assert not any(
                np.shares_memory(to_numpy(x), to_numpy(y))
                for x in (a.layers[0][0], a.layers[2][1])
                for y in (b.layers[0][0], b.layers[2][1])
            )
        spares.settle()
        before = spares.filled_taken
        shorter = ns.restore(tokens[:192], room_for=300)  # 3 blocks: other rows
        assert shorter is not None and spares.filled_taken == before
        assert kv_prefix_bits(shorter.layers, spec, 192) == kv_prefix_bits(layers, spec, 192)
    assert spares.bytes == 0


def test_a_lease_restored_once_is_not_copied_ahead_and_a_gone_one_is_not_used(
    bank_path: Path,
) -> None:
    """One restore with room asks for no copy ahead; once a lease is dropped (cleared
    here, as eviction does) the copy made of it is never handed out: the restore
    reads the blocks from the bank instead, bit-exact."""
    spec = _hot_spec()
    tokens = [int(t) for t in np.arange(256) % 83]
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=64 << 20)) as bank:
        spares = bank.resources.spares
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        made = spares.made
        ns.restore(tokens, room_for=300)
        spares.settle()
        made_once = spares.made - made  # plain spares only
        ns.restore(tokens, room_for=300)
        spares.settle()
        assert spares.made - made > made_once  # the copy ahead made too
        assert bank.leases is not None
        bank.leases.clear()
        before = spares.filled_taken
        hit = ns.restore(tokens, room_for=300)
        assert hit is not None and spares.filled_taken == before
        assert kv_prefix_bits(hit.layers, spec, 256) == kv_prefix_bits(layers, spec, 256)


def test_filled_sets_keep_within_their_bound(spares: Spares) -> None:
    """A set to fill over half the bound is not made; at most two are kept, the
    oldest dropped first; each is taken once, by its key."""
    spares.enable(8 << 20)
    fills: list[str] = []

    def filled(key: str, nbytes: int = 1 << 20) -> Filled:
        return Filled(key, (BIG,), lambda dests: fills.append(key), nbytes)

    spares.refill([], UNFILLED_FROM, filled=filled("huge", 5 << 20))
    spares.settle()
    assert fills == [] and spares.take_filled("huge") is None
    for key in ("a", "b", "c"):
        spares.refill([], UNFILLED_FROM, filled=filled(key))
        spares.settle()
    assert fills == ["a", "b", "c"] and spares.bytes == 2 << 20
    assert spares.take_filled("a") is None  # dropped for "c"
    got = spares.take_filled("b")
    assert got is not None and got[0].finish().shape == BIG[0]
    assert spares.take_filled("b") is None and spares.bytes == 1 << 20


def test_copies_ahead_turned_off_keep_the_copy_on_the_path(bank_path: Path) -> None:
    """`Spares.copy_ahead` False: no restore takes a copy made ahead, however often a
    lease is restored, and each is bit-exact."""
    spec = _hot_spec()
    tokens = [int(t) for t in np.arange(256) % 79]
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=64 << 20)) as bank:
        spares = bank.resources.spares
        spares.copy_ahead = False
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        for _ in range(4):
            spares.settle()
            hit = ns.restore(tokens, room_for=300)
            assert hit is not None
            assert kv_prefix_bits(hit.layers, spec, 256) == kv_prefix_bits(layers, spec, 256)
        assert spares.filled_taken == 0 and not spares._filled


def test_a_held_refill_waits_for_its_release_or_its_bound(spares: Spares) -> None:
    """A refill asked for `holding()` starts only once `release`d (the caller's
    forward pass done), or after `hold_s` when nobody releases it; one asked for
    without holding never waits, and releases the one before it."""
    spares.enable(16 << 20)
    spares.hold_s = 60.0
    with spares.holding():
        spares.refill([BIG], UNFILLED_FROM)
    time.sleep(0.3)
    assert spares.made == 0  # waiting for the release
    released = time.monotonic()
    spares.release()
    spares._wants.join()  # not settle(), which releases on its own
    assert (spares.made, spares.held) == (1, 1)
    assert time.monotonic() - released < 20  # made on the release, not after hold_s
    assert list(spares.take([BIG], UNFILLED_FROM)) == [0]
    spares.hold_s = 0.2
    with spares.holding():
        spares.refill([BIG], UNFILLED_FROM)
    started = time.monotonic()
    spares._wants.join()  # never released: made once its bound ran out
    assert spares.made == 2 and spares.held == 2 and time.monotonic() - started >= 0.15
    spares.take([BIG], UNFILLED_FROM)
    spares.hold_s = 60.0
    with spares.holding():
        spares.refill([BIG], UNFILLED_FROM)
    time.sleep(0.3)
    assert spares.made == 2  # held
    released = time.monotonic()
    spares.refill([BIG], UNFILLED_FROM)  # not held: the held one waits no longer
    spares._wants.join()
    assert spares.made == 3 and spares.held == 3 and time.monotonic() - released < 20
    spares.take([BIG], UNFILLED_FROM)
    spares.refill([BIG], UNFILLED_FROM)  # held earlier, never released: not held now
    spares._wants.join()
    assert spares.made == 4 and spares.held == 3


def _long_holds(bank: Bank) -> Spares:
    """The bank's spares, a hold lasting up to 60 s: a refill made within seconds was
    released, not let go at the hold's end."""
    spares = bank.resources.spares
    spares.hold_s = 60.0
    return spares


def _stored(bank: Bank, prompt: list[int]) -> tuple[PrefixCache, mx.array]:
    """A tiny model's PrefixCache on `bank`, `prompt` stored, and its cold logits."""
    pc = PrefixCache(bank, tiny("tiny-qwen3"), keep_end=False)  # whole blocks, leased
    cold = pc.prefill(prompt, pc.new_cache())
    bank.flush()
    return pc, cold


def _made_within(spares: Spares, seconds: float) -> None:
    """Wait for the refills asked for (not `settle`, which releases them), in time."""
    started = time.monotonic()
    spares._wants.join()
    waited = time.monotonic() - started
    assert waited < seconds, f"a released refill took {waited:.1f} s"


def test_prefix_cache_holds_its_restores_refill_until_its_prefill_is_done(
    bank_path: Path,
) -> None:
    """A runtime's restore sets off a refill of its arrays (and, a lease restored
    again, its copy ahead); `PrefixCache.prefill` releases it once its forward pass is
    done, so the refill never runs beside the pass the first token waits for."""
    prompt = [int(t) for t in np.arange(300) % 97]
    with Bank.open(bank_path, BankConfig(block_size=64)) as bank:
        spares = _long_holds(bank)
        pc, cold = _stored(bank, prompt)
        for _ in range(3):  # the third restore of the lease is copied ahead
            spares.settle()
            made = spares.made
            cache, n = pc.restore(prompt)
            assert n == 256
            time.sleep(0.2)
            assert spares.made == made  # held: the forward pass comes first
            logits = pc.prefill(prompt, cache, start=n)
            _made_within(spares, 20)  # released by the prefill, not at the hold's end
            assert spares.made > made
            assert np.array_equal(np.asarray(logits), np.asarray(cold))
        assert spares.filled_taken >= 1


def test_mlx_lms_server_does_not_hold_its_restores_refill(bank_path: Path) -> None:
    """mlx-lm's server prefills on its own and calls `insert_cache` only once the
    answer is done: `BankPromptCache` lets the refill its restore sets off start at
    once, as the servers did before restores held them."""
    prompt = [int(t) for t in np.arange(300) % 89]
    with Bank.open(bank_path, BankConfig(block_size=64)) as bank:
        spares = _long_holds(bank)
        pc, _ = _stored(bank, prompt)
        assert pc.loaded is not None
        adapter = BankPromptCache(bank, pc.loaded)
        spares.settle()
        made = spares.made
        cache, rest = adapter.fetch_nearest_cache(pc.model, prompt)
        assert cache is not None and len(rest) == len(prompt) - 256
        _made_within(spares, 20)
        assert spares.made > made


def test_making_ahead_stops_once_a_restore_takes(spares: Spares) -> None:
    """`make_ahead` (a reopened bank's recorded shapes) makes what fits the bound; once
    a restore takes from the pool it stops at its next array, and asks for nothing
    after a restore began."""
    spares.enable(64 << 20)
    recorded = [(BIG, 2), (((1, 4, 512, 512), F16), 1)]  # 2 MiB + 2 MiB
    assert spares.make_ahead(recorded) == 4 << 20
    spares.settle()
    assert (spares.made, spares.bytes) == (3, 4 << 20)
    assert spares.wanted_recently() == recorded

    other = Spares(64 << 20)
    try:
        assert other.make_ahead([(((1, 4, 1024, 256), F16), 32)]) == 64 << 20  # 32 x 2 MiB
        assert other.take([BIG]) == {}  # a restore began: the making stops
        other.settle()
        assert other.made < 32 and other.bytes == other.made * (2 << 20)
        assert other.make_ahead(recorded) == 0
    finally:
        other.close()
    assert other.bytes == 0
    exiting = Spares(64 << 20)  # the interpreter's exit (`_at_exit`) or enable(0): stops too
    try:
        exiting.make_ahead([(((1, 4, 1024, 256), F16), 32)])
        exiting.enable(0)
        exiting.settle()
        assert exiting.made < 32 and exiting.bytes == 0
    finally:
        exiting.close()
