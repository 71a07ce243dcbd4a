"""The library API of issue 2 in one process: store, match, restore, stats, reopen,
readers beside a writer, threads. Bad input and corruption have files of their own.

Real RocksDB under tmp_path and real MLX arrays. KV comes from `prefix_layers`, which
makes the vector at position t depend only on tokens[: t + 1] (as a model's does),
so every restore is checked bit for bit against the prompt's own KV.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    check_every_block,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    quantized_spec,
    random_state,
    snapshot,
    state_bits,
    tokens_of,
)

from cas_bank import (
    Bank,
    BankConfig,
    LayerSpec,
    ModelSpec,
)
from cas_bank.index.tree import load_namespaces

B = BLOCK_SIZE


def store_and_check_restore(bank: Bank, spec: ModelSpec, tokens: list[int], pad: int = 0) -> None:
    ns = bank.namespace(spec)
    layers = prefix_layers(spec, tokens, pad=pad)
    report = ns.store(tokens, layers)
    full = len(tokens) // B * B
    assert report.blocks == len(tokens) // B
    hit = ns.restore(tokens)
    assert hit is not None and hit.tokens == full
    assert ns.match(tokens) == full
    assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, full)
    for layer, ls in zip(hit.layers, spec.layers, strict=True):
        assert layer is not None
        assert type(layer) is tuple and len(layer) == 2
        if ls.quantization is not None:
            assert all(isinstance(part, tuple) and len(part) == 3 for part in layer)


# -- round trips ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_restore_is_bit_identical(bank: Bank, dtype: str) -> None:
    rng = np.random.default_rng(0)
    store_and_check_restore(bank, attention_spec(dtype), tokens_of(rng, 5 * B + 3), pad=7)


def test_restore_quantized_kv_tuples(bank: Bank) -> None:
    rng = np.random.default_rng(1)
    store_and_check_restore(bank, quantized_spec(), tokens_of(rng, 3 * B))


def test_restore_with_a_value_dim_unlike_the_key_dim(bank: Bank) -> None:
    """Keys and values of different widths (v_head_dim), in bf16."""
    layer = LayerSpec.attention(kv_heads=2, head_dim=16, dtype="bfloat16", v_head_dim=8)
    spec = ModelSpec(name="mla-like", layers=(layer, layer, layer), weights_digest="w-mla")
    rng = np.random.default_rng(22)
    store_and_check_restore(bank, spec, tokens_of(rng, 3 * B + 1), pad=2)


def test_restore_from_strided_input_arrays(bank: Bank) -> None:
    """Keys passed as a transposed view (not contiguous) are stored by value."""
    spec = attention_spec("float16", n_layers=1)
    tokens = tokens_of(np.random.default_rng(2), 2 * B)
    (keys, values) = prefix_layers(spec, tokens)[0]
    keys_t = mx.array(np.ascontiguousarray(np.array(keys).transpose(0, 1, 3, 2))).transpose(
        0, 1, 3, 2
    )
    ns = bank.namespace(spec)
    ns.store(tokens, [(keys_t, values)])
    hit = ns.restore(tokens)
    assert hit is not None
    assert np.array_equal(np.array(hit.layers[0][0]), np.array(keys))


def test_restored_arrays_are_independent(bank: Bank, attn_spec: ModelSpec) -> None:
    """Two restores of one prefix may share memory (a lease, see index.lease), but an
    in-place update of one (what a cache does: slice assignment, then evaluation)
    never reaches the other, nor what the bank holds."""
    tokens = tokens_of(np.random.default_rng(3), 2 * B)
    ns = bank.namespace(attn_spec)
    ns.store(tokens, prefix_layers(attn_spec, tokens))
    first, second = ns.restore(tokens), ns.restore(tokens)
    assert first is not None and second is not None
    want = layers_bits(second.layers, attn_spec)
    k = first.layers[0][0]
    k[..., :, :] = mx.zeros(k.shape, dtype=k.dtype)  # scribble over the first restore
    mx.eval(k)
    assert layers_bits(second.layers, attn_spec) == want
    third = ns.restore(tokens)
    assert third is not None and layers_bits(third.layers, attn_spec) == want


def test_only_full_blocks_are_stored_and_matched(bank: Bank, attn_spec: ModelSpec) -> None:
    ns = bank.namespace(attn_spec)
    tokens = tokens_of(np.random.default_rng(4), 2 * B + B - 1)
    report = ns.store(tokens, prefix_layers(attn_spec, tokens))
    assert (report.blocks, report.blocks_written) == (2, 2)
    # A prompt inside a stored block takes its first tokens (a partial block).
    assert ns.match(tokens[: B - 1]) == B - 1
    hit = ns.restore(tokens[: B - 1])
    assert hit is not None and (hit.tokens, hit.partial, hit.blocks) == (B - 1, B - 1, [])
    assert ns.match(tokens[: 2 * B - 1]) == 2 * B - 1
    assert ns.match([*tokens, 1, 2, 3]) == 2 * B
    assert ns.match([tokens[0] + 1]) == 0  # no stored block starts with that token
    short = ns.store(tokens[: B - 1], prefix_layers(attn_spec, tokens[: B - 1]))
    assert short.blocks == 0 and short.bytes_written == 0


# -- hybrid models ----------------------------------------------------------------
def test_hybrid_restore_point_is_deepest_state(bank: Bank, hyb_spec: ModelSpec) -> None:
    ns = bank.namespace(hyb_spec)
    tokens = tokens_of(np.random.default_rng(5), 5 * B + 2)
    layers = prefix_layers(hyb_spec, tokens)
    states = {2 * B: random_state(hyb_spec, 20), 4 * B: random_state(hyb_spec, 40)}
    report = ns.store(tokens, layers, states)
    assert (report.blocks_written, report.states_written) == (5, 2)

    hit = ns.restore(tokens)
    assert hit is not None and hit.tokens == 4 * B and ns.match(tokens) == 4 * B
    assert layers_bits(hit.layers, hyb_spec) == kv_prefix_bits(layers, hyb_spec, 4 * B)
    assert state_bits(hit.layers, hyb_spec) == state_bits(states[4 * B], hyb_spec)

    # Leaves the chain inside block 3: only blocks 0..2 match; the state at 2B serves.
    other = [*tokens[: 3 * B + 1], 999999, *tokens[3 * B + 2 :]]
    hit = ns.restore(other)
    assert hit is not None and hit.tokens == 2 * B and ns.match(other) == 2 * B
    assert layers_bits(hit.layers, hyb_spec) == kv_prefix_bits(layers, hyb_spec, 2 * B)
    assert state_bits(hit.layers, hyb_spec) == state_bits(states[2 * B], hyb_spec)


def test_hybrid_without_a_matched_state_is_a_miss(bank: Bank, hyb_spec: ModelSpec) -> None:
    ns = bank.namespace(hyb_spec)
    tokens = tokens_of(np.random.default_rng(6), 4 * B)
    ns.store(tokens, prefix_layers(hyb_spec, tokens), {4 * B: random_state(hyb_spec, 1)})
    # Matches three blocks, but the only state is at 4B: never KV of 3B with it.
    assert ns.match(tokens[: 3 * B + 1]) == 0
    assert ns.restore(tokens[: 3 * B + 1]) is None
    assert bank.stats().misses == 1
    assert ns.restore(tokens) is not None


def test_hybrid_state_added_by_a_later_store(bank: Bank, hyb_spec: ModelSpec) -> None:
    ns = bank.namespace(hyb_spec)
    tokens = tokens_of(np.random.default_rng(7), 3 * B)
    layers = prefix_layers(hyb_spec, tokens)
    ns.store(tokens, layers)
    assert ns.match(tokens) == 0
    state = random_state(hyb_spec, 3)
    again = ns.store(tokens, layers, {B: state})
    assert (again.blocks_written, again.states_written) == (0, 1)
    hit = ns.restore(tokens)
    assert hit is not None and hit.tokens == B
    assert state_bits(hit.layers, hyb_spec) == state_bits(state, hyb_spec)
    third = ns.store(tokens, layers, {B: random_state(hyb_spec, 4)})
    assert (third.states_written, third.states_existing, third.bytes_written) == (0, 1, 0)
    assert bank.stats().states == 1


# -- dedup and stats --------------------------------------------------------------
def test_second_store_writes_nothing(bank: Bank, attn_spec: ModelSpec) -> None:
    ns = bank.namespace(attn_spec)
    tokens = tokens_of(np.random.default_rng(8), 4 * B)
    layers = prefix_layers(attn_spec, tokens)
    first = ns.store(tokens, layers)
    before = {f: v for f, v in snapshot(bank).items() if f not in ("meta", "access")}
    second = ns.store(tokens, layers)
    assert (second.blocks_written, second.blocks_existing, second.bytes_written) == (0, 4, 0)
    assert {f: v for f, v in snapshot(bank).items() if f not in ("meta", "access")} == before
    s = bank.stats()
    assert (s.blocks, s.logical_tokens, s.unique_tokens) == (4, 8 * B, 4 * B)
    assert s.payload_bytes == first.bytes_written
    assert s.dedup_ratio == 2.0
    assert (s.blocks_written, s.blocks_deduplicated, s.stores) == (4, 4, 2)


def test_hit_and_miss_counters(bank: Bank, attn_spec: ModelSpec) -> None:
    ns = bank.namespace(attn_spec)
    tokens = tokens_of(np.random.default_rng(9), 3 * B)
    ns.store(tokens, prefix_layers(attn_spec, tokens))
    ns.restore([*tokens, 1])
    ns.restore([7] * (2 * B))
    s = bank.stats()
    assert (s.restores, s.hits, s.misses) == (2, 1, 1)
    assert (s.queried_tokens, s.hit_tokens) == (3 * B + 1 + 2 * B, 3 * B)
    assert s.hit_rate == pytest.approx(3 * B / (5 * B + 1))


def test_namespaces_do_not_share_blocks(bank: Bank) -> None:
    a, b = attention_spec(name="model-a"), attention_spec(name="model-b")
    tokens = tokens_of(np.random.default_rng(10), 2 * B)
    bank.namespace(a).store(tokens, prefix_layers(a, tokens))
    assert bank.namespace(b).match(tokens) == 0
    assert bank.namespace(b).restore(tokens) is None
    bank.namespace(b).store(tokens, prefix_layers(b, tokens))
    s = bank.stats()
    assert (s.blocks, s.namespaces) == (4, 2)
    specs, bad = load_namespaces(bank.store)
    assert sorted(spec.name for spec in specs.values()) == ["model-a", "model-b"] and not bad


# -- lifetime and readers ---------------------------------------------------------
def test_close_then_reopen_in_one_process(bank_path: Path, attn_spec: ModelSpec) -> None:
    tokens = tokens_of(np.random.default_rng(13), 3 * B)
    layers = prefix_layers(attn_spec, tokens)
    for round_ in range(3):
        bank = Bank.open(bank_path, BankConfig(block_size=B))
        ns = bank.namespace(attn_spec)
        if round_ == 0:
            ns.store(tokens, layers)
        hit = ns.restore(tokens)
        assert hit is not None
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(layers, attn_spec, 3 * B)
        bank.close()
    with Bank.open(bank_path) as bank:
        s = bank.stats()
        assert (s.blocks, s.restores, s.hits, s.stores) == (3, 3, 3, 1)


def test_close_twice_is_harmless(bank_path: Path) -> None:
    bank = Bank.open(bank_path, BankConfig(block_size=B))
    bank.close()
    bank.close()


def test_read_only_and_secondary_read_beside_the_writer(
    bank_path: Path, attn_spec: ModelSpec
) -> None:
    rng = np.random.default_rng(14)
    first, second = tokens_of(rng, 2 * B), tokens_of(rng, 3 * B)
    with Bank.open(bank_path, BankConfig(block_size=B)) as writer:
        ns = writer.namespace(attn_spec)
        ns.store(first, prefix_layers(attn_spec, first))
        with (
            Bank.open(bank_path, mode="read_only") as frozen,
            Bank.open(bank_path, mode="secondary") as follower,
        ):
            assert frozen.read_only and follower.read_only
            ns.store(second, prefix_layers(attn_spec, second))
            follower.refresh()
            hit = follower.namespace(attn_spec).restore(second)
            assert hit is not None and hit.tokens == 3 * B
            want = kv_prefix_bits(prefix_layers(attn_spec, second), attn_spec, 3 * B)
            assert layers_bits(hit.layers, attn_spec) == want
            assert follower.stats().blocks == 5
            ro = frozen.namespace(attn_spec)
            assert ro.match(first) == 2 * B and ro.match(second) == 0
            stats = frozen.stats()
            with pytest.raises(RuntimeError, match="is open read-only: it cannot store"):
                ro.store(second, prefix_layers(attn_spec, second))
            assert frozen.stats() == stats
        assert ns.restore(second) is not None


# -- threads ----------------------------------------------------------------------
def test_threads_store_and_restore_overlapping_prompts(bank: Bank, attn_spec: ModelSpec) -> None:
    rng = np.random.default_rng(19)
    system = tokens_of(rng, 3 * B)
    prompts = [system + tokens_of(rng, int(rng.integers(0, 4 * B))) for _ in range(12)]
    layers = [prefix_layers(attn_spec, p) for p in prompts]
    ns = bank.namespace(attn_spec)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for j in range(len(prompts)):
                i = (t * 5 + j) % len(prompts)
                ns.store(prompts[i], layers[i])
                hit = ns.restore(prompts[(i + 1) % len(prompts)])
                if hit is not None:
                    p = prompts[(i + 1) % len(prompts)]
                    want = kv_prefix_bits(layers[(i + 1) % len(prompts)], attn_spec, hit.tokens)
                    assert layers_bits(hit.layers, attn_spec) == want, p
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    distinct = {tuple(p[: (i + 1) * B]) for p in prompts for i in range(len(p) // B)}
    s = bank.stats()
    assert s.blocks == distinct.__len__() == check_every_block(bank.store)
    assert s.stores == 4 * len(prompts)
    assert s.blocks_written == len(distinct)
    assert s.logical_tokens == 4 * sum(len(p) // B * B for p in prompts)
    for p, lay in zip(prompts, layers, strict=True):
        hit = ns.restore(p)
        assert hit is not None and hit.tokens == len(p) // B * B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(lay, attn_spec, hit.tokens)
