"""A restored prefill computes exactly what the same forward passes compute without
the bank: bit-identical logits to the same chunk schedule, close to a straight
prefill, the same tokens and log-probs from mlx_lm.generate_step; and the comparison
has power: a recurrent state from the wrong boundary is caught.

Real tiny mlx-lm models (attention-only and Gated DeltaNet hybrids) in float32 and
bfloat16 (the MoE hybrid runs float32 only on CPU: the dense qwen3_5 one covers a
bf16 hybrid), and with quantized KV; few hypothesis examples, the models run on CPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache
from runtime_helpers import (
    bit_equal,
    close,
    random_tokens,
    replay_cache,
    same_schedule_logits,
    straight_logits,
    temp_bank,
    tiny,
    wide,
)

from cas_bank.blocks.store import Family
from cas_bank.restore import file_read

BLOCK = 16

# (label, model factory, dtype for tolerances, PrefixCache options)
VARIANTS: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "qwen3-fp32": (lambda: tiny("tiny-qwen3"), "float32", {}),
    "qwen3-bf16": (lambda: tiny("tiny-qwen3", "bfloat16"), "bfloat16", {}),
    "llama-fp32": (lambda: tiny("tiny-llama"), "float32", {}),
    "hybrid-fp32": (lambda: tiny("tiny-hybrid"), "float32", {}),
    "qwen3_5-fp32": (lambda: tiny("tiny-qwen3_5"), "float32", {}),
    "qwen3_5-bf16": (lambda: tiny("tiny-qwen3_5", "bfloat16"), "bfloat16", {}),
    "qwen3-kv8": (lambda: wide("tiny-qwen3"), "float32", {"kv_bits": 8, "kv_group_size": 32}),
    "hybrid-kv4": (lambda: wide("tiny-hybrid"), "float32", {"kv_bits": 4, "kv_group_size": 32}),
}
# Attention-only: every supported cache class (KVCache in float32 and bfloat16,
# QuantizedKVCache at 8 and 4 bits) for partial blocks.
ATTENTION = {
    **{k: VARIANTS[k] for k in ("qwen3-fp32", "qwen3-bf16", "qwen3-kv8")},
    "qwen3-kv4": (lambda: wide("tiny-qwen3"), "float32", {"kv_bits": 4, "kv_group_size": 32}),
}


def expected_restore(
    a: list[int],
    b: list[int],
    captured: list[int],
    hybrid: bool,
    block: int = BLOCK,
    *,
    end: bool = False,
) -> int:
    """Tokens a restore of b covers after only a was stored (with states at `captured`,
    and with `end` a's end record)."""
    common = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    reach = min(common, len(a), len(b) - 1)
    full = reach // block * block
    if end and (reach == len(a) or not hybrid):
        # All of a, or (attention) the first tokens of its last block or end record.
        return reach
    if not hybrid:
        # A partial block: the first tokens of a's next stored block, when a has one.
        return reach if len(a) >= full + block else full
    return max([s for s in captured if s <= full], default=0)


def check_restored_prefill(
    pc: PrefixCache, a: list[int], b: list[int], dtype: str, chunk_size: int, end: bool = False
) -> int:
    """Store a (its end record with `end`; without, whole blocks and states only),
    restore and prefill b; compare with the same passes without the bank."""
    cache, n0 = pc.restore(a)
    assert n0 == 0
    pc.prefill(a, cache, n0, end=end)
    pc.bank.flush()  # committed by the background writer: b restores from the bank
    stored = pc.last_prefill
    assert stored is not None
    assert all(c % chunk_size == 0 or c in stored.captured for c in stored.chunk_ends[:-1])

    cache, n = pc.restore(b)
    assert n == expected_restore(a, b, stored.captured, pc.spec.is_hybrid, end=end)
    assert n < len(b)
    logits = pc.prefill(b, cache, n)
    report = pc.last_prefill
    assert report is not None and report.start == n

    reference = same_schedule_logits(pc, a, stored.chunk_ends, b, n, report.chunk_ends)
    assert bit_equal(logits, reference), "restored prefill differs from the same passes"
    assert close(logits, straight_logits(pc, b), dtype)
    return n


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_next_turn_restores_all_but_the_tail_exactly(variant: str) -> None:
    """Without an end record (`end=False`): whole blocks, and states where captured.
    With one (the default) it restores all of a: tests/test_next_turn.py."""
    factory, dtype, options = VARIANTS[variant]
    rng = np.random.default_rng(7)
    a = random_tokens(rng, 70)
    b = [*a, *random_tokens(rng, 20)]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=32, **options)
        n = check_restored_prefill(pc, a, b, dtype, chunk_size=32)
    assert n == 64  # the deepest boundary before a's last token holds a state
    if options:
        assert all(isinstance(c, QuantizedKVCache) for c in (pc.new_cache()[i] for i in (1, 3)))


