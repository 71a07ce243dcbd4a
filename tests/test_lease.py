"""Leases (cas_bank.index.lease): a stored or restored prefix handed out without a copy,
and the proof that nothing a runtime does to its cache afterwards (prefill, decode,
trim and overwrite) can write into the memory the bank holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from runtime_helpers import straight_logits, temp_bank, tiny

from cas_bank.restore import assemble, restoring, row_runs

BLOCK = 16


def _leased_bits(bank: Any) -> list[bytes]:
    """Bytes of every array the bank's leases hold (a copy, taken now)."""
    leases = bank.leases
    assert leases is not None
    return [
        np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()
        for _, entry in sorted(leases._entries.items())  # by key: uses reorder them
        for a in entry.arrays
    ]


def _abuse(pc: PrefixCache, cache: list[Any], tokens: list[int], start: int) -> None:
    """Everything a runtime does to a cache in place: a prefill chunk, decode steps,
    a trim back into the restored part, then new tokens over the trimmed ones."""
    rng = np.random.default_rng(1)
    pc.model(mx.array(tokens[start:])[None], cache=cache)
    for _ in range(3):
        pc.model(mx.array([[int(rng.integers(0, 200))]]), cache=cache)
    mx.eval([c.state for c in cache])
    for c in cache:
        c.trim(c.offset - (start - 8))  # back into the leased tokens
    pc.model(mx.array([[int(t) for t in rng.integers(0, 200, 12)]]), cache=cache)
    for c in cache:
        c.keys[..., :4, :] = mx.zeros_like(c.keys[..., :4, :])  # direct slice writes
    mx.eval([c.state for c in cache])


def _chains(bank: Any) -> list[Any]:
    """The leases of stored chains (not of states, nor conversations' live caches)."""
    return [e for e in bank.leases._entries.values() if e.hashes]


@contextmanager
def _stored(seed: int, n_tokens: int) -> Iterator[tuple[Any, PrefixCache, list[int]]]:
    """A bank holding `n_tokens` random tokens of tiny-qwen3, stored (and leased) by a
    prefill: (bank, its PrefixCache, the tokens)."""
    lm = tiny("tiny-qwen3")
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 200, n_tokens)]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, lm)
        pc.prefill(tokens, pc.new_cache())
        bank.flush()  # stored: committed by the background writer
        assert bank.leases is not None
        yield bank, pc, tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lease_is_never_written_by_the_cache_it_came_from_or_went_to(dtype: str) -> None:
    lm = tiny("tiny-qwen3", dtype)
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(0, 200, 4 * BLOCK + 1)]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, lm)
        cache = pc.new_cache()
        pc.prefill(tokens, cache)  # stores, and leases the stored chain
        before = _leased_bits(bank)
        assert before, "the store left nothing leased"
        _abuse(pc, cache, tokens, len(tokens) - 1)  # the cache that was stored
        assert _leased_bits(bank) == before

        hot_before = bank.stats().hot_hits
        restored, n = pc.restore(tokens)
        assert n == 4 * BLOCK and bank.stats().hot_hits > hot_before  # from the lease
        _abuse(pc, restored, tokens, n)  # the cache the lease went to
        assert _leased_bits(bank) == before

        again, n = pc.restore(tokens)
        logits = pc.prefill(tokens, again, start=n, store=False)
        want = straight_logits(pc, tokens)
        tol = 1e-4 if dtype == "float32" else 6e-2
        assert float(mx.max(mx.abs(logits - want)).item()) <= tol


