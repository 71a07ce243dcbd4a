"""The next turn of a conversation restores everything the last one computed (issue 43,
item 1): a store keeps its exact end by default (`PrefixCache(keep_end=True)`), so a
prompt extending the last prompt and its answer restores all of them and its logits are
bit-identical to the same forward passes on a cache that never left the process (an
attention model and a Gated DeltaNet hybrid); `keep_end=False` (or `end=False`) keeps
whole blocks only; `BankPromptCache.insert_cache` -> `fetch_nearest_cache` of an
extension restores all of the inserted cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache, PrefixCache
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from runtime_helpers import bit_equal, close, forward, random_tokens, temp_bank, tiny

BLOCK = 16
MODELS = ["tiny-qwen3", "tiny-hybrid"]
PROMPT = 2 * BLOCK + 10  # turn 1: 42 tokens
ANSWER = 9  # decoding crosses the boundary at 48 and stops 3 tokens past it
NEW = 5


def decode(
    pc: PrefixCache, cache: list[Any], logits: mx.array, n: int, recorder: Any
) -> tuple[list[int], list[int], mx.array]:
    """n greedy tokens, each fed through the model (as mlx-lm's generate_step does):
    the tokens, the end of every forward pass, and the logits after the last one."""
    tokens: list[int] = []
    ends: list[int] = []
    start = int(cache[pc.spec.attention_layers[0]].offset)
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = pc.model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        recorder.observe()  # a hybrid model's state at a boundary decoding reaches
        ends.append(start + len(tokens))
    return tokens, ends, logits


def turn_one(
    pc: PrefixCache, rng: np.random.Generator
) -> tuple[list[int], list[Any], list[int], mx.array, Any]:
    """A first turn: prompt prefilled (stored), an answer decoded. Returns prompt +
    answer, the cache holding exactly them, every forward pass's end, the last logits
    and the state recorder."""
    prompt = random_tokens(rng, PROMPT)
    cache, n = pc.restore(prompt)
    assert n == 0
    logits = pc.prefill(prompt, cache, n)
    ends = list(pc.last_prefill.chunk_ends)
    recorder = pc.recorder(cache)
    answer, decode_ends, last = decode(pc, cache, logits, ANSWER, recorder)
    return prompt + answer, cache, ends + decode_ends, last, recorder


@pytest.mark.parametrize("background", [True, False], ids=["queued", "inline"])
@pytest.mark.parametrize("name", MODELS)
def test_the_next_turn_restores_the_prompt_and_the_answer_exactly(
    name: str, background: bool
) -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK, background=background)
        rng = np.random.default_rng(7)
        finished, cache, ends, _, recorder = turn_one(pc, rng)
        assert len(finished) % BLOCK  # the answer ends inside a block
        pc.store(finished, cache, states=recorder)  # as a library caller does

        turn = finished + random_tokens(rng, NEW)
        cache, n = pc.restore(turn)  # queued stores: from the read view
        assert n == len(finished)  # all of prompt + answer (whole blocks only: 48)
        logits = pc.prefill(turn, cache, n)
        reference = forward(pc, pc.new_cache(), turn, 0, ends + pc.last_prefill.chunk_ends)
        assert bit_equal(logits, reference)
        bank.flush()
        assert bank.stats().end_hits == 1


@pytest.mark.parametrize("name", MODELS)
def test_a_store_with_the_last_logits_answers_an_exact_repeat(name: str) -> None:
    """`store(..., logits=)`: the conversation so far again (a retry) needs no pass."""
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK)
        finished, cache, _, last, recorder = turn_one(pc, np.random.default_rng(8))
        pc.store(finished, cache, states=recorder, logits=last)
        cache, n, logits = pc.restore_exact(finished)
        assert n == len(finished) and logits is not None and bit_equal(logits, last)


@pytest.mark.parametrize("name", MODELS)
def test_keep_end_false_stores_whole_blocks_only(name: str) -> None:
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny(name), chunk_size=BLOCK, keep_end=False)
        rng = np.random.default_rng(10)
        finished, cache, _, _, recorder = turn_one(pc, rng)
        pc.store(finished, cache, states=recorder)
        turn = finished + random_tokens(rng, NEW)
        assert pc.restore(turn)[1] == len(finished) // BLOCK * BLOCK
        pc.store(finished, cache, states=recorder, end=True)  # one call asks for it
        assert pc.restore(turn)[1] == len(finished)
        bank.flush()
        assert bank.stats().ends == 1  # the prefill of turn 1 kept none

        # The default PrefixCache, one call without: prefill and store alike.
        other = PrefixCache(bank, tiny(name), chunk_size=BLOCK, salt="other")
        prompt = random_tokens(rng, PROMPT)
        cache = other.new_cache()
        other.prefill(prompt, cache, end=False)
        other.store(prompt, cache, end=False)
        bank.flush()
        assert bank.stats().ends == 1


@pytest.mark.parametrize("capture", [False, True], ids=["one-computation", "capture"])
@pytest.mark.parametrize("name", MODELS)
def test_mlx_lms_next_turn_restores_the_inserted_cache(name: str, capture: bool) -> None:
    """mlx-lm's server: generate_step on a fetched cache, insert_cache(prompt + answer)
    after the answer, fetch_nearest_cache of the next turn. Every token generate_step
    yielded went through the model, so the fetch leaves only the new tokens."""
    loaded = tiny(name)
    rng = np.random.default_rng(11)
    prompt = random_tokens(rng, PROMPT)
    with temp_bank(BLOCK) as bank:
        adapter = BankPromptCache(bank, loaded, capture_states=capture)
        cache = make_prompt_cache(loaded.model)
        steps = generate_step(
            mx.array(prompt), loaded.model, prompt_cache=cache, max_tokens=ANSWER,
            sampler=make_sampler(0.0),
        )  # fmt: skip
        answer = [int(t) for t, _ in steps]
        finished = prompt + answer
        adapter.insert_cache("model", finished, cache)

        turn = finished + random_tokens(rng, NEW)
        restored, rest = adapter.fetch_nearest_cache("model", turn)
        assert restored is not None and list(rest) == turn[len(finished) :]
        assert adapter.stats()["hit_tokens"] == len(finished)
        logits = loaded.model(mx.array(rest)[None], cache=restored)[0, -1]
        # generate_step's passes: the prompt but its last token, that token, each answer
        # token; then the new tokens in one.
        ends = [PROMPT - 1, *range(PROMPT, len(finished) + 1), len(turn)]
        pc = adapter.prefix_cache
        reference = forward(pc, pc.new_cache(), turn, 0, ends)
        if capture and pc.spec.is_hybrid:
            # The blocks come from the adapter's second prefill (its chunks end on the
            # boundaries), the end record's tail and state from mlx-lm's cache: two
            # computations of the same tokens, equal within float rounding.
            assert close(logits, reference, "float32")
        else:  # one computation, mlx-lm's: bit for bit
            assert bit_equal(logits, reference)


def test_the_engine_restores_all_it_computed_unless_told_not_to() -> None:
    rng = np.random.default_rng(12)
    prompt = random_tokens(rng, PROMPT)
    new = random_tokens(rng, NEW)
    for keep_end in (True, False):
        with temp_bank(BLOCK) as bank, Engine(tiny("tiny-hybrid"), bank, keep_end=keep_end) as e:
            first = e.generate(GenerationRequest(prompt=prompt, max_tokens=ANSWER, temperature=0.0))
            through = len(prompt) + len(first.token_ids) - 1  # the last token was not fed
            turn = prompt + first.token_ids + new
            second = e.generate(GenerationRequest(prompt=turn, max_tokens=1))
            assert second.cached_tokens == (through if keep_end else through // BLOCK * BLOCK)


def test_bank_prompt_cache_keep_end_false_inserts_whole_blocks_only() -> None:
    loaded = tiny("tiny-qwen3")
    rng = np.random.default_rng(13)
    finished = random_tokens(rng, PROMPT + ANSWER)
    with temp_bank(BLOCK) as bank:
        adapter = BankPromptCache(bank, loaded, keep_end=False)
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array(finished)[None], cache=cache)
        adapter.insert_cache("model", finished, cache)
        _, rest = adapter.fetch_nearest_cache("model", [*finished, 1])
        assert len(finished) + 1 - len(rest) == len(finished) // BLOCK * BLOCK
        bank.flush()
        assert bank.stats().ends == 0