@pytest.mark.parametrize("variant", ["hybrid-fp32", "qwen3_5-bf16", "qwen3-kv8", "hybrid-kv4"])
def test_restores_read_from_payload_files_are_exact(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hot tier and no leases, every payload a file: the restore goes through the
    file reader's batch (the hybrid state with the blocks) and is still exact."""
    from cas_bank.restore.payloads import PayloadReader

    one_by_one: list[object] = []  # payloads read the slow way
    slow = PayloadReader._read
    monkeypatch.setattr(
        PayloadReader, "_read", lambda self, *a: one_by_one.append(a[0]) or slow(self, *a)
    )
    factory, dtype, options = VARIANTS[variant]
    rng = np.random.default_rng(8)
    a = random_tokens(rng, 70)
    b = [*a, *random_tokens(rng, 20)]
    with temp_bank(BLOCK, hot_bytes=0, file_min_bytes=0) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=32, **options)
        assert check_restored_prefill(pc, a, b, dtype, chunk_size=32) == 64
        files = sorted(p.parent.name for p in (bank.path / "payloads").rglob("*.*"))
        assert "blocks" in files
        assert ("states" in files) == pc.spec.is_hybrid
        assert bank.stats().hot_hits == 0
        # Every payload came through the reader's batch (the Python path reads a
        # hybrid's state on its own).
        alone = [] if file_read.fill_module is not None else [Family.STATES]
        assert one_by_one == (alone if pc.spec.is_hybrid else [])


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_shared_prefix_restores_are_exact(variant: str, data: st.DataObject) -> None:
    factory, dtype, options = VARIANTS[variant]
    a_len = data.draw(st.integers(2, 100), label="a_len")
    shared = data.draw(st.integers(0, a_len), label="shared")
    tail = data.draw(st.integers(1, 40), label="tail")
    stride = data.draw(st.sampled_from([None, 1, 3]), label="stride")
    chunk = data.draw(st.sampled_from([16, 24, 48, 512]), label="chunk")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    a = random_tokens(rng, a_len)
    b = [*a[:shared], *random_tokens(rng, tail)]
    with temp_bank(BLOCK, state_stride=stride) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=chunk, **options)
        check_restored_prefill(pc, a, b, dtype, chunk, end=True)