def test_a_hot_restore_with_room_copies_the_lease_once_and_without_room_not_at_all() -> None:
    """A runtime's restore (room for its prompt) gets buffers of its own, filled from the
    lease (the prefill then writes in place, nothing shared to copy again); a restore
    that asks for no room gets the leased buffers themselves."""
    with _stored(8, 4 * BLOCK + 1) as (bank, pc, tokens):
        leased = [np.asarray(a) for e in _chains(bank) for a in e.arrays]
        hot = bank.stats().hot_hits
        cache, n = pc.restore(tokens)
        assert n == 4 * BLOCK and bank.stats().hot_hits == hot + 4  # from the lease
        keys = [np.asarray(c.keys) for c in cache]
        assert all(k.shape[-2] == 256 for k in keys)
        assert not any(np.shares_memory(k, a) for k in keys for a in leased)
        for k, a in zip(keys, leased[::2], strict=True):  # keys and values alternate
            assert np.array_equal(k[..., :n, :], a[..., :n, :])
        hit = pc.namespace.restore(tokens[:n])  # no room asked for
        assert hit is not None and hit.tokens == n
        handed = [np.asarray(layer[0]) for layer in hit.layers if layer is not None]
        assert all(any(np.shares_memory(h, a) for a in leased) for h in handed)
        # On a GPU (its own copy is faster than two CPU threads) the lease is handed out.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(restoring, "copies_on_cpu", lambda: False)
            cache, n = pc.restore(tokens)
        keys = [np.asarray(c.keys) for c in cache]
        assert n == 4 * BLOCK and all(k.shape[-2] == n for k in keys)
        assert all(any(np.shares_memory(k, a) for a in leased) for k in keys)


@pytest.mark.parametrize("native", [True, False])
def test_a_lease_copied_on_two_threads_arrives_whole(native: bool) -> None:
    """The room copy of a large lease runs on this thread and a helper (forced here for
    a tiny model's), by the native streamed copy (`restore.row_runs`) where it is built,
    else by numpy a whole array at a time: every array arrives, once, whole."""
    if native and not row_runs.available():
        pytest.skip("native helper not loaded")
    with _stored(10, 4 * BLOCK + 1) as (bank, pc, tokens), pytest.MonkeyPatch.context() as mp:
        mp.setattr(assemble, "_TWO_THREADS_FROM", 0)
        if not native:
            mp.setattr(row_runs, "_copy_runs", None)
        copied: list[bool] = []
        real = row_runs.copy_planned

        def spy(*args: Any, **kwargs: Any) -> None:
            real(*args, **kwargs)
            copied.append(True)

        mp.setattr(row_runs, "copy_planned", spy)
        leased = [np.asarray(a) for e in _chains(bank) for a in e.arrays]
        cache, n = pc.restore(tokens)
        assert n == 4 * BLOCK
        assert copied == ([True] if native else [])
        got = [np.asarray(a) for c in cache for a in (c.keys, c.values)]
        assert len(got) == len(leased)
        for g, a in zip(got, leased, strict=True):
            assert not np.shares_memory(g, a)
            assert np.array_equal(g[..., :n, :], a[..., :n, :])


def test_a_lease_keeps_its_copy_plan_across_restores() -> None:
    """The native copy's plan of a lease into destinations of one capacity is made once
    (`Assembler._lease_plan`, kept by the lease): the next restores with room only place
    it at their own arrays, each bit-exact and in memory of its own."""
    if not row_runs.available():
        pytest.skip("native helper not loaded")
    with _stored(10, 4 * BLOCK + 1) as (bank, pc, tokens), pytest.MonkeyPatch.context() as mp:
        planned: list[int] = []
        real = row_runs.plan_copy

        def spy(*args: Any, **kwargs: Any) -> Any:
            planned.append(args[3])
            return real(*args, **kwargs)

        mp.setattr(row_runs, "plan_copy", spy)
        leased = [np.asarray(a) for e in _chains(bank) for a in e.arrays]
        caches = [pc.restore(tokens)[0] for _ in range(3)]
        assert planned == [4 * BLOCK]  # one plan, for the first restore
        for cache in caches:
            got = [np.asarray(a) for c in cache for a in (c.keys, c.values)]
            for g, a in zip(got, leased, strict=True):
                assert not np.shares_memory(g, a)
                assert g[..., : 4 * BLOCK, :].tobytes() == a[..., : 4 * BLOCK, :].tobytes()
        firsts = [np.asarray(c.keys) for c in caches[0]]
        assert not any(np.shares_memory(f, np.asarray(c.keys)) for f in firsts for c in caches[1])


