"""The live lease (issue 43, item 2): the next turn of a conversation takes the last
turn's cache back whole, with no byte copied, and writes into its buffers in place;
where another holder shares them, MLX copies before it writes, so two requests
branching from one live cache never see each other's tokens. Exactness as everywhere:
the next turn's logits are bit-identical to the same forward passes on a fresh cache.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache, PrefixCache
from conftest import (
    BLOCK_SIZE,
    bits,
    hybrid_spec,
    prefix_layers,
    random_logits,
    random_state,
    state_bits,
    stored_hybrid_end,
)
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from runtime_helpers import bit_equal, forward, random_tokens, temp_bank, tiny
from test_next_turn import BLOCK, NEW, turn_one

from cas_bank import Bank, BankConfig
from cas_bank.arrays import address_of, to_numpy
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Write

MODELS = ["tiny-qwen3", "tiny-hybrid"]


def buffer_of(cache: list[Any], pc: PrefixCache) -> int:
    """Where the keys of the first attention layer's buffer begin."""
    return address_of(to_numpy(cache[pc.spec.attention_layers[0]].keys))


@pytest.mark.parametrize("background", [True, False], ids=["queued", "inline"])
@pytest.mark.parametrize("name", MODELS)
def test_the_next_turn_takes_the_live_cache_back_without_a_copy(
    name: str, background: bool
) -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK, background=background)
        rng = np.random.default_rng(21)
        finished, cache, ends, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        live_bytes = bank.stats().live_bytes
        assert live_bytes > 0
        where = buffer_of(cache, pc)
        del cache, recorder  # the runtime is done with turn 1
        # Written by the time the user answers: a store still queued holds views of the
        # buffers (the read view hands them out), so the next write would copy them.
        bank.flush()

        turn = finished + random_tokens(rng, NEW)
        cache, n = pc.restore(turn)
        assert n == len(finished)
        assert buffer_of(cache, pc) == where  # handed back, not copied
        stats = bank.stats()
        assert stats.live_hits == 1 and stats.live_bytes < live_bytes
        logits = pc.prefill(turn, cache, n, end=False)
        assert buffer_of(cache, pc) == where  # the new tokens written in place
        reference = forward(pc, pc.new_cache(), turn, 0, ends + pc.last_prefill.chunk_ends)
        assert bit_equal(logits, reference)


@pytest.mark.parametrize("name", MODELS)
def test_two_agents_branching_from_one_live_cache_never_see_each_others_tokens(
    name: str,
) -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK)
        rng = np.random.default_rng(22)
        finished, cache, ends, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        # The runtime keeps its own cache of turn 1: the lease shares its buffers.
        attention = pc.spec.attention_layers[0]
        kept = np.array(to_numpy(cache[attention].keys))

        turns = [finished + random_tokens(rng, NEW) for _ in range(2)]
        caches, got = [], []
        for turn in turns:  # both restored before either prefills
            c, n = pc.restore(turn)
            assert n == len(finished)
            caches.append(c)
        assert bank.stats().live_hits == 1  # one took the live cache, the other a copy
        for turn, c in zip(turns, caches, strict=True):
            got.append(pc.prefill(turn, c, len(finished), end=False))
        for turn, logits in zip(turns, got, strict=True):
            reference = forward(pc, pc.new_cache(), turn, 0, ends + pc.last_prefill.chunk_ends)
            assert bit_equal(logits, reference)
        a, b = (np.array(to_numpy(c[attention].keys)) for c in caches)
        at = len(finished)
        assert not np.array_equal(a[..., at : at + NEW, :], b[..., at : at + NEW, :])
        assert np.array_equal(np.array(to_numpy(cache[attention].keys)), kept)  # untouched


def test_a_live_lease_is_taken_once_and_stays_in_the_memory_budget() -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"), chunk_size=BLOCK)
        rng = np.random.default_rng(23)
        finished, cache, _, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        stats = bank.stats()
        assert 0 < stats.live_bytes <= stats.leased_bytes <= stats.hot_bytes
        # The live lease is the lease of its whole blocks too: the buffers charged once.
        assert stats.leased_bytes == stats.live_bytes
        del cache
        turn = finished + random_tokens(rng, NEW)
        assert pc.restore(turn)[1] == len(finished)
        assert pc.restore(turn)[1] == len(finished)  # the second from the end record
        assert bank.stats().live_hits == 1

    with temp_bank(BLOCK, hot_bytes=0) as bank:  # no memory for leases: none kept
        pc = PrefixCache(bank, tiny("tiny-qwen3"), chunk_size=BLOCK)
        finished, cache, _, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        assert bank.stats().live_bytes == 0
        assert pc.restore(finished + random_tokens(rng, NEW))[1] == len(finished)
        assert bank.stats().live_hits == 0
        mx.eval(cache[0].keys)


