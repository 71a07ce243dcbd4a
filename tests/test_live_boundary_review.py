"""Review of the boundary take (4426e0b, `restoring._take_live`): a turn that ended on a
block boundary leaves an end record no further than the chain's restore point, so the
next turn resumes from the blocks and takes the live lease stored at exactly that end
(key `end_key(hashes[n_blocks - 1], b"")`). What must hold: the lease taken is one
store's (KV and recurrent state together) of the prompt's own tokens, only of a record
the bank holds, never where a partial block reaches further; one agent takes it, the
other copies, neither sees the other's tokens; the counters and the `Hit` agree; the
next turn's logits are those of the same forward passes on a fresh cache."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache, PrefixCache
from conftest import BLOCK_SIZE, attention_spec, hybrid_spec, remote_config, tokens_of
from hf_models import wide
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from runtime_helpers import bit_equal, forward, random_tokens, temp_bank, tiny
from test_live_lease_review import SPECS, Store, check_one_store, put, store_of, whose
from test_next_turn import BLOCK, NEW

from cas_bank import Bank, BankConfig
from cas_bank.arrays import address_of, to_numpy
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget

N = 2 * BLOCK_SIZE  # a turn ending on a block boundary: two full blocks, no tail


def counts(bank: Bank) -> dict[str, int]:
    s = bank.stats()
    keys = ("restores", "hits", "hit_tokens", "exact_hits", "end_hits", "live_hits")
    return {k: int(getattr(s, k)) for k in keys}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - v for k, v in before.items()}


def boundary_turn(bank: Bank, kind: str, seed: int = 1) -> tuple[Any, list[int], Store]:
    """A turn of `N` tokens ending on a block boundary, stored as a runtime stores it
    (a hybrid with its state at the boundary in the chain, so the restore point is
    there): the namespace, the tokens, the store's numerics."""
    spec = SPECS[kind]()
    ns = bank.namespace(spec)
    tokens = tokens_of(np.random.default_rng(40 + seed), N)
    store = store_of(spec, seed, logits=True, n=N)
    ns.store(tokens, store.layers, {N: store.state} if store.state is not None else None)
    ns.store_end(tokens, store.layers, store.state, logits=store.logits)
    return ns, tokens, store


# -- bugs -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_a_queued_end_record_not_written_keeps_no_lease_for_the_boundary_take(
    bank_path: Path, kind: str
) -> None:
    """`store_end_later` (`PrefixCache.store_end` in the background) of a turn whose
    blocks are not stored: the writer writes no record (it would dangle), so nothing may
    stay leased for it. Else, when another store writes the same blocks later, the
    boundary take hands out a live hit of a record the bank never held."""
    spec = SPECS[kind]()
    rng = np.random.default_rng(41)
    short = tokens_of(rng, N)
    longer = short + tokens_of(rng, 2 * BLOCK_SIZE)
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        assert bank.writer is not None
        ns = bank.namespace(spec)
        lost = store_of(spec, 1, logits=True, n=N)
        ns.store_end_later(short, lost.layers, lost.state, logits=lost.logits).result()
        bank.flush()
        assert bank.stats().ends == 0  # not written: its blocks are not there
        other = store_of(spec, 2, logits=True, n=len(longer))
        states = {N: other.state} if other.state is not None else None
        ns.store(longer, other.layers, states)  # the same first blocks, written now
        before = counts(bank)
        hit = ns.restore([*short, 1001, 1002])
        assert hit is not None and hit.tokens == N
        assert delta(before, counts(bank))["live_hits"] == 0, whose(hit, spec, [lost, other])
        assert not hit.end and bank.stats().live_bytes == 0


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_a_boundary_live_hit_and_the_counters_agree(bank_path: Path, kind: str) -> None:
    """A prompt extending a turn that ended on a boundary: a live hit, whose `Hit.end`
    says what `end_hits` counts (both, or neither; the same prompt restored from the
    blocks, lease gone, is neither)."""
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns, tokens, _ = boundary_turn(bank, kind)
        prompt = [*tokens, 1001, 1002]
        before = counts(bank)
        hit = ns.restore(prompt)
        moved = delta(before, counts(bank))
        assert hit is not None and hit.tokens == N and moved["live_hits"] == 1
        assert moved["hits"] == 1 and moved["exact_hits"] == 0
        assert hit.end == (moved["end_hits"] == 1)


