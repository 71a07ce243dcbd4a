"""End records with real tiny mlx-lm models (docs/design.md, "End records"): an exact
repeat restores with zero prefill, and its logits and greedy next tokens equal a fresh
prefill's; a prompt extending a finished request that did not end on a block boundary
continues from the end record (a hybrid model with no boundary state captured); the
engine samples an exact repeat's first token from the stored logits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest
from runtime_helpers import bit_equal, close, random_tokens, straight_logits, temp_bank, tiny

BLOCK = 16
VARIANTS = {
    "qwen3-fp32": ("tiny-qwen3", "float32"),
    "hybrid-fp32": ("tiny-hybrid", "float32"),
    "qwen3_5-bf16": ("tiny-qwen3_5", "bfloat16"),
}


def greedy(
    pc: PrefixCache, cache: list[Any], logits: mx.array, n: int
) -> tuple[list[int], list[mx.array]]:
    """n greedy tokens decoded from `logits` on `cache`, and the logits of each step."""
    out, seen = [], []
    for _ in range(n):
        seen.append(logits)
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = pc.model(mx.array([[token]]), cache=cache)[0, -1]
    return out, seen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_exact_repeat_has_zero_prefill_and_the_same_logits(variant: str) -> None:
    name, dtype = VARIANTS[variant]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name, dtype), chunk_size=BLOCK)
        tokens = random_tokens(np.random.default_rng(0), 2 * BLOCK + 5)
        cache, n = pc.restore(tokens)
        first = pc.prefill(tokens, cache, n, end=True)
        stored = pc.last_prefill
        fresh_tokens, fresh_logits = greedy(pc, cache, first, 4)

        cache, n, logits = pc.restore_exact(tokens)
        assert pc.last_prefill is stored  # no forward pass: nothing was prefilled
        assert n == len(tokens) and logits is not None
        assert bit_equal(logits, first)  # the very logits the prefill computed
        assert close(logits, straight_logits(pc, tokens), dtype)  # and a straight prefill's
        again_tokens, again_logits = greedy(pc, cache, logits, 4)
        assert again_tokens == fresh_tokens
        for a, b in zip(again_logits, fresh_logits, strict=True):
            assert close(a, b, dtype)
        v = bank.stats()
        assert v.exact_hits == 1 and v.ends >= 1


@pytest.mark.parametrize("variant", ["qwen3-fp32", "hybrid-fp32"])
def test_an_extension_continues_from_the_end_record(variant: str) -> None:
    """A finished request (prompt + answer, not on a boundary) stored without any
    boundary state: the next turn restores from its end record and prefills only the
    new tokens, with logits equal to a fresh prefill's."""
    name, dtype = VARIANTS[variant]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name, dtype), chunk_size=BLOCK)
        rng = np.random.default_rng(1)
        prompt = random_tokens(rng, BLOCK + 7)
        cache = pc.new_cache()
        logits = pc.prefill(prompt, cache, 0, store=False)
        answer, _ = greedy(pc, cache, logits, 12)  # each token went through the model
        finished = prompt + answer
        assert len(finished) % BLOCK
        pc.store(finished, cache)  # blocks only: no state at any boundary
        pc.store_end(finished, cache)
        bank.flush()  # committed: an end record is restored from the bank
        assert bank.stats().states == 0

        turn = finished + random_tokens(rng, 6)
        cache, n = pc.restore(turn)
        assert n == len(finished)  # the end record, past every boundary
        logits = pc.prefill(turn, cache, n)
        assert close(logits, straight_logits(pc, turn), dtype)
        assert bank.stats().end_hits == 1


def test_the_engine_samples_an_exact_repeat_from_stored_logits() -> None:
    with temp_bank(BLOCK) as bank:
        loaded = tiny("tiny-hybrid")
        with Engine(loaded, bank) as engine:
            prompt = random_tokens(np.random.default_rng(2), BLOCK + 3)
            request = GenerationRequest(prompt=prompt, max_tokens=6, temperature=0.0)
            first = engine.generate(request)
            second = engine.generate(request)  # a regenerate
            assert second.token_ids == first.token_ids
            assert second.cached_tokens == len(prompt) == second.prompt_tokens
            assert bank.stats().exact_hits == 1
            # The next turn resumes from the end of the first answer.
            turn = prompt + first.token_ids + random_tokens(np.random.default_rng(3), 4)
            third = engine.generate(GenerationRequest(prompt=turn, max_tokens=2))
            assert third.cached_tokens == len(prompt) + len(first.token_ids) - 1


def test_a_background_prefill_stores_its_end_record_after_its_blocks() -> None:
    with temp_bank(BLOCK, write_behind=4) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"), chunk_size=BLOCK, background=True)
        tokens = random_tokens(np.random.default_rng(4), BLOCK + 9)
        first = pc.prefill(tokens, pc.new_cache(), end=True)
        bank.flush()
        _, n, logits = pc.restore_exact(tokens)
        assert n == len(tokens) and logits is not None and bit_equal(logits, first)