@pytest.mark.parametrize("name", MODELS)
def test_mlx_lms_next_request_gets_the_inserted_cache_back_without_a_copy(name: str) -> None:
    """mlx-lm's server inserts the cache of a request when it ends and lets it go; the
    next turn's `fetch_nearest_cache` hands that very cache back."""
    loaded = tiny(name)
    rng = np.random.default_rng(24)
    prompt = random_tokens(rng, 2 * BLOCK + 10)
    with temp_bank(BLOCK) as bank:
        adapter = BankPromptCache(bank, loaded)
        cache = make_prompt_cache(loaded.model)
        steps = generate_step(
            mx.array(prompt), loaded.model, prompt_cache=cache, max_tokens=9,
            sampler=make_sampler(0.0),
        )  # fmt: skip
        finished = prompt + [int(t) for t, _ in steps]
        adapter.insert_cache("model", finished, cache)
        where = buffer_of(cache, adapter.prefix_cache)
        del cache, steps
        bank.flush()

        restored, rest = adapter.fetch_nearest_cache("model", finished + random_tokens(rng, 3))
        assert restored is not None and len(rest) == 3
        assert buffer_of(restored, adapter.prefix_cache) == where
        assert bank.stats().live_hits == 1


def test_a_live_lease_taken_without_room_hands_out_exactly_its_tokens() -> None:
    """`Namespace.restore(room_for=0)` promises arrays of exactly `Hit.tokens` tokens: a
    live lease is handed out as views of them (no copy), not its whole buffers."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"), chunk_size=BLOCK)
        rng = np.random.default_rng(25)
        finished, cache, _, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        where = buffer_of(cache, pc)
        hit = pc.namespace.restore(finished + random_tokens(rng, NEW))
        assert hit is not None and hit.tokens == len(finished)
        assert bank.stats().live_hits == 1
        keys = hit.layers[pc.spec.attention_layers[0]][0]
        assert keys.shape[-2] == len(finished)
        assert address_of(to_numpy(keys)) == where  # a view of the same buffer


def test_a_model_without_attention_layers_stores_ends_without_a_live_lease() -> None:
    """Nothing a copy would cost: its end record is written, no live lease kept."""
    from conftest import random_layers, random_state

    from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec

    gdn = LayerSpec.recurrent([((1, 3, 24), "bfloat16"), ((1, 2, 4, 4), "float32")])
    spec = ModelSpec(name="pure-ssm", layers=(gdn, gdn), weights_digest="w-ssm")
    with (
        tempfile.TemporaryDirectory() as d,
        Bank.open(Path(d) / "b", BankConfig(block_size=4, write_behind=0)) as bank,
    ):
        ns = bank.namespace(spec)
        toks = list(range(6))
        ns.store(toks[:4], random_layers(spec, 4), {4: random_state(spec)})
        ns.store_end(toks, random_layers(spec, 6), random_state(spec))
        assert bank.stats().ends == 1 and bank.stats().live_bytes == 0
        hit = ns.restore([*toks, 9])
        assert hit is not None and hit.tokens == 6


def test_an_exact_repeat_without_logits_keeps_its_live_cache_one_token_short() -> None:
    """`restore_exact` of a conversation stored without its last logits: the live cache
    handed back with its last token to prefill again (one restore, no copy)."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"), chunk_size=BLOCK)
        finished, cache, ends, _, recorder = turn_one(pc, np.random.default_rng(26))
        pc.store(finished, cache, states=recorder)  # no logits given
        where = buffer_of(cache, pc)
        del cache, recorder
        bank.flush()
        restores = bank.stats().restores
        cache, n, logits = pc.restore_exact(finished)
        assert (n, logits) == (len(finished) - 1, None)
        assert bank.stats().restores == restores + 1 and bank.stats().live_hits == 1
        assert buffer_of(cache, pc) == where
        again = pc.prefill(finished, cache, n, end=False)
        assert bit_equal(again, forward(pc, pc.new_cache(), finished, 0, ends))