def test_an_exact_boundary_repeat_whose_record_is_damaged_is_counted_as_it_is_served(
    bank_path: Path,
) -> None:
    """The record fails verification (a counted miss of the record): whatever the
    restore then hands out, an exact hit (the logits with it) is counted as one."""
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns, tokens, _ = boundary_turn(bank, "attention")
        ((key, value),) = list(bank.store.iterate(Family.ENDS))
        damaged = bytearray(value)
        damaged[-3] ^= 0x10
        bank.store.put_batch([(Family.ENDS, key, bytes(damaged))])
        before = counts(bank)
        hit = ns.restore(tokens)
        moved = delta(before, counts(bank))
        assert hit is not None and hit.tokens == N
        assert hit.exact == (moved["exact_hits"] == 1)
        assert hit.end == (moved["end_hits"] + moved["exact_hits"] == 1)


# -- what held ----------------------------------------------------------------------------
def test_a_hybrid_boundary_take_is_one_stores_kv_and_state(bank_path: Path) -> None:
    """The chain's state at the restore point is the first store's; the live lease is the
    second's (same tokens, other numerics: its blocks and record found held). The take
    hands out the second's KV and state together; the next restore, lease gone, the
    chain's blocks and state (the second's state is leased over the first's written
    one: blocks and states of one chain hash are one, `3d329c7`; not the take's doing)."""
    spec = hybrid_spec()
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns, tokens, first = boundary_turn(bank, "hybrid", seed=1)
        second = store_of(spec, 2, logits=True, n=N)
        ns.store(tokens, second.layers, {N: second.state})
        ns.store_end(tokens, second.layers, second.state, logits=second.logits)
        prompt = [*tokens, 1001, 1002]
        before = counts(bank)
        hit = ns.restore(prompt)
        assert hit is not None and hit.tokens == N and hit.logits is None
        assert delta(before, counts(bank))["live_hits"] == 1
        assert check_one_store(hit, spec, [first, second], live=True) == 1
        again = ns.restore(prompt)
        assert again is not None and again.tokens == N and not again.end
        assert delta(before, counts(bank))["live_hits"] == 1


@pytest.mark.parametrize("removal", ["evicted", "revoked"])
def test_a_removed_boundary_end_takes_its_live_lease_with_it(bank_path: Path, removal: str) -> None:
    """The end record at the boundary evicted on its own (its blocks kept: the take would
    be tried) or revoked: its live lease goes, and no later restore is a live hit."""
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(spec, salt="tenant")
        tokens = tokens_of(np.random.default_rng(42), N)
        store = store_of(spec, 1, logits=True, n=N)
        put(ns, tokens, store, queued=True)
        bank.flush()
        assert bank.stats().live_bytes > 0 and bank.stats().ends == 1
        if removal == "revoked":
            assert bank.revoke("tenant").ends == 1
        else:
            bank.access.touch(ns.chain(tokens))  # the blocks used after their end record
            report = evict_to_budget(bank, bank.stats().payload_bytes)
            assert [e.kind for e in report.evicted] == ["ends"]
            assert ns.match([*tokens, 1]) == N  # the blocks are there: the take is tried
        assert bank.stats().live_bytes == 0
        before = counts(bank)
        hit = ns.restore([*tokens, 1001, 1002])
        assert hit is None or not hit.end
        assert delta(before, counts(bank))["live_hits"] == 0


def test_a_partial_block_reaching_further_is_restored_and_the_lease_kept(bank_path: Path) -> None:
    """Attention-only: another turn's record under the same last block shares the
    prompt's next tokens, so the partial block reaches past the boundary: that is the
    restore, the boundary's live lease stays for the prompt it fits."""
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns, tokens, boundary = boundary_turn(bank, "attention")
        branch = [*tokens, 7, 8, 9]
        other = store_of(spec, 2, logits=True, n=len(branch))
        ns.store_end(branch, other.layers, logits=other.logits)
        live_bytes = bank.stats().live_bytes
        before = counts(bank)
        hit = ns.restore([*tokens, 7, 8, 1001])
        assert hit is not None and hit.tokens == N + 2 and hit.partial == 2
        assert delta(before, counts(bank))["live_hits"] == 0
        assert bank.stats().live_bytes == live_bytes
        hit = ns.restore([*tokens, 1001, 1002])
        assert hit is not None and hit.tokens == N
        assert delta(before, counts(bank))["live_hits"] == 1
        assert check_one_store(hit, spec, [boundary], live=True) == 0


