"""`BankPromptCache` in process: mlx-lm's `LRUPromptCache` interface, driven by
mlx-lm's own `generate_step` on tiny real models (plain, quantized KV, hybrid)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache
from cas_bank.runtime.prompt_cache_adapter import CACHE_TYPES
from hf_models import wide
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from runtime_helpers import close, random_tokens, temp_bank, tiny

from cas_bank.errors import InvalidInputError

BLOCK = 16
KEY = ("model-dir", None, None)  # what mlx-lm's ModelProvider passes as model_key


def test_the_interface_is_that_of_mlx_lms_lru_prompt_cache() -> None:
    for name in ("fetch_nearest_cache", "insert_cache", "trim_to", "stats_by_type", "__len__"):
        ours = inspect.signature(getattr(BankPromptCache, name))
        theirs = inspect.signature(getattr(LRUPromptCache, name))
        assert [(p.name, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.kind) for p in theirs.parameters.values()
        ], name
    assert isinstance(inspect.getattr_static(BankPromptCache, "nbytes"), property)


def run(model: Any, prompt: list[int], cache: list[Any], n: int = 4) -> tuple[list[int], Any]:
    """mlx-lm's generate_step, greedy: the tokens and the first step's log-probs."""
    tokens: list[int] = []
    first = None
    argmax = make_sampler(0.0)
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n, sampler=argmax)
    for token, logprobs in steps:
        first = logprobs if first is None else first
        tokens.append(int(token))
    return tokens, first


@pytest.mark.parametrize(
    ("name", "kv_bits"), [("tiny-qwen3", None), ("tiny-qwen3", 4), ("tiny-hybrid", None)]
)
def test_a_finished_request_is_restored_for_the_next_and_gives_the_same_logits(
    name: str, kv_bits: int | None
) -> None:
    loaded = wide(name) if kv_bits else tiny(name)
    model = loaded.model
    rng = np.random.default_rng(3)
    prompt = random_tokens(rng, 3 * BLOCK + 5)
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, loaded, model_key=KEY, kv_bits=kv_bits, kv_group_size=32)
        assert pc.fetch_nearest_cache(KEY, prompt) == (None, prompt)
        cache = make_prompt_cache(model)
        if kv_bits:  # as mlx-lm's server does with --kv-bits and --quantized-kv-start 0
            cache = [c.to_quantized(group_size=32, bits=kv_bits) for c in cache]
        generated, _ = run(model, prompt, cache)
        held = prompt + generated  # generate_step has fed every token it yielded
        pc.insert_cache(KEY, held, cache)
        bank.flush()  # the insert's stores committed (the background writer)
        assert len(pc) == 1 and pc.stats_by_type()["assistant"]["n_sequences"] == 1
        assert pc.nbytes > 0 and pc.stats()["failures"] == 0

        follow = held + random_tokens(rng, 7)
        restored, rest = pc.fetch_nearest_cache(KEY, follow)
        if loaded.config.get("model_type") == "qwen3_next":
            # The insert prefilled the hybrid again to capture the states at the last
            # boundary and at the fetched prompt's last token but one (the end record a
            # repeat restores): mlx-lm's own prefill shows neither.
            boundary = (len(held) // BLOCK) * BLOCK
            assert pc.stats()["recomputed_tokens"] == max(boundary + 1, len(prompt) - 1)
        n = len(follow) - len(rest)
        # The end record of the inserted cache: restored to its very end.
        assert n == len(held) and rest == follow[n:]
        assert pc.stats()["hit_tokens"] == n
        again, logprobs = run(model, rest, restored)
        fresh = make_prompt_cache(model)
        if kv_bits:
            fresh = [c.to_quantized(group_size=32, bits=kv_bits) for c in fresh]
        expected, fresh_logprobs = run(model, follow, fresh)
        assert close(logprobs, fresh_logprobs, "float32")
        assert again == expected


def test_without_capture_a_hybrid_resumes_only_from_the_end_record() -> None:
    """No boundary state: the blocks alone restore nothing, but the end record of the
    inserted cache (its state at exactly that position) restores a prompt extending it."""
    loaded = tiny("tiny-hybrid")
    prompt = random_tokens(np.random.default_rng(6), 2 * BLOCK + 3)
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, loaded, capture_states=False)
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array(prompt)[None], cache=cache)
        pc.insert_cache(KEY, prompt, cache)
        bank.flush()  # the insert's stores committed (the background writer)
        assert pc.stats()["blocks_written"] == 2 and pc.stats()["recomputed_tokens"] == 0
        assert pc.stats()["end_bytes_written"] > 0 and bank.stats().ends == 1
        branch = [*prompt[:-1], prompt[-1] + 1, 1]  # leaves it inside the last block
        assert pc.fetch_nearest_cache(KEY, branch) == (None, branch)
        follow = [*prompt, 1, 2]
        restored, rest = pc.fetch_nearest_cache(KEY, follow)
        assert restored is not None and rest == [1, 2]
        _, logprobs = run(loaded.model, rest, restored, n=1)
        _, fresh = run(loaded.model, follow, make_prompt_cache(loaded.model), n=1)
        assert close(logprobs, fresh, "float32")


def test_a_hybrid_cache_ending_on_a_boundary_keeps_its_state_and_restores() -> None:
    loaded = tiny("tiny-hybrid")
    rng = np.random.default_rng(4)
    system = random_tokens(rng, 2 * BLOCK)
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, loaded)
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array(system)[None], cache=cache)  # a "system" segment, prefilled
        pc.insert_cache(KEY, system, cache, cache_type="system")
        bank.flush()  # committed: a hybrid restores no chain still queued
        assert pc.stats()["recomputed_tokens"] == 0  # its own state was at the boundary
        assert pc.stats_by_type()["system"] == {"n_sequences": 1, "n_bytes": pc.nbytes}
        prompt = system + random_tokens(rng, 9)
        restored, rest = pc.fetch_nearest_cache(KEY, prompt)
        assert restored is not None and rest == prompt[2 * BLOCK :]
        _, logprobs = run(loaded.model, rest, restored, n=1)
        _, fresh = run(loaded.model, prompt, make_prompt_cache(loaded.model), n=1)
        assert close(logprobs, fresh, "float32")


def test_other_models_unsupported_caches_and_trim(caplog: pytest.LogCaptureFixture) -> None:
    loaded = tiny("tiny-qwen3")
    rng = np.random.default_rng(5)
    tokens = random_tokens(rng, 3 * BLOCK)
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, loaded, model_key=KEY)
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array(tokens)[None], cache=cache)
        # Another model's key: a miss, and nothing is stored.
        pc.insert_cache(("other", None, None), tokens, cache)
        assert pc.nbytes == 0 and pc.stats()["other_model"] == 1
        assert pc.fetch_nearest_cache(("other", None, None), tokens) == (None, tokens)
        # A cache the bank cannot hold is logged and skipped: serving goes on.
        rotating = [RotatingKVCache(max_size=8) for _ in cache]
        with caplog.at_level(logging.ERROR, logger="cas_bank.mlx_lm"):
            pc.insert_cache(KEY, tokens, rotating)
        assert pc.stats()["failures"] == 1 and "RotatingKVCache" in caplog.text
        pc.insert_cache(KEY, tokens, cache, cache_type="user")
        bank.flush()  # nbytes counts what the background writer wrote
        assert pc.nbytes > 0 and set(pc.stats_by_type()) == set(CACHE_TYPES)
        with pytest.raises(InvalidInputError, match="not sequences"):
            pc.trim_to(n_sequences=1)
        pc.trim_to(n_bytes=0)  # evicts every block
        assert pc.nbytes == 0
        assert pc.fetch_nearest_cache(KEY, tokens) == (None, tokens)


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_salted_cache_shares_only_with_its_own_salt(kv_bits: int | None) -> None:
    loaded = wide("tiny-qwen3") if kv_bits else tiny("tiny-qwen3")
    prompt = random_tokens(np.random.default_rng(26), 3 * BLOCK + 5)
    with temp_bank(BLOCK) as bank:
        base = BankPromptCache(bank, loaded, model_key=KEY, kv_bits=kv_bits, kv_group_size=32)
        a = base.salted("tenant-a")
        assert base.salted(None) is base and a.salted("tenant-a") is a
        cache = make_prompt_cache(loaded.model)
        if kv_bits:
            cache = [c.to_quantized(group_size=32, bits=kv_bits) for c in cache]
        generated, _ = run(loaded.model, prompt, cache)
        a.insert_cache(KEY, prompt + generated, cache)
        for other in (base, base.salted("tenant-b"), BankPromptCache(bank, loaded, salt="b")):
            assert other.fetch_nearest_cache(KEY, prompt) == (None, prompt)
        again = BankPromptCache(
            bank, loaded, model_key=KEY, salt="tenant-a", kv_bits=kv_bits, kv_group_size=32
        )
        restored, rest = again.fetch_nearest_cache(KEY, prompt)
        # Its full blocks, then the end record's first tokens (a partial block): all
        # of the prompt but the last token.
        assert restored is not None and rest == prompt[-1:]
        # One set of counters: a view counts into the cache it came from.
        assert base.stats()["inserts"] == 1 and base.stats()["hits"] == 0


def _prefilled(model: Any, tokens: list[int]) -> list[Any]:
    """mlx-lm's cache after one forward pass over `tokens` (as its server prefills)."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _next_logits(model: Any, cache: list[Any], tokens: list[int]) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits)
    return logits[0, -1]