@pytest.mark.parametrize("failing", ["blocks", "ends"])
def test_a_failed_store_keeps_no_live_lease(tmp_path: Path, failing: str) -> None:
    """A turn whose blocks or end record fail to be written leaves the read view, and
    the live lease kept for that end record goes too (nothing would ever take it: no
    restore finds a record that was not written); `flush()` raises the failure."""

    class Failing(RocksStore):
        def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
            if any(w[0].value == failing for w in writes):
                raise OSError("disk full")
            super().put_batch(writes)

    with Bank.open(Failing(tmp_path / "bank"), BankConfig(block_size=BLOCK)) as bank:
        assert bank.writer is not None
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        tokens = random_tokens(np.random.default_rng(31), 3 * BLOCK + 5)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(60))
        pc.prefill(tokens, pc.new_cache())
        assert bank.stats().live_bytes > 0  # kept while queued
        gate.set()
        with pytest.raises(OSError, match="disk full"):
            bank.flush()
        assert bank.stats().live_bytes == 0
        assert pc.match([*tokens, 1]) == (0 if failing == "blocks" else 3 * BLOCK)


def test_a_restore_copying_from_a_live_lease_is_not_written_by_the_cache_that_takes_it() -> None:
    """The live lease is also the lease of its blocks: a restore on another thread may be
    copying them (from numpy views of the leased arrays) when the next turn takes the
    cache back. A numpy view holds the array object, not its buffer: had the taker got
    those very objects, its trim and new tokens would write into the rows being copied."""
    with temp_bank(BLOCK) as bank:
        assert bank.leases is not None
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        rng = np.random.default_rng(5)
        tokens = random_tokens(rng, 3 * BLOCK + 5)
        pc.prefill(tokens, pc.new_cache())
        bank.flush()
        blocks, held = bank.leases.probe(pc.namespace.chain(tokens))  # the other restore's
        assert blocks == 3
        views = held.numpy_views()
        rows = blocks * BLOCK
        want = [v[..., :rows, :].copy() for v in views]
        cache, n = pc.restore([*tokens, *random_tokens(rng, NEW)])
        assert n == len(tokens) and bank.stats().live_hits == 1  # the live cache, taken
        for c in cache:
            c.trim(c.offset - 2)  # back into the first block, then new tokens over it
        pc.model(mx.array([random_tokens(rng, 9)]), cache=cache)
        mx.eval([c.state for c in cache])
        assert all(np.array_equal(v[..., :rows, :], w) for v, w in zip(views, want, strict=True))


def test_a_live_hit_hands_out_one_stores_logits_and_state_together(bank: Bank) -> None:
    """Two stores of the same tokens whose numerics differ (a batched run, another
    kernel): the record keeps the first's logits and state (the second's write finds it
    held), the live lease holds the second's cache. A restore hands out one store's
    logits, state and KV together, never one's logits with the other's state."""
    spec = hybrid_spec()
    tokens, _, state = stored_hybrid_end(bank, 2 * BLOCK_SIZE + 3, logits=random_logits(1))
    ns = bank.namespace(spec)
    other = random_state(spec, 99)
    ns.store_end(tokens, prefix_layers(spec, tokens), other, logits=random_logits(2))
    hit = ns.restore(tokens)
    assert hit is not None and hit.exact and hit.logits is not None
    assert bank.stats().live_hits == 1
    stores = {
        (bits(random_logits(1)), str(state_bits(state, spec))),
        (bits(random_logits(2)), str(state_bits(other, spec))),
    }
    assert (bits(hit.logits), str(state_bits(hit.layers, spec))) in stores


@pytest.mark.parametrize("name", MODELS)
def test_a_turn_that_ended_on_a_block_boundary_is_taken_back_without_a_copy(name: str) -> None:
    """Its end record reaches no further than the chain's restore point, so the next
    turn resumes from the blocks; the live cache stored at that end is taken all the
    same, not copied from the lease of its blocks."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK)
        rng = np.random.default_rng(27)
        tokens = random_tokens(rng, 3 * BLOCK)
        cache = pc.new_cache()
        pc.prefill(tokens, cache)
        where = buffer_of(cache, pc)
        del cache
        bank.flush()
        turn = tokens + random_tokens(rng, NEW)
        cache, n = pc.restore(turn)
        assert n == len(tokens) and bank.stats().live_hits == 1
        assert buffer_of(cache, pc) == where  # handed back, not copied
        logits = pc.prefill(turn, cache, n, end=False)
        ends = [*pc.last_prefill.chunk_ends]
        reference = forward(pc, pc.new_cache(), turn, 0, [BLOCK, 2 * BLOCK, 3 * BLOCK, *ends])
        assert bit_equal(logits, reference)