def test_a_restore_through_the_shared_tier_leaves_the_boundary_lease(
    cluster: Any, tmp_path: Path
) -> None:
    """Host a holds a boundary turn (its live lease); host b stored a longer prompt of the
    same first blocks. Host a's restore of b's prompt goes on from the shared tier: a
    restore of b's tokens, not a live hit, and the lease stays for the prompt it fits."""
    spec = attention_spec()
    a = Bank.open(tmp_path / "a", remote_config(cluster.url(0)))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url(1)))
    try:
        rng = np.random.default_rng(46)
        short = tokens_of(rng, N)
        longer = short + tokens_of(rng, 2 * BLOCK_SIZE + 1)
        mine = store_of(spec, 1, logits=True, n=N)
        put(a.namespace(spec), short, mine, queued=False)
        a.flush()
        theirs = store_of(spec, 2, logits=True, n=len(longer))
        put(b.namespace(spec), longer, theirs, queued=False)
        b.flush()
        live_bytes = a.stats().live_bytes
        hit = a.namespace(spec).restore([*longer, 5])
        assert hit is not None and hit.tokens == len(longer) and a.stats().remote_hit_tokens > 0
        assert a.stats().live_hits == 0 and a.stats().live_bytes == live_bytes
        assert whose(hit, spec, [mine, theirs])["tail"] == 1
        a.flush()
        hit = a.namespace(spec).restore([*short, 1001, 1002])
        assert hit is not None and hit.tokens == N and a.stats().live_hits == 1
        assert check_one_store(hit, spec, [mine, theirs], live=True) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("room_for", [0, 64])
@pytest.mark.parametrize("kind", ["attention", "hybrid", "quantized"])
def test_a_boundary_take_hands_out_its_buffers_exactly_or_whole(
    bank_path: Path, kind: str, room_for: int
) -> None:
    """No room asked: views of exactly the boundary's tokens; room asked: the whole
    buffers (the store's padding too). Either way the store's own buffers, no copy."""
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns, tokens, store = boundary_turn(bank, kind)
        spec = ns.spec
        at = spec.attention_layers[0]
        stored = store.layers[at]
        hit = ns.restore([*tokens, 1001, 1002], room_for=room_for)
        assert hit is not None and hit.tokens == N and bank.stats().live_hits == 1
        got = hit.layers[at]
        for mine, theirs in zip(flat_of(got), flat_of(stored), strict=True):
            assert address_of(to_numpy(mine)) == address_of(to_numpy(theirs))
            assert mine.shape[-2] == (theirs.shape[-2] if room_for else N)
        check_one_store(hit, spec, [store], live=True)


def flat_of(layer: Any) -> list[mx.array]:
    return [x for a in layer for x in (a if isinstance(a, tuple) else (a,))]


MODELS = ["tiny-qwen3", "tiny-hybrid"]
TURN = 3 * BLOCK  # a prompt of whole blocks: its turn ends on a block boundary
BOUNDARIES = [BLOCK, 2 * BLOCK, 3 * BLOCK]  # the prefill's forward passes (chunk_size=BLOCK)


def attention_keys(cache: list[Any], pc: PrefixCache) -> np.ndarray:
    return np.array(to_numpy(cache[pc.spec.attention_layers[0]].keys))