def test_a_prompt_sharing_part_of_a_stored_one_leaves_only_its_new_tokens() -> None:
    """As mlx-lm's `LRUPromptCache` trims a stored cache to the longest common prefix,
    token by token: a prompt sharing 26 tokens of a stored 40-token prompt (block 16:
    one whole block, then 10 tokens of the next, a partial block) leaves only its 8
    new ones, as mlx-lm's own cache does; an exact repeat leaves exactly 1 (mlx-lm's
    generator needs one), from the end record's first 39 tokens. The logits of the
    rest are those of the same forward passes without the bank (bit for bit)."""
    loaded = tiny("tiny-qwen3")
    model = loaded.model
    rng = np.random.default_rng(12)
    stored = random_tokens(rng, 40)
    branch = [*stored[:26], (stored[26] + 1) % 512, *random_tokens(rng, 7)]
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, loaded, model_key=KEY)
        pc.insert_cache(KEY, stored, _prefilled(model, stored))
        theirs = LRUPromptCache(max_size=4)
        theirs.insert_cache(KEY, stored, _prefilled(model, stored))
        _, their_rest = theirs.fetch_nearest_cache(KEY, branch)
        for prompt, n in ((branch, 26), (stored, 39)):
            cache, rest = pc.fetch_nearest_cache(KEY, prompt)
            assert rest == prompt[n:] and cache[0].offset == n
            reference = _prefilled(model, stored)  # the stored pass, trimmed back to n
            for c in reference:
                c.trim(len(stored) - n)
            assert mx.array_equal(
                _next_logits(model, cache, rest), _next_logits(model, reference, rest)
            ).item()
        assert their_rest == branch[26:]  # mlx-lm's own cache leaves the same 8
        assert bank.stats().partial_hits == 2 and pc.stats()["hit_tokens"] == 26 + 39