def test_a_restore_from_disk_has_room_and_leases_nothing() -> None:
    """PrefixCache.restore reads into arrays with room for the prompt: the prefill of
    the rest writes in place; the bank keeps no reference, so nothing forces a copy."""
    with _stored(6, 4 * BLOCK + 40) as (bank, pc, tokens):
        bank.leases.clear()
        cache, n = pc.restore(tokens)
        assert n == len(tokens) - 1  # 6 blocks and the first tokens of the end record
        assert all(c.keys.shape[-2] == 256 for c in cache)  # room, mlx-lm's step
        assert bank.leases.used_bytes == 0
        logits = pc.prefill(tokens, cache, start=n, store=False)
        want = straight_logits(pc, tokens)
        assert float(mx.max(mx.abs(logits - want)).item()) <= 1e-4


def test_a_restores_timings_say_where_its_time_went() -> None:
    """`Hit.timings`: the lookup, allocation and fill of a restore that reads its
    payloads add up to at most its total; a lease handed out allocates nothing."""
    with _stored(9, 4 * BLOCK + 1) as (bank, pc, tokens):
        bank.leases.clear()
        disk = pc.namespace.restore(tokens[:-1], room_for=len(tokens))
        assert disk is not None and disk.tokens == 4 * BLOCK
        t = disk.timings
        assert t is not None
        assert min(t.lookup_s, t.allocate_s, t.fill_s) > 0
        assert t.lookup_s + t.allocate_s + t.fill_s <= t.total_s
        pc.namespace.restore(tokens[:-1])  # exact arrays, which it leases
        assert bank.leases.used_bytes > 0
        handed = pc.namespace.restore(tokens[:-1])  # the lease handed out
        assert handed is not None and handed.timings is not None
        assert handed.timings.allocate_s == 0.0
        assert handed.timings.lookup_s + handed.timings.fill_s <= handed.timings.total_s


def test_a_hybrid_state_is_leased_and_never_written_by_its_caches() -> None:
    """The recurrent state at a boundary is handed out from memory too (no payload
    read), and a runtime's later updates of the state arrays never reach the bank's."""
    from cas_bank.restore.payloads import PayloadReader

    lm = tiny("tiny-hybrid")
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 200, 4 * BLOCK + 1)]
    reads: list[bytes] = []
    real = PayloadReader.read_state

    def counting(self: PayloadReader, header: Any, fetched: Any = None) -> Any:
        reads.append(header.chain_hash)
        return real(self, header, fetched)

    with temp_bank(BLOCK) as bank, pytest.MonkeyPatch.context() as mp:
        mp.setattr(PayloadReader, "read_state", counting)
        pc = PrefixCache(bank, lm)
        cache = pc.new_cache()
        pc.prefill(tokens, cache, hints=[4 * BLOCK])  # stores blocks and the state at 64
        bank.flush()  # committed: a hybrid restores no chain still queued for the writer
        before = _leased_bits(bank)
        assert any(key.startswith(b"s") for key in bank.leases._entries)
        restored, n = pc.restore(tokens)
        assert n == 4 * BLOCK and reads == []  # blocks and state from the leases
        # Every update a runtime makes: the rest of the prompt, decode steps, then
        # writes straight into the state arrays the restore handed out.
        pc.model(mx.array(tokens[n:])[None], cache=restored)
        pc.model(mx.array([[3]]), cache=restored)
        for c in restored:
            if not hasattr(c, "keys"):
                for i in range(len(c.cache)):
                    c.cache[i][...] = 0
        mx.eval([c.state for c in restored])
        assert _leased_bits(bank) == before
        again, n = pc.restore(tokens)
        logits = pc.prefill(tokens, again, start=n, store=False)
        assert float(mx.max(mx.abs(logits - straight_logits(pc, tokens))).item()) <= 1e-4
        assert reads == []
