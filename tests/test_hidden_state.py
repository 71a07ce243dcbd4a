"""The last token's hidden state for multi-token prediction (issue 44, item 2): a
`PrefixCache(keep_hidden=True)` keeps it in the end records its prefills write, and
`restore_exact(..., with_hidden=True)` returns it with the logits, bit-identical to the
hidden state a straight prefill computes; off by default, where it costs bytes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from cas_bank.runtime.prefill import hidden_parts
from mlx_lm.models.cache import make_prompt_cache
from runtime_helpers import bit_equal, random_tokens, temp_bank, tiny

from cas_bank.errors import InvalidInputError

BLOCK = 16
MODELS = ["tiny-qwen3", "tiny-hybrid"]


@pytest.mark.parametrize("name", MODELS)
def test_the_body_and_head_are_the_models_own_forward_pass(name: str) -> None:
    model = tiny(name).model
    parts = hidden_parts(model)
    assert parts is not None
    x = mx.array(random_tokens(np.random.default_rng(0), 20))[None]
    whole = model(x, cache=make_prompt_cache(model))
    split = parts[1](parts[0](x, make_prompt_cache(model)))
    assert bit_equal(whole, split)


def straight_hidden(name: str, tokens: list[int], ends: list[int]) -> mx.array:
    """The last token's hidden state of a fresh forward pass over `tokens`, one chunk
    to each of `ends` (the prefill's own schedule)."""
    pc_model = tiny(name).model
    body, _ = hidden_parts(pc_model)  # type: ignore[misc]
    cache = make_prompt_cache(pc_model)
    pos, h = 0, None
    for stop in ends:
        h = body(mx.array(tokens[pos:stop])[None], cache)
        pos = stop
    assert h is not None
    return h[0, -1]


@pytest.mark.parametrize("background", [True, False], ids=["queued", "inline"])
@pytest.mark.parametrize("name", MODELS)
def test_restore_exact_returns_the_hidden_state_a_prefill_kept(name: str, background: bool) -> None:
    rng = np.random.default_rng(1)
    prompt = random_tokens(rng, 2 * BLOCK + 7)
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(
            bank, tiny(name), chunk_size=BLOCK, keep_hidden=True, background=background
        )
        cache = pc.new_cache()
        logits = pc.prefill(prompt, cache)
        ends = list(pc.last_prefill.chunk_ends)
        bank.flush()
        del cache
        _, n, got, hidden = pc.restore_exact(prompt, with_hidden=True)
        assert n == len(prompt) and got is not None and bit_equal(got, logits)
        assert hidden is not None and bit_equal(hidden, straight_hidden(name, prompt, ends))
        assert pc.restore_exact(prompt)[2] is not None  # the three-tuple as before
        assert len(pc.restore_exact(prompt)) == 3


def test_without_keep_hidden_no_hidden_state_is_stored_and_it_costs_no_bytes() -> None:
    rng = np.random.default_rng(2)
    prompt = random_tokens(rng, 2 * BLOCK + 7)
    sizes = {}
    for keep in (False, True):
        with temp_bank(BLOCK) as bank:
            pc = PrefixCache(bank, tiny("tiny-qwen3"), chunk_size=BLOCK, keep_hidden=keep)
            pc.prefill(prompt, pc.new_cache())
            bank.flush()
            sizes[keep] = bank.stats().end_bytes
            hidden = pc.restore_exact(prompt, with_hidden=True)[3]
            assert (hidden is not None) == keep
    hidden_size = tiny("tiny-qwen3").model.args.hidden_size
    assert sizes[True] - sizes[False] >= hidden_size * 4  # one float32 vector, and no more
    assert sizes[True] - sizes[False] < hidden_size * 4 + 256


def test_a_model_that_does_not_expose_its_hidden_state_is_refused_by_name() -> None:
    class Opaque(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.layers = inner.layers
            self.args = inner.args  # its configuration, but no body nor head of its own

        def __call__(self, x: mx.array, cache: object = None) -> mx.array:
            return self.inner(x, cache=cache)

    assert hidden_parts(Opaque(tiny("tiny-qwen3").model)) is None
    with temp_bank(BLOCK) as bank, pytest.raises(InvalidInputError, match="Opaque"):
        PrefixCache(bank, Opaque(tiny("tiny-qwen3").model), keep_hidden=True)


def test_a_model_that_scales_its_logits_after_the_head_is_refused() -> None:
    """granite divides its logits by `logits_scaling` after the head: its body and head
    alone would store (and hand back) other logits than the model's."""
    from mlx_lm.models import granite

    args = granite.ModelArgs(
        model_type="granite", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=512, logits_scaling=8.0,
        attention_multiplier=0.125, embedding_multiplier=1.0, residual_multiplier=1.0,
        max_position_embeddings=4096, num_key_value_heads=2, attention_bias=False,
        mlp_bias=False, rope_theta=10000.0,
    )  # fmt: skip
    mx.random.seed(0)
    model = granite.Model(args)
    mx.eval(model.parameters())
    assert hidden_parts(model) is not None  # it has a body and a head...
    with temp_bank(BLOCK) as bank:
        with pytest.raises(InvalidInputError, match="exactly the model's logits"):
            PrefixCache(bank, model, keep_hidden=True)  # ...that do not give its logits
        PrefixCache(bank, model)  # without keep_hidden: served as any model
