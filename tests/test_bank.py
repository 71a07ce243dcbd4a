"""The library API of issue 2 in one process: store, match, restore, stats, bad input,
corruption, reopen, readers beside a writer, threads.

Real RocksDB under tmp_path and real MLX arrays. KV comes from `prefix_layers`, which
makes the vector at position t depend only on tokens[: t + 1] (as a model's does),
so every restore is checked bit for bit against the prompt's own KV.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    check_every_block,
    hybrid_spec,
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
    BankSettingsError,
    CorruptDataError,
    InvalidInputError,
    LayerSpec,
    ModelSpec,
)
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family

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
    """Two restores of one prefix and the layers of one restore never share memory."""
    tokens = tokens_of(np.random.default_rng(3), 2 * B)
    ns = bank.namespace(attn_spec)
    ns.store(tokens, prefix_layers(attn_spec, tokens))
    first, second = ns.restore(tokens), ns.restore(tokens)
    assert first is not None and second is not None
    want = layers_bits(second.layers, attn_spec)
    k = first.layers[0][0]
    view = np.asarray(k)
    if view.flags.writeable:  # scribble over the first restore's memory
        view[...] = 0
    assert layers_bits(second.layers, attn_spec) == want


def test_only_full_blocks_are_stored_and_matched(bank: Bank, attn_spec: ModelSpec) -> None:
    ns = bank.namespace(attn_spec)
    tokens = tokens_of(np.random.default_rng(4), 2 * B + B - 1)
    report = ns.store(tokens, prefix_layers(attn_spec, tokens))
    assert (report.blocks, report.blocks_written) == (2, 2)
    assert ns.match(tokens[: B - 1]) == 0
    assert ns.restore(tokens[: B - 1]) is None
    assert ns.match(tokens[: 2 * B - 1]) == B
    assert ns.match([*tokens, 1, 2, 3]) == 2 * B
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
    assert sorted(spec.name for spec in bank.namespaces().values()) == ["model-a", "model-b"]


# -- bad input: a clear error, nothing stored changes -----------------------------
@pytest.fixture
def seeded(bank: Bank) -> Bank:
    """A bank holding a few blocks in the attention and hybrid namespaces."""
    tokens = tokens_of(np.random.default_rng(11), 2 * B)
    for spec in (attention_spec(), hybrid_spec()):
        states = {B: random_state(spec)} if spec.is_hybrid else None
        bank.namespace(spec).store(tokens, prefix_layers(spec, tokens), states)
    return bank


BAD_TOKENS = [
    ([1, 2, -1, 4], "token id -1 is outside [0, 2**32)"),
    ([1, 2, 2**32, 4], "token id 4294967296 is outside [0, 2**32)"),
    ([1.0, 2.0, 3.0, 4.0], "token ids must be ints; got float 1.0"),
    ("hello world!", "tokens must be a sequence of int ids, not a string"),
    ([[1, 2], [3, 4]], "token ids must be ints; got list [1, 2]"),
    (np.zeros((2, 4), dtype=np.int64), "tokens must be 1-D (or [1, T]); got shape (2, 4)"),
    (np.zeros(4, dtype=np.float32), "token ids must be integers; got dtype float32"),
]


@pytest.mark.parametrize(("tokens", "message"), BAD_TOKENS)
@pytest.mark.parametrize("call", ["store", "match", "restore"])
def test_bad_tokens(seeded: Bank, tokens: Any, message: str, call: str) -> None:
    spec = attention_spec()
    ns = seeded.namespace(spec)
    before, stats = snapshot(seeded), seeded.stats()
    with pytest.raises(InvalidInputError) as err:
        if call == "store":
            ns.store(tokens, prefix_layers(spec, [0] * 4))
        else:
            getattr(ns, call)(tokens)
    assert message in str(err.value)
    assert snapshot(seeded) == before and seeded.stats() == stats


def _bad_layers(spec: ModelSpec, n: int) -> dict[str, tuple[list[Any], str]]:
    good = prefix_layers(spec, [5] * n)
    k, v = good[1]
    k32 = k.astype(mx.float32)
    return {
        "dtype": (
            [good[0], (k32, v)],
            "layer 1 array 0: dtype mlx.core.float32 but the spec says float16",
        ),
        "heads": (
            [good[0], (mx.zeros((1, 3, n, 8), mx.float16), v)],
            "layer 1 array 0: shape (1, 3, 8, 8) but the spec says (1, 2, 8, 8)",
        ),
        "ndim": ([(k[0], v), good[1]], "layer 0 array 0: got (2, 8, 8), spec (1, 2, 8)"),
        "short": (
            [good[0], (k[..., : n - 1, :], v[..., : n - 1, :])],
            "layer 1 array 0 holds 7 tokens, fewer than the 8 given",
        ),
        "widths": (
            [good[0], (k, mx.concatenate([v, v], axis=2))],
            "layer 1: arrays disagree on the token axis",
        ),
        "count": (good[:1], "1 layers given but the spec of 'tiny-attn' has 2"),
        "missing": ([good[0], None], "layer 1 is an attention layer but None was given"),
        "arity": ([good[0], (k,)], "layer 1: 1 arrays given, the spec expects 2"),
        "numpy": ([good[0], (np.array(k), v)], "layer 1 array 0: got (1, 2, 8, 8), spec (1, 2, 8)"),
    }


@pytest.mark.parametrize(
    "case", ["dtype", "heads", "ndim", "short", "widths", "count", "missing", "arity", "numpy"]
)
def test_bad_layers_name_the_layer(seeded: Bank, case: str) -> None:
    spec = attention_spec()
    layers, message = _bad_layers(spec, 2 * B)[case]
    before, stats = snapshot(seeded), seeded.stats()
    with pytest.raises(InvalidInputError) as err:
        seeded.namespace(spec).store([5] * (2 * B), layers)
    assert message in str(err.value)
    assert snapshot(seeded) == before and seeded.stats() == stats


def test_bad_hybrid_layers_and_states(seeded: Bank) -> None:
    spec = hybrid_spec()
    ns = seeded.namespace(spec)
    tokens = tokens_of(np.random.default_rng(12), 3 * B)
    layers = prefix_layers(spec, tokens)
    state = random_state(spec)
    wrong_state = list(state)
    wrong_state[2] = (state[2][0], state[2][1].astype(mx.float16))
    cases: list[tuple[list[Any], dict[Any, Any] | None, str]] = [
        ([layers[1], *layers[1:]], None, "layer 0 is recurrent: pass None in layers"),
        (layers, {B + 1: state}, f"state at {B + 1} is not at a block boundary"),
        (layers, {0: state}, f"state at 0 is not at a block boundary (a positive multiple of {B})"),
        (layers, {-B: state}, f"state at {-B} is not at a block boundary"),
        (layers, {4 * B: state}, f"state at {4 * B} is beyond the {3 * B} tokens given"),
        (layers, {"4": state}, "state boundary '4' is not an int"),
        (layers, {B: state[:3]}, f"state at {B}: 3 entries but the spec has 4 layers"),
        (layers, {B: [None, *state[1:]]}, f"state at {B}: layer 0 needs 2 state arrays, got None"),
        (
            layers,
            {B: wrong_state},
            f"state at {B}: layer 2 array 1: dtype mlx.core.float16 but the spec says float32",
        ),
        (layers, {B: [state[0], state[0], *state[2:]]}, f"state at {B}: layer 1 is attention"),
    ]
    for bad_layers, bad_states, message in cases:
        before, stats = snapshot(seeded), seeded.stats()
        with pytest.raises(InvalidInputError) as err:
            ns.store(tokens, bad_layers, bad_states)
        assert message in str(err.value), (message, str(err.value))
        assert snapshot(seeded) == before and seeded.stats() == stats


def test_states_on_a_model_without_recurrent_layers(seeded: Bank) -> None:
    spec = attention_spec()
    tokens = [3] * (2 * B)
    before = snapshot(seeded)
    with pytest.raises(InvalidInputError, match="states given but 'tiny-attn' has no recurrent"):
        seeded.namespace(spec).store(tokens, prefix_layers(spec, tokens), {B: [None, None]})
    assert snapshot(seeded) == before


def test_reopen_with_another_block_size(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        tokens = [1] * (2 * B)
        bank.namespace(attention_spec()).store(tokens, prefix_layers(attention_spec(), tokens))
        before = snapshot(bank)
    with pytest.raises(BankSettingsError) as err:
        Bank.open(bank_path, BankConfig(block_size=2 * B))
    assert (
        f"bank at {bank_path} was created with block_size={B}; it cannot be opened with "
        f"block_size={2 * B}"
    ) in str(err.value)
    with Bank.open(bank_path) as bank:  # block_size left unset: taken from the bank
        assert bank.config.block_size == B
        assert snapshot(bank) == before


@pytest.mark.parametrize("key", [b"format_version", b"hash_format_version"])
def test_reopen_a_newer_format(bank_path: Path, key: bytes) -> None:
    Bank.open(bank_path, BankConfig(block_size=B)).close()
    with RocksStore(bank_path) as raw:
        raw.put_batch([(Family.META, key, struct.pack("<I", 2))])
        before = {f: list(raw.iterate(f)) for f in Family}
    with pytest.raises(BankSettingsError) as err:
        Bank.open(bank_path)
    if key == b"format_version":
        assert f"bank at {bank_path} has format version 2; this cas_bank reads up to 1" in str(
            err.value
        )
    else:
        assert f"bank at {bank_path} uses hash format 2, this build 1" in str(err.value)
    with RocksStore(bank_path) as raw:  # the failed open released the lock, changed nothing
        assert {f: list(raw.iterate(f)) for f in Family} == before


def test_a_reader_needs_a_bank(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no bank at"):
        Bank.open(tmp_path / "none", mode="read_only")
    RocksStore(tmp_path / "empty").close()  # a RocksDB directory that is not a bank
    with pytest.raises(BankSettingsError, match="holds no cas_bank bank"):
        Bank.open(tmp_path / "empty", mode="read_only")


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


# -- corruption -------------------------------------------------------------------
def _corrupt(bank_path: Path, family: Family, key: bytes, how: str) -> None:
    with RocksStore(bank_path) as raw:
        value = raw.get(family, key)
        assert value is not None
        if how == "flip":
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 0x40
            raw.put_batch([(family, key, bytes(bad))])
        elif how == "truncate":
            raw.put_batch([(family, key, value[: len(value) // 3])])
        else:
            raw.put_batch([(family, key, None)])


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_corrupt_payload_is_a_counted_miss_and_heals(
    bank_path: Path, attn_spec: ModelSpec, how: str
) -> None:
    tokens = tokens_of(np.random.default_rng(15), 4 * B)
    layers = prefix_layers(attn_spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        chain = bank.namespace(attn_spec).store(tokens, layers).chain
    _corrupt(bank_path, Family.BLOCKS, chain[2], how)
    with Bank.open(bank_path) as bank:
        ns = bank.namespace(attn_spec)
        hit = ns.restore(tokens)  # no exception, and nothing from block 2 on
        assert hit is not None and hit.tokens == 2 * B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(layers, attn_spec, 2 * B)
        assert bank.stats().corrupt_reads == 1
        healed = ns.store(tokens, layers)
        assert healed.blocks_written == 1
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 4 * B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(layers, attn_spec, 4 * B)
        s = bank.stats()
        assert (s.corrupt_reads, s.blocks) == (1, 4)
        check_every_block(bank.store)


def test_corrupt_first_block_is_a_miss(bank_path: Path, attn_spec: ModelSpec) -> None:
    tokens = tokens_of(np.random.default_rng(16), 2 * B)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        chain = bank.namespace(attn_spec).store(tokens, prefix_layers(attn_spec, tokens)).chain
    _corrupt(bank_path, Family.BLOCKS, chain[0], "flip")
    with Bank.open(bank_path) as bank:
        assert bank.namespace(attn_spec).restore(tokens) is None
        s = bank.stats()
        assert (s.corrupt_reads, s.misses, s.hits) == (1, 1, 0)


def test_corrupt_state_steps_back_to_an_intact_one(bank_path: Path, hyb_spec: ModelSpec) -> None:
    tokens = tokens_of(np.random.default_rng(17), 4 * B)
    layers = prefix_layers(hyb_spec, tokens)
    states = {B: random_state(hyb_spec, 1), 3 * B: random_state(hyb_spec, 3)}
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        chain = bank.namespace(hyb_spec).store(tokens, layers, states).chain
    _corrupt(bank_path, Family.STATES, chain[2], "flip")
    with Bank.open(bank_path) as bank:
        ns = bank.namespace(hyb_spec)
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[B], hyb_spec)
        assert layers_bits(hit.layers, hyb_spec) == kv_prefix_bits(layers, hyb_spec, B)
        assert bank.stats().corrupt_reads == 1
        ns.store(tokens, layers, {3 * B: states[3 * B]})  # heals the state
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 3 * B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[3 * B], hyb_spec)
        assert bank.stats().states == 2


def test_corrupt_block_below_a_state_steps_back(bank_path: Path, hyb_spec: ModelSpec) -> None:
    tokens = tokens_of(np.random.default_rng(18), 4 * B)
    layers = prefix_layers(hyb_spec, tokens)
    states = {B: random_state(hyb_spec, 1), 4 * B: random_state(hyb_spec, 4)}
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        chain = bank.namespace(hyb_spec).store(tokens, layers, states).chain
    _corrupt(bank_path, Family.BLOCKS, chain[2], "flip")
    with Bank.open(bank_path) as bank:
        hit = bank.namespace(hyb_spec).restore(tokens)
        assert hit is not None and hit.tokens == B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[B], hyb_spec)


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


# -- damage below the bank: bytes flipped in RocksDB's own files -------------------
def _flip_file(path: Path, start: float, stop: float, step: int) -> None:
    size = path.stat().st_size
    with path.open("r+b") as fh:
        for off in range(int(size * start), int(size * stop), step):
            fh.seek(off)
            c = fh.read(1)
            fh.seek(off)
            fh.write(bytes([c[0] ^ 0xFF]))


def _bank_on_disk(bank_path: Path, spec: ModelSpec, tokens: list[int]) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        bank.namespace(spec).store(tokens, prefix_layers(spec, tokens))


def test_damaged_blob_file_is_a_counted_miss(bank_path: Path) -> None:
    """Payload reads skip RocksDB's checksum: our digest catches the damage."""
    spec = attention_spec("float16", n_layers=2)
    spec = ModelSpec(name="wide", layers=spec.layers * 8, weights_digest="w-wide")
    tokens = tokens_of(np.random.default_rng(20), 4 * B)
    _bank_on_disk(bank_path, spec, tokens)
    blobs = list(bank_path.glob("*.blob"))
    assert blobs, "payloads are expected in BlobDB files"
    for blob in blobs:
        _flip_file(blob, 0.5, 1.0, 97)
    with Bank.open(bank_path) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is None or hit.tokens < 4 * B
        assert bank.stats().corrupt_reads == 1


def test_damaged_table_files_raise_corrupt_data_not_locked(bank_path: Path, tmp_path: Path) -> None:
    """RocksDB's own checksums guard the small families: damage there is reported as
    `CorruptDataError` naming the bank (at open or on read), never as a lock."""
    import shutil

    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(21), 4 * B)
    _bank_on_disk(bank_path, spec, tokens)
    tables = sorted(bank_path.glob("*.sst"))
    assert tables
    for table in tables:
        copy = tmp_path / f"copy-{table.stem}"
        shutil.copytree(bank_path, copy)
        _flip_file(copy / table.name, 0.0, 0.34, 7)
        try:
            with Bank.open(copy) as bank:
                bank.namespace(spec).restore(tokens)
        except CorruptDataError as e:
            assert str(copy) in str(e)