@pytest.mark.parametrize("name", MODELS)
def test_two_agents_restoring_one_boundary_end_at_once_see_only_their_own(name: str) -> None:
    """Two agents on two threads restore prompts extending the same boundary turn and
    prefill their own tokens at once: one takes the live cache, the other copies; each
    gets its own prompt's logits, bit for bit, and the runtime's cache is untouched."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK)
        rng = np.random.default_rng(43)
        tokens = random_tokens(rng, TURN)
        cache = pc.new_cache()
        pc.prefill(tokens, cache)
        kept = attention_keys(cache, pc)
        bank.flush()
        turns = [tokens + random_tokens(rng, NEW) for _ in range(2)]
        got: dict[int, tuple[mx.array, list[Any]]] = {}
        start = threading.Barrier(2)

        def agent(i: int) -> None:
            start.wait(10)
            restored, n = pc.restore(turns[i])
            assert n == TURN
            logits = pc.prefill(turns[i], restored, n, end=False)
            mx.eval(logits)
            got[i] = (logits, restored)

        agents = [threading.Thread(target=agent, args=(i,)) for i in range(2)]
        for thread in agents:
            thread.start()
        for thread in agents:
            thread.join(60)
        assert sorted(got) == [0, 1] and bank.stats().live_hits == 1
        chunk_ends = pc.last_prefill.chunk_ends  # both turns are as long: chunked alike
        for i, turn in enumerate(turns):
            reference = forward(pc, pc.new_cache(), turn, 0, [*BOUNDARIES, *chunk_ends])
            assert bit_equal(got[i][0], reference)
        a, b = (attention_keys(got[i][1], pc)[..., TURN : TURN + NEW, :] for i in range(2))
        assert not np.array_equal(a, b)
        assert np.array_equal(attention_keys(cache, pc), kept)


@pytest.mark.parametrize("turn2_from", ["lease", "own_cache"])
@pytest.mark.parametrize("name", MODELS)
def test_a_boundary_turn_then_a_longer_one_then_a_branch_from_the_first(
    name: str, turn2_from: str
) -> None:
    """Turn 1 ends on a boundary; turn 2 goes on from it (taking its live cache back, or
    the runtime's own cache of turn 1, which the lease shares) and stores its own end
    past the boundary; a branch from turn 1's end and turn 3 (turn 2's live cache) each
    get their own prompt's logits, bit for bit: turn 2's tokens never reach the branch."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK)
        rng = np.random.default_rng(44)
        turn1 = random_tokens(rng, TURN)
        cache = pc.new_cache()
        pc.prefill(turn1, cache)
        bank.flush()

        turn2 = turn1 + random_tokens(rng, NEW)
        taken = turn2_from == "lease"
        if taken:
            cache, n = pc.restore(turn2)
            assert n == TURN and bank.stats().live_hits == 1
        logits = pc.prefill(turn2, cache, TURN)  # its end record and live lease, at 3B + 5
        ends2 = [*BOUNDARIES, *pc.last_prefill.chunk_ends]
        assert bit_equal(logits, forward(pc, pc.new_cache(), turn2, 0, ends2))
        if taken:
            del cache
        bank.flush()

        branch = [*turn1, (turn2[TURN] + 1) % 512, *random_tokens(rng, NEW - 1)]
        restored, n = pc.restore(branch)
        # Turn 1's live cache: taken by turn 2 already, or taken now.
        assert n == TURN and bank.stats().live_hits == 1
        logits = pc.prefill(branch, restored, n, end=False)
        reference = forward(
            pc, pc.new_cache(), branch, 0, [*BOUNDARIES, *pc.last_prefill.chunk_ends]
        )
        assert bit_equal(logits, reference)

        turn3 = turn2 + random_tokens(rng, NEW)
        restored, n = pc.restore(turn3)
        assert n == len(turn2) and bank.stats().live_hits == 2  # turn 2's live cache
        logits = pc.prefill(turn3, restored, n, end=False)
        reference = forward(pc, pc.new_cache(), turn3, 0, [*ends2, *pc.last_prefill.chunk_ends])
        assert bit_equal(logits, reference)


def test_a_quantized_boundary_insert_is_taken_back_by_mlx_lms_next_request() -> None:
    """`BankPromptCache(kv_bits=4)`: mlx-lm's cache, quantized, inserted where the answer
    ends on a block boundary; the next request's fetch takes it back (no copy), and its
    log-probs are those of the same steps on a fresh quantized cache, bit for bit."""
    loaded = wide("tiny-qwen3")
    model = loaded.model
    rng = np.random.default_rng(45)
    prompt = random_tokens(rng, TURN - 4)

    def answered(cache: list[Any], tokens: list[int], n: int) -> tuple[list[int], mx.array]:
        out: list[int] = []
        first = None
        steps = generate_step(
            mx.array(tokens), model, prompt_cache=cache, max_tokens=n, sampler=make_sampler(0.0)
        )
        for token, logprobs in steps:
            first = logprobs if first is None else first
            out.append(int(token))
        assert first is not None
        return out, first

    def quantized() -> list[Any]:
        return [c.to_quantized(group_size=32, bits=4) for c in make_prompt_cache(model)]

    with temp_bank(BLOCK) as bank:
        adapter = BankPromptCache(bank, loaded, kv_bits=4, kv_group_size=32)
        cache = quantized()
        generated, _ = answered(cache, prompt, 4)
        held = prompt + generated
        assert len(held) == TURN
        adapter.insert_cache("model", held, cache)
        where = address_of(to_numpy(cache[0].keys[0]))
        del cache
        bank.flush()
        follow = held + random_tokens(rng, NEW)
        restored, rest = adapter.fetch_nearest_cache("model", follow)
        assert restored is not None and len(rest) == NEW and bank.stats().live_hits == 1
        assert address_of(to_numpy(restored[0].keys[0])) == where
        tokens, logprobs = answered(restored, rest, 3)
        fresh = quantized()
        answered(fresh, prompt, 4)
        expected, fresh_logprobs = answered(fresh, rest, 3)
        assert tokens == expected and bit_equal(logprobs, fresh_logprobs)
