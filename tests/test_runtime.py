"""PrefixCache with real tiny mlx-lm models: the derived spec, the cache objects it
hands out, storing after decoding (StateRecorder), and bad input refused with clear
errors before anything runs or is stored."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache, StateRecorder, load_model, save_model, spec_for_model
from cas_bank.runtime.models import model_config
from cas_bank.runtime.prefill import chunk_ends
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes
from runtime_helpers import (
    bit_equal,
    forward,
    random_tokens,
    temp_bank,
    tiny,
    wide,
)

from cas_bank import Bank, BankConfig, InvalidInputError


def counters(bank: Bank) -> dict[str, int]:
    s = bank.stats()
    return {k: getattr(s, k) for k in ("blocks", "states", "payload_bytes", "stores")}


# -- the spec ----------------------------------------------------------------------
def test_hybrid_spec_reads_layouts_from_real_caches() -> None:
    lm = tiny("tiny-hybrid")
    spec = spec_for_model(lm)
    assert spec.name == "qwen3_next"
    assert [ls.kind for ls in spec.layers] == ["recurrent", "attention"] * 2
    att, rec = spec.layers[1], spec.layers[0]
    assert [a.shape for a in att.arrays] == [(1, 2, 16), (1, 2, 16)]
    assert {a.dtype for a in att.arrays} == {"float32"}
    conv, state = rec.arrays
    # conv (B, K-1, conv_dim): q and k of 2 heads x 16 plus v of 4 heads x 16.
    assert conv.shape == (1, 3, 2 * 2 * 16 + 4 * 16)
    assert state.shape == (1, 4, 16, 16) and state.dtype == "float32"
    assert spec.weights_digest == lm.weights_digest
    assert spec.tokenizer == "byte:512"


def test_bf16_hybrid_keeps_its_recurrent_state_in_float32() -> None:
    spec = spec_for_model(tiny("tiny-qwen3_5", "bfloat16"))
    assert {a.dtype for a in spec.layers[1].arrays} == {"bfloat16"}
    assert spec.layers[0].arrays[1].dtype == "float32"


def test_quantized_kv_spec_and_caches() -> None:
    with temp_bank() as bank:
        pc = PrefixCache(bank, wide("tiny-qwen3"), kv_bits=4, kv_group_size=32)
        q = pc.spec.layers[0].quantization
        assert q is not None and (q.bits, q.group_size) == (4, 32)
        assert [a.shape for a in pc.spec.layers[0].arrays[:3]] == [(1, 2, 4), (1, 2, 1), (1, 2, 1)]
        assert all(type(c) is QuantizedKVCache for c in pc.new_cache())
        plain = PrefixCache(bank, wide("tiny-qwen3"))
        assert plain.namespace.root != pc.namespace.root


def test_kv_quantization_that_cannot_fit_the_heads_is_refused() -> None:
    with temp_bank() as bank, pytest.raises(InvalidInputError, match="probe"):
        PrefixCache(bank, tiny("tiny-qwen3"), kv_bits=8, kv_group_size=32)  # head_dim 16
    with temp_bank() as bank, pytest.raises(InvalidInputError, match="kv_bits=7"):
        PrefixCache(bank, wide("tiny-qwen3"), kv_bits=7)


def test_spec_is_content_identity_not_object_or_path(tmp_path: Any) -> None:
    """Built twice, bare module or LoadedModel, saved and loaded: one namespace."""
    lm = tiny("tiny-qwen3")
    again = spec_for_model(tiny("tiny-qwen3", seed=0).model)
    loaded = load_model(save_model(lm, tmp_path / "some-dir-name"))
    assert spec_for_model(lm).fingerprint == again.fingerprint
    assert spec_for_model(loaded).fingerprint == again.fingerprint
    assert spec_for_model(tiny("tiny-qwen3", seed=1)).fingerprint != again.fingerprint
    assert spec_for_model(tiny("tiny-qwen3", "bfloat16")).fingerprint != again.fingerprint


# -- caches and prefill ------------------------------------------------------------
def test_chunks_end_on_the_grid_and_on_capture_boundaries() -> None:
    assert chunk_ends(100, 0, 32, []) == [32, 64, 96, 100]
    assert chunk_ends(100, 40, 32, [48, 96]) == [48, 64, 96, 100]
    assert chunk_ends(10, 0, 512, [8]) == [8, 10]


def test_restore_fills_mlx_lm_cache_objects() -> None:
    rng = np.random.default_rng(0)
    toks = random_tokens(rng, 50)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        pc.prefill(toks, pc.new_cache())
        bank.flush()  # the background writer committed it (a hybrid restores from disk)
        assert pc.match(toks) == 48
        cache, n = pc.restore(toks)
        assert n == 48
        assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache, KVCache]
        # With room for the whole prompt (mlx-lm's step), from the lease as from disk.
        assert all(c.offset == 48 and c.keys.shape[2] == 256 for c in cache[1::2])
        assert all(c.cache[0] is not None and c.cache[1] is not None for c in cache[::2])
        # The restored cache continues like any mlx-lm cache.
        logits = pc.model(mx.array(toks[48:])[None], cache=cache)
        assert logits.shape == (1, 2, 512) and cache[1].offset == 50


def test_restore_leaves_at_least_one_token_and_a_miss_is_empty() -> None:
    rng = np.random.default_rng(1)
    toks = random_tokens(rng, 32)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        cache, n = pc.restore(toks)
        assert n == 0 and all(c.offset == 0 for c in cache)
        pc.prefill(toks, cache, n)
        bank.flush()  # committed: the children index finds block 1 (not a queued store)
        _, n = pc.restore(toks)  # 32 tokens stored, 31 may be restored: block 1 in part
        assert n == 31
        _, n = pc.restore([*toks, 5])
        assert n == 32


def test_store_after_decoding_with_a_state_recorder() -> None:
    """Decode token by token past a boundary; the next turn restores beyond the prompt,
    exactly as the same forward passes without the bank."""
    rng = np.random.default_rng(5)
    prompt = random_tokens(rng, 40)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"), chunk_size=512)
        cache = pc.new_cache()
        logits = pc.prefill(prompt, cache)
        assert pc.last_prefill is not None and pc.last_prefill.captured == [32]
        rec = pc.recorder(cache)
        assert isinstance(rec, StateRecorder)
        response: list[int] = []
        for _ in range(30):  # positions 41..70: crosses 48 and 64
            token = int(mx.argmax(logits).item())
            response.append(token)
            logits = pc.model(mx.array([[token]]), cache=cache)[0, -1]
            rec.observe()
        assert rec.captured == [48, 64]
        full = prompt + response
        # Without the end record (the default keeps it: all of `full` restores, as
        # below with generate_step), the next turn restores from the recorder's state.
        report = pc.store(full, cache, states=rec, end=False).result()  # waits for the writer
        assert report.blocks == 4 and report.blocks_written == 2 and report.states_written == 1

        turn = [*full, *random_tokens(rng, 5)]
        cache2, n = pc.restore(turn)
        assert n == 64
        restored = pc.prefill(turn, cache2, n, store=False)
        ref = pc.new_cache()
        forward(pc, ref, prompt, 0, [32, 40])
        for t in response:
            pc.model(mx.array([[t]]), cache=ref)
        reference = forward(pc, ref, turn, len(full), [len(turn)])
        assert bit_equal(restored, reference)


def test_state_recorder_under_mlx_lm_generate_step() -> None:
    """Observed at every yield of generate_step (which runs one step ahead), the
    recorder labels every state with the position the cache really held."""
    rng = np.random.default_rng(16)
    prompt = random_tokens(rng, 40)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        cache = pc.new_cache()
        first = int(mx.argmax(pc.prefill(prompt, cache)).item())
        rec = pc.recorder(cache)
        steps = generate_step(mx.array([first]), pc.model, prompt_cache=cache, max_tokens=30)
        response = [first]
        for token, _ in steps:
            response.append(token)
            rec.observe()
        full = prompt + response
        assert cache[1].offset == len(full) == 71
        assert rec.captured == [48, 64]
        pc.store(full, cache, states=rec).result()  # committed: a hybrid restores from disk

        turn = [*full, *random_tokens(rng, 3)]
        cache2, n = pc.restore(turn)
        assert n == len(full)  # its end record (the recorder's state is at 64)
        restored = pc.prefill(turn, cache2, n, store=False)
        ref = pc.new_cache()
        forward(pc, ref, prompt, 0, [32, 40])
        for t in response:
            pc.model(mx.array([[t]]), cache=ref)
        assert bit_equal(restored, forward(pc, ref, turn, len(full), [len(turn)]))


def test_recorder_keeps_the_two_deepest_boundaries() -> None:
    with temp_bank(4) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        cache = pc.new_cache()
        rec = pc.recorder(cache)
        for token in random_tokens(np.random.default_rng(2), 14):
            pc.model(mx.array([[token]]), cache=cache)
            rec.observe()
        assert rec.captured == [8, 12]
        assert list(rec.states_for(13)) == [12]
        assert list(rec.states_for(12)) == [8]  # strictly before the last token


def test_attention_only_store_after_generation() -> None:
    rng = np.random.default_rng(6)
    prompt = random_tokens(rng, 20)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-llama"))
        cache = pc.new_cache()
        pc.prefill(prompt, cache)
        response = random_tokens(rng, 20)
        for t in response:
            pc.model(mx.array([[t]]), cache=cache)
        full = prompt + response
        report = pc.store(full, cache).result()  # waits for the writer
        assert (report.blocks, report.blocks_written) == (2, 1)
        assert pc.match([*full, 1]) == len(full)  # whole blocks and the end record


# -- bad input ---------------------------------------------------------------------
def test_a_cache_of_another_model_is_refused_and_nothing_is_stored() -> None:
    rng = np.random.default_rng(8)
    toks = random_tokens(rng, 40)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        other_weights = PrefixCache(bank, tiny("tiny-qwen3", seed=1))
        before = counters(bank)
        with pytest.raises(InvalidInputError, match="layers"):
            pc.prefill(toks, make_prompt_cache(tiny("tiny-llama").model))
        with pytest.raises(InvalidInputError, match="another model"):
            pc.prefill(toks, other_weights.new_cache())
        with pytest.raises(InvalidInputError, match="attention layer but the cache holds"):
            pc.prefill(toks, make_prompt_cache(tiny("tiny-hybrid").model))
        used = pc.new_cache()
        pc.prefill(toks, used, store=False)
        with pytest.raises(InvalidInputError, match="holds 40 tokens but start=0"):
            pc.prefill(toks, used)
        with pytest.raises(InvalidInputError, match="list"):
            pc.prefill(toks, None)  # type: ignore[arg-type]
        assert counters(bank) == before


def test_a_cache_with_another_layout_is_refused() -> None:
    """Same layer count and classes, other head size: caught by the shapes."""
    rng = np.random.default_rng(9)
    toks = random_tokens(rng, 20)
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        cache = make_prompt_cache(wide("tiny-qwen3"))
        wide("tiny-qwen3")(mx.array([toks[:4]]), cache=cache)
        before = counters(bank)
        with pytest.raises(InvalidInputError, match="another model"):
            pc.prefill(toks, cache, start=4)
        assert counters(bank) == before


def test_tokens_beyond_the_vocabulary_are_refused_before_any_forward_pass() -> None:
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        before = counters(bank)
        cache = pc.new_cache()
        with pytest.raises(InvalidInputError, match="512 is beyond the vocabulary"):
            pc.prefill([1, 2, 512, 3], cache)
        assert all(c.offset == 0 for c in cache)
        with pytest.raises(InvalidInputError, match="beyond the vocabulary"):
            pc.restore([1, 2, 99999])
        with pytest.raises(InvalidInputError, match="outside"):
            pc.prefill([1, -1], cache)
        with pytest.raises(InvalidInputError, match="at least one"):
            pc.restore([])
        with pytest.raises(InvalidInputError, match="start=3"):
            pc.prefill([1, 2, 3], cache, start=3)
        assert counters(bank) == before


def _sliding_llama() -> Any:
    """A real mlx-lm llama with a sliding-window layer (its cache is a RotatingKVCache)."""
    config = model_config("tiny-llama")
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    return model_class(args_class.from_dict(copy.deepcopy(config)))


def test_unsupported_cache_classes_are_refused_by_name() -> None:
    with temp_bank(16) as bank:
        with pytest.raises(InvalidInputError, match="RotatingKVCache"):
            PrefixCache(bank, _sliding_llama())
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        before = counters(bank)
        rotating = make_prompt_cache(pc.model, max_kv_size=64)
        with pytest.raises(InvalidInputError, match="RotatingKVCache"):
            pc.prefill([1, 2, 3], rotating)
        with pytest.raises(InvalidInputError, match="RotatingKVCache"):
            pc.store([1, 2, 3], rotating)
        assert counters(bank) == before


def test_store_refuses_a_cache_shorter_than_the_tokens() -> None:
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        cache = pc.new_cache()
        toks = random_tokens(np.random.default_rng(4), 20)
        pc.prefill(toks, cache, store=False)
        before = counters(bank)
        with pytest.raises(InvalidInputError, match="fewer than"):
            pc.store([*toks, 1, 2], cache)
        assert counters(bank) == before


def test_a_read_only_bank_restores_and_stores_nothing(tmp_path: Any) -> None:
    toks = random_tokens(np.random.default_rng(15), 40)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=16)) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        pc.prefill(toks, pc.new_cache())
        bank.flush()  # the counters once the background writer committed the store
        before = counters(bank)
    with Bank.open(tmp_path / "bank", mode="read_only") as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        longer = [*toks, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        cache, n = pc.restore(longer)
        assert n == 40  # the prefill's end record
        pc.prefill(longer, cache, n)
        assert pc.last_prefill is not None and pc.last_prefill.stored is None
        assert counters(bank) == before