@pytest.mark.parametrize("variant", list(ATTENTION))
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_prompt_diverging_inside_a_block_keeps_its_first_tokens_exactly(
    variant: str, data: st.DataObject
) -> None:
    """Partial blocks: a prompt that leaves a stored block after j of its tokens, at
    every offset j inside the block, restores those j tokens too (trimmed along the
    token axis: a quantized cache's groups run along the head dimension, so its
    trimmed arrays are the same bits) and its prefill is bit-identical to the same
    forward passes without the bank."""
    factory, _, options = ATTENTION[variant]
    block_index = data.draw(st.integers(0, 2), label="block")
    chunk = data.draw(st.sampled_from([16, 24, 512]), label="chunk")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    a = random_tokens(rng, 3 * BLOCK + 5)
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=chunk, **options)
        pc.prefill(a, pc.new_cache(), end=False)  # blocks only: their partial restore
        pc.bank.flush()  # committed: a hybrid restores from the bank
        stored = pc.last_prefill
        assert stored is not None
        for j in range(BLOCK):
            at = block_index * BLOCK + j
            b = [*a[:at], (a[at] + 1) % 512, *random_tokens(rng, 3)]
            cache, n = pc.restore(b)
            assert n == at
            logits = pc.prefill(b, cache, n, store=False)
            report = pc.last_prefill
            assert report is not None
            reference = same_schedule_logits(pc, a, stored.chunk_ends, b, n, report.chunk_ends)
            assert bit_equal(logits, reference), f"diverging at {j} of block {block_index}"
        assert bank.stats().partial_hits == BLOCK - 1  # j = 0 takes no partial block
        assert bank.stats().partial_tokens == BLOCK * (BLOCK - 1) // 2


def test_a_state_from_the_wrong_boundary_is_caught() -> None:
    """Power: the comparison above fails when KV of n tokens meets another state."""
    rng = np.random.default_rng(3)
    a = random_tokens(rng, 100)
    b = [*a, *random_tokens(rng, 30)]
    with temp_bank(BLOCK, state_stride=1) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"), chunk_size=512)
        pc.prefill(a, pc.new_cache(), end=False)  # restores from a boundary's state
        pc.bank.flush()  # committed: a hybrid restores from the bank
        stored = pc.last_prefill
        assert stored is not None and stored.captured == list(range(16, 100, 16))

        cache, n = pc.restore(b)
        assert n == 96
        good = pc.prefill(b, cache, n, store=False)
        ends = pc.last_prefill.chunk_ends if pc.last_prefill else []
        reference = same_schedule_logits(pc, a, stored.chunk_ends, b, n, ends)
        assert bit_equal(good, reference)

        earlier = pc.namespace.restore(a[:81])  # KV and state at boundary 80
        assert earlier is not None and earlier.tokens == 80
        cache, n = pc.restore(b)
        for entry, layer in zip(cache, earlier.layers, strict=True):
            if isinstance(entry, ArraysCache):
                entry.cache = list(layer)
        wrong = pc.prefill(b, cache, n, store=False)
        assert not bit_equal(wrong, reference)
        assert not close(wrong, reference, "float32")


def generate(pc: PrefixCache, prompt: list[int], cache: list[Any] | None) -> tuple[list[int], Any]:
    out = list(generate_step(mx.array(prompt), pc.model, prompt_cache=cache, max_tokens=8))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


@pytest.mark.parametrize("variant", ["qwen3-fp32", "hybrid-fp32", "qwen3_5-bf16"])
def test_generate_step_from_a_restored_cache(variant: str) -> None:
    factory, dtype, options = VARIANTS[variant]
    rng = np.random.default_rng(11)
    a = random_tokens(rng, 60)
    b = [*a, *random_tokens(rng, 9)]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=32, **options)
        pc.prefill(a, pc.new_cache(), end=False)  # restores from a boundary
        pc.bank.flush()  # committed: a hybrid restores from the bank
        stored = pc.last_prefill
        assert stored is not None
        cache, n = pc.restore(b)
        assert n == 48
        tokens, logprobs = generate(pc, b[n:], cache)
        ref_tokens, ref_logprobs = generate(pc, b[n:], replay_cache(pc, a, stored.chunk_ends, n))
        assert tokens == ref_tokens
        assert bit_equal(logprobs, ref_logprobs)
        plain_tokens, plain_logprobs = generate(pc, b, None)
        assert close(logprobs, plain_logprobs, dtype)
        if dtype == "float32":
            assert tokens == plain_tokens
