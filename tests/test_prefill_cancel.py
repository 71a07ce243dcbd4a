"""`PrefixCache.prefill(cancelled=...)`: a prefill stopped between two chunks keeps what
it finished, and a later request picks up from there with bit-identical logits."""

from __future__ import annotations

import numpy as np
from cas_bank.runtime import PrefillCancelled, PrefixCache
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from runtime_helpers import bit_equal, random_tokens, temp_bank, tiny

BLOCK = 16
CHUNK = 32


def _cancel_after(chunks: int) -> tuple[list[int], object]:
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) >= chunks

    return asked, cancelled


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],
)
@given(
    name=st.sampled_from(["tiny-qwen3", "tiny-hybrid"]),
    n=st.integers(CHUNK + 1, 5 * CHUNK),
    chunks=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_a_cancelled_prefill_stores_what_it_finished_and_resumes_exactly(
    name: str, n: int, chunks: int, seed: int
) -> None:
    tokens = random_tokens(np.random.default_rng(seed), n)
    with temp_bank(BLOCK) as bank, temp_bank(BLOCK) as plain:
        pc = PrefixCache(bank, tiny(name), chunk_size=CHUNK)
        asked, cancelled = _cancel_after(chunks)
        try:
            pc.prefill(tokens, pc.new_cache(), cancelled=cancelled)  # type: ignore[arg-type]
        except PrefillCancelled as e:
            stopped: PrefillCancelled | None = e
        else:
            stopped = None
        bank.flush()  # what it stored, committed by the background writer
        assert pc.last_prefill is not None
        passes = pc.last_prefill.chunk_ends  # the forward passes that ran
        if stopped is None:  # fewer passes than `chunks`: never asked after the last
            assert len(asked) == len(passes) - 1 < chunks
            return
        assert len(asked) == len(passes) == chunks
        done = passes[-1]
        assert (stopped.tokens, stopped.total) == (done, n) and done < n
        assert bank.stats().blocks == done // BLOCK  # its full blocks, no more
        if name == "tiny-qwen3":  # (a hybrid restores only to a captured state)
            assert pc.match(tokens) == done // BLOCK * BLOCK
        assert pc.restore_exact(tokens)[2] is None  # no end record for a cut prompt
        cache, start = pc.restore(tokens)
        resumed = pc.prefill(tokens, cache, start=start)
        ref = PrefixCache(plain, tiny(name), chunk_size=CHUNK)
        straight = ref.prefill(tokens, ref.new_cache())
        assert bit_equal(resumed, straight)
