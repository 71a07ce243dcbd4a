"""Embedded models, local model directories, weights digests and the byte tokenizer.

Real mlx-lm models with seeded random weights, real files in a tmp dir, a real
Hugging Face tokenizer built offline: no mocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from cas_bank.runtime.models import (
    MODEL_NAMES,
    LoadedModel,
    build_model,
    load_model,
    model_config,
    model_context_length,
    save_model,
    weights_digest,
)
from cas_bank.runtime.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    ByteTokenizer,
    chat_tokens,
    decode_tokens,
    eos_token_ids,
)
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

TINY_NAMES = [name for name in MODEL_NAMES if name.startswith("tiny-")]
PROMPT = [BOS_TOKEN_ID, *range(40, 80)]


def logits_for(loaded: LoadedModel, tokens: list[int]) -> tuple[mx.array, list[Any]]:
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([tokens]), cache=cache)
    mx.eval(logits)
    return logits, cache


# --- embedded models ---------------------------------------------------------------


def test_registry_has_tiny_and_medium_models() -> None:
    assert set(TINY_NAMES) == {"tiny-qwen3", "tiny-llama", "tiny-hybrid", "tiny-qwen3_5"}
    assert {"medium-qwen3", "medium-hybrid"} <= set(MODEL_NAMES)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_model_builds_and_prefills_into_a_prompt_cache(name: str) -> None:
    loaded = build_model(name)
    logits, cache = logits_for(loaded, PROMPT)

    assert loaded.name == name
    assert logits.shape == (1, len(PROMPT), 512)
    assert bool(mx.all(mx.isfinite(logits)))
    for layer_cache in cache:
        if isinstance(layer_cache, KVCache):
            assert layer_cache.offset == len(PROMPT)
    assert model_context_length(loaded) == 32768


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-qwen3_5"])
def test_hybrid_models_alternate_gdn_and_attention_caches(name: str) -> None:
    cache = make_prompt_cache(build_model(name).model)
    assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache, KVCache]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_attention_models_have_only_kv_caches(name: str) -> None:
    cache = make_prompt_cache(build_model(name).model)
    assert cache and all(type(c) is KVCache for c in cache)


def test_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny-qwen3") as info:
        build_model("no-such-model")
    assert "no-such-model" in str(info.value)


def test_model_config_is_a_copy_that_callers_may_change() -> None:
    config = model_config("tiny-qwen3_5")
    config["text_config"]["num_hidden_layers"] = 99
    config["vocab_size"] = 7
    assert model_config("tiny-qwen3_5")["text_config"]["num_hidden_layers"] == 4
    assert "vocab_size" not in model_config("tiny-qwen3_5")


def test_bfloat16_build_keeps_float32_where_the_model_asks() -> None:
    loaded = build_model("tiny-qwen3_5", dtype=mx.bfloat16)
    layer = loaded.model.language_model.model.layers[0].linear_attn
    assert layer.in_proj_qkv.weight.dtype == mx.bfloat16
    assert layer.A_log.dtype == mx.float32  # its cast_predicate excludes A_log
    logits, _ = logits_for(loaded, PROMPT)
    assert logits.dtype == mx.bfloat16


@pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="the limit is the CPU's")
def test_mixture_of_experts_model_refuses_a_dtype_the_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match="float32 only"):
        build_model("tiny-hybrid", dtype=mx.bfloat16)


# --- weights digest ----------------------------------------------------------------


def test_digest_is_stable_for_the_same_seed_and_dtype() -> None:
    first, second = build_model("tiny-hybrid"), build_model("tiny-hybrid")
    assert first.model is not second.model
    assert first.weights_digest == second.weights_digest
    assert len(first.weights_digest) == 64
    int(first.weights_digest, 16)


def test_digest_changes_with_seed_dtype_and_model() -> None:
    digests = {
        build_model("tiny-qwen3").weights_digest,
        build_model("tiny-qwen3", seed=1).weights_digest,
        build_model("tiny-qwen3", dtype=mx.bfloat16).weights_digest,
        build_model("tiny-qwen3", dtype=mx.float16).weights_digest,
        build_model("tiny-llama").weights_digest,
    }
    assert len(digests) == 5


def test_digest_is_cached_per_model_and_refreshed_on_request() -> None:
    loaded = build_model("tiny-llama")
    assert weights_digest(loaded.model) == loaded.weights_digest

    loaded.model.model.norm.weight = loaded.model.model.norm.weight * 2
    # Cached: weights are taken as immutable once loaded.
    assert weights_digest(loaded.model) == loaded.weights_digest
    assert weights_digest(loaded.model, refresh=True) != loaded.weights_digest


# --- local model directories -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, None) for name in TINY_NAMES] + [("tiny-qwen3", mx.bfloat16)],
)
def test_save_then_load_gives_the_same_weights_and_logits(
    tmp_path: Path, name: str, dtype: mx.Dtype | None
) -> None:
    built = build_model(name, seed=3, dtype=dtype)
    directory = save_model(built, tmp_path / "model")
    loaded = load_model(directory)

    assert loaded.weights_digest == built.weights_digest
    assert loaded.config == built.config
    assert loaded.name == "model"
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.tokenizer.vocab_size == 512
    built_logits, _ = logits_for(built, PROMPT)
    loaded_logits, _ = logits_for(loaded, PROMPT)
    assert mx.array_equal(built_logits, loaded_logits)


def test_load_model_names_the_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(missing)


def test_load_model_rejects_a_file(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"model\.bin"):
        load_model(file)


def test_load_model_names_what_the_directory_lacks(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)
    save_model(build_model("tiny-llama"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\*\.safetensors"):
        load_model(tmp_path)


def test_save_model_refuses_a_directory_with_other_weight_shards(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="other weight files"):
        save_model(build_model("tiny-llama"), tmp_path)


def test_local_hugging_face_tokenizer_is_loaded_and_adapted(tmp_path: Path) -> None:
    # A real (tiny, word-level) Hugging Face tokenizer, built offline.
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":"]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=(
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}"
        ),
    )
    save_model(build_model("tiny-llama"), tmp_path)
    hf_tokenizer.save_pretrained(str(tmp_path))

    loaded = load_model(tmp_path)
    assert not isinstance(loaded.tokenizer, ByteTokenizer)
    ids = chat_tokens(loaded.tokenizer, [{"role": "user", "content": "hello world"}])
    assert ids == [5, 7, 3, 4, 6, 7]
    assert decode_tokens(loaded.tokenizer, [3, 4]) == "hello world"
    assert eos_token_ids(loaded.tokenizer) == {2}

    # save_model carries the tokenizer files along.
    again = load_model(save_model(loaded, tmp_path / "copy"))
    assert chat_tokens(again.tokenizer, [{"role": "user", "content": "hello"}]) == [5, 7, 3, 6, 7]
    assert again.weights_digest == loaded.weights_digest


# --- byte tokenizer ----------------------------------------------------------------

TOKENIZER = ByteTokenizer()

messages_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]),
            "content": st.text(max_size=40),
        }
    ),
    max_size=6,
)


@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    ids = TOKENIZER.encode(text)
    assert all(0 <= i < 256 for i in ids)  # text can never forge a special token
    assert TOKENIZER.decode(ids) == text


@given(messages_strategy, st.data())
def test_chat_rendering_of_a_prefix_is_a_token_prefix(
    messages: list[dict[str, str]], data: st.DataObject
) -> None:
    full = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True)
    cut = data.draw(st.integers(0, len(messages)))
    head = TOKENIZER.apply_chat_template(messages[:cut], add_generation_prompt=False)
    assert full[: len(head)] == head
    if cut < len(messages) and messages[cut]["role"] == "assistant":
        # A turn's prompt is a prefix of the conversation that includes its reply.
        prompt = TOKENIZER.apply_chat_template(messages[:cut], add_generation_prompt=True)
        assert full[: len(prompt)] == prompt


def test_chat_template_layout_and_decoding_of_specials() -> None:
    ids = chat_tokens(TOKENIZER, [{"role": "user", "content": "hé"}])
    assert decode_tokens(TOKENIZER, ids) == "<|bos|><|user|>hé<|end|><|assistant|>"
    assert TOKENIZER.decode([EOS_TOKEN_ID, 300]) == "<|eos|><|reserved_300|>"


def test_chat_content_may_be_text_parts_or_none() -> None:
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    assert TOKENIZER.apply_chat_template(
        [{"role": "user", "content": parts}]
    ) == TOKENIZER.apply_chat_template([{"role": "user", "content": "abc"}])
    assert TOKENIZER.apply_chat_template([{"role": "assistant", "content": None}])
    with pytest.raises(ValueError, match="text content parts"):
        TOKENIZER.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])


def test_unknown_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="'robot'"):
        TOKENIZER.apply_chat_template([{"role": "robot", "content": "x"}])


def test_decode_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="512"):
        TOKENIZER.decode([65, 512])
    with pytest.raises(ValueError, match="-1"):
        TOKENIZER.decode([-1])


def test_byte_tokenizer_needs_room_for_its_specials() -> None:
    assert len(SPECIAL_TOKENS) == MIN_VOCAB_SIZE - 256
    ByteTokenizer(vocab_size=MIN_VOCAB_SIZE)
    with pytest.raises(ValueError, match=str(MIN_VOCAB_SIZE)):
        ByteTokenizer(vocab_size=MIN_VOCAB_SIZE - 1)


def test_byte_tokenizer_stops_on_eos_and_end_of_message() -> None:
    assert TOKENIZER.eos_token_id == EOS_TOKEN_ID
    assert eos_token_ids(TOKENIZER) == {EOS_TOKEN_ID, SPECIAL_TOKENS["<|end|>"]}
