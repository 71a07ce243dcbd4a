"""`PrefixCache.prefill(cancelled=...)`: a prefill stopped between two chunks stores
what it finished so that the next attempt restores all of it (a hybrid model's
recurrent state at the stop, in the chain on a block boundary or in an end record
between two), and the prompt finishes with logits bit-identical to the same forward
passes run without the bank."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefillCancelled, PrefixCache
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from runtime_helpers import bit_equal, forward, random_tokens, temp_bank, tiny

BLOCK = 16


def _cancel_after(chunks: int) -> tuple[list[int], Callable[[], bool]]:
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) >= chunks

    return asked, cancelled


def _attempt(
    pc: PrefixCache, tokens: list[int], chunks: int
) -> tuple[int, list[int], PrefillCancelled | mx.array]:
    """One request: restore, then a prefill cancelled after `chunks` forward passes.
    Returns what it restored, the ends of the passes it ran, and the cancel (or the
    logits, when it finished first)."""
    cache, start = pc.restore(tokens)
    asked, cancelled = _cancel_after(chunks)
    try:
        stopped: PrefillCancelled | mx.array = pc.prefill(
            tokens, cache, start=start, cancelled=cancelled
        )
    except PrefillCancelled as e:
        stopped = e
    pc.bank.flush()  # what it stored, committed by the background writer
    assert pc.last_prefill is not None
    passes = pc.last_prefill.chunk_ends
    if not isinstance(stopped, PrefillCancelled):  # fewer passes: never asked after the last
        assert len(asked) == len(passes) - 1 < chunks
    else:
        assert len(asked) == len(passes) == chunks
        assert (stopped.tokens, stopped.total) == (passes[-1], len(tokens))
    return start, passes, stopped


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],
)
@given(
    name=st.sampled_from(["tiny-hybrid", "tiny-qwen3_5", "tiny-qwen3"]),
    chunk=st.sampled_from([32, 24]),  # on the block grid, and across it (an end record)
    n=st.integers(65, 200),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    inline=st.booleans(),  # stores written on the caller's thread, or by the bank's writer
    seed=st.integers(0, 2**16),
)
def test_a_cancelled_prefill_is_restored_whole_by_the_next_attempt_and_resumes_exactly(
    name: str, chunk: int, n: int, cuts: list[int], inline: bool, seed: int
) -> None:
    tokens = random_tokens(np.random.default_rng(seed), n)
    with temp_bank(BLOCK) as bank, temp_bank(BLOCK) as plain:
        pc = PrefixCache(bank, tiny(name), chunk_size=chunk, background=not inline)
        done, schedule = 0, []  # the forward passes every attempt ran, in order
        for chunks in [*cuts, len(tokens)]:  # the last attempt is not cancelled
            start, passes, stopped = _attempt(pc, tokens, chunks)
            assert start == done, f"restored {start}; the attempt before finished {done}"
            schedule += passes
            if not isinstance(stopped, PrefillCancelled):
                break
            done = stopped.tokens
            assert bank.stats().blocks == done // BLOCK  # its full blocks, no more
            assert pc.match(tokens) == done  # all it did, a hybrid's state included
            assert pc.restore_exact(tokens)[2] is None  # no logits for a cut prompt
        assert not isinstance(stopped, PrefillCancelled)
        ref = PrefixCache(plain, tiny(name))
        same_passes = forward(ref, ref.new_cache(), tokens, 0, schedule)
        assert bit_equal(stopped, same_passes)
