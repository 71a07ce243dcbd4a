"""Speculative decoding on the bank (issue 44, item 1): a draft model's caches kept in a
namespace of their own beside the model's, restored to the same length.

In process (tiny real models, no server): `DraftPrefixCache` restores both models bit
for bit as the same forward passes without the bank would leave them, and only as far
as both hold a prompt (an end record of one and not the other; a hybrid side, whose
recurrent state cannot be trimmed); `BankPromptCache(draft_model=...)` under mlx-lm's
own `speculative_generate_step` answers greedy prompts as it does without the bank,
across a reopen, with salts, with a hybrid draft model. One test runs the real
`cas-bank mlx-lm-server --draft-model` process: temperature-0 answers with the bank
equal those without it (a fresh salt restores nothing), across a restart, salted and
concurrent requests (mlx-lm serves them all on its sequential path: its batched path
never runs with a draft model).
"""

from __future__ import annotations

import argparse
import importlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache
from cas_bank.runtime.draft_cache import DraftPrefixCache, restore_together
from hf_models import hf_tokenizer, model_dir
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from runtime_helpers import (
    ATOL,
    bit_equal,
    forward,
    metric,
    random_tokens,
    same_schedule_logits,
    temp_bank,
    tiny,
)
from test_mlx_lm_server import TIMEOUT, answer, cached, chat, conversation, ids, start

from cas_bank import Bank, BankConfig
from cas_bank.index.tree import load_namespaces

BLOCK = 16
PROMPT = 2 * BLOCK + 10  # 42 tokens: two full blocks and a partial one
KEY = ("model-dir", None, "draft-dir")  # mlx-lm's model_key with a draft model


def pair(bank: Bank, model: str, draft: str, **kw: Any) -> DraftPrefixCache:
    return DraftPrefixCache(bank, tiny(model), tiny(draft, seed=1), chunk_size=BLOCK, **kw)


# -- DraftPrefixCache: both models, one length, bit for bit ---------------------------------
@pytest.mark.parametrize(
    ("model", "draft"),
    [("tiny-qwen3", "tiny-llama"), ("tiny-qwen3", "tiny-hybrid"), ("tiny-hybrid", "tiny-qwen3")],
)
def test_the_next_turn_restores_both_models_bit_for_bit(model: str, draft: str) -> None:
    rng = np.random.default_rng(1)
    prompt = random_tokens(rng, PROMPT)
    turn = prompt + random_tokens(rng, 7)
    with temp_bank(BLOCK) as bank:
        p = pair(bank, model, draft)
        cache, n = p.restore(prompt)
        assert n == 0 and len(cache) == len(p.model.spec.layers) + len(p.draft.spec.layers)
        p.prefill(prompt, cache, n)  # both stored: blocks, planned states, end records
        first = [list(pc.last_prefill.chunk_ends) for pc in p.sides]  # type: ignore[union-attr]

        cache, n = p.restore(turn)
        assert n == len(prompt)  # both end records: all of the prompt
        logits = p.prefill(turn, cache, n)
        again = [list(pc.last_prefill.chunk_ends) for pc in p.sides]  # type: ignore[union-attr]
        for pc, out, a, b in zip(p.sides, (logits, p.last_draft_logits), first, again, strict=True):
            assert out is not None
            assert bit_equal(out, forward(pc, pc.new_cache(), turn, 0, a + b)), pc.spec.name
        bank.flush()
        roots = {pc.namespace.root for pc in p.sides}
        assert len(roots) == 2 and set(load_namespaces(bank.store)[0]) == roots


@pytest.mark.parametrize(
    ("model", "draft", "stored"),
    [
        # The draft model kept whole blocks only (no end record): the model's end
        # record at 42 is trimmed back to the draft's 32.
        ("tiny-qwen3", "tiny-llama", ((PROMPT, True), (PROMPT, False))),
        # The draft holds 40 tokens exactly (its end record); the hybrid model has its
        # end record at 42 and a state at 32, none at 40: both hold 32.
        ("tiny-hybrid", "tiny-qwen3", ((PROMPT, True), (40, True))),
        # The model holds 40 exactly; the hybrid draft model its end record at 42: 32.
        ("tiny-qwen3", "tiny-hybrid", ((40, True), (PROMPT, True))),
    ],
)
def test_a_prompt_restores_only_as_far_as_both_hold_it(
    model: str, draft: str, stored: tuple[tuple[int, bool], tuple[int, bool]]
) -> None:
    """Each side stores a prefill of the prompt (its length, with or without its end
    record); a restore gives both the deepest length both restore exactly, the longer
    trimmed, and each continues bit for bit as its own forward passes would."""
    expected = 2 * BLOCK
    rng = np.random.default_rng(2)
    prompt = random_tokens(rng, PROMPT)
    turn = prompt + random_tokens(rng, 5)
    with temp_bank(BLOCK) as bank:
        p = pair(bank, model, draft)
        passes = []
        for pc, (length, end) in zip(p.sides, stored, strict=True):
            pc.prefill(prompt[:length], pc.new_cache(), 0, end=end)
            passes.append(list(pc.last_prefill.chunk_ends))  # type: ignore[union-attr]
        bank.flush()
        alone = [pc.match(turn) for pc in p.sides]
        assert max(alone) > expected  # one side alone restores further

        assert p.match(turn) == expected
        (mc, dc), n, trimmed = restore_together(p.sides, turn)
        kept = [a - n for a, pc in zip(alone, p.sides, strict=True) if not pc.spec.is_hybrid]
        assert n == expected and trimmed == sum(kept) > 0
        for pc, cache, (length, _), ends in zip(p.sides, (mc, dc), stored, passes, strict=True):
            toks = prompt[:length]
            got = pc.prefill(turn, cache, n, store=False)
            rest = list(pc.last_prefill.chunk_ends)  # type: ignore[union-attr]
            assert bit_equal(got, same_schedule_logits(pc, toks, ends, turn, n, rest))


def test_a_side_that_restores_less_than_it_matched_lowers_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Evicted between the look and the read (here: a `match` that overstates): the
    hybrid draft model, read to its end record at 42, is read again at the 16 the
    model restores (a state every block: `state_stride=1`)."""
    rng = np.random.default_rng(6)
    prompt = random_tokens(rng, PROMPT)
    turn = prompt + random_tokens(rng, 5)
    with temp_bank(BLOCK, state_stride=1) as bank:
        p = pair(bank, "tiny-qwen3", "tiny-hybrid")
        p.model.prefill(prompt[:20], p.model.new_cache(), end=False)  # 16 restorable
        p.draft.prefill(prompt, p.draft.new_cache())
        model_ends = list(p.model.last_prefill.chunk_ends)  # type: ignore[union-attr]
        bank.flush()
        monkeypatch.setattr(p.model, "match", lambda tokens: len(tokens) - 1)
        assert p.match(turn) == PROMPT  # what the look says
        (mc, dc), n, trimmed = restore_together(p.sides, turn)
        assert (n, trimmed) == (BLOCK, 0)
        assert {c.offset for c in mc} == {BLOCK} and dc[1].offset == BLOCK
        got = p.model.prefill(turn, mc, n, store=False)
        rest = list(p.model.last_prefill.chunk_ends)  # type: ignore[union-attr]
        expected = same_schedule_logits(p.model, prompt[:20], model_ends, turn, n, rest)
        assert bit_equal(got, expected)


def test_a_pair_under_a_salt_shares_nothing_with_no_salt() -> None:
    rng = np.random.default_rng(3)
    prompt = random_tokens(rng, PROMPT)
    with temp_bank(BLOCK) as bank:
        plain = pair(bank, "tiny-qwen3", "tiny-llama")
        salted = plain.salted("tenant-a")
        assert {pc.salt for pc in salted.sides} == {"tenant-a"}
        salted.prefill(prompt, salted.new_cache())
        assert salted.match(prompt) == len(prompt) - 1 and plain.match(prompt) == 0
        with pytest.raises(ValueError, match="draft model's 2"):
            plain.split(plain.model.new_cache())


# -- BankPromptCache under mlx-lm's speculative decoding ------------------------------------
def speculate(loaded: Any, draft: Any, prompt: list[int], cache: list[Any] | None) -> list[int]:
    """mlx-lm's speculative decoding, greedy, 10 tokens, 3 drafted at a time."""
    steps = speculative_generate_step(
        mx.array(prompt), loaded.model, draft.model, prompt_cache=cache,
        num_draft_tokens=3, max_tokens=10, sampler=make_sampler(0.0),
    )  # fmt: skip
    return [int(t) for t, _, _ in steps]


@pytest.mark.parametrize("draft_name", ["tiny-qwen3", "tiny-hybrid"])
def test_speculative_decoding_answers_as_without_the_bank(draft_name: str, tmp_path: Path) -> None:
    """As mlx-lm's server runs it: fetch, speculative decoding on the fetched caches (a
    fresh pair on a miss), insert of prompt + answer; the next turn, a repeat, and the
    same after the bank is reopened. Greedy answers equal those without the bank."""
    # tiny-llama's answers depend on the prompt (tiny-qwen3's repeat its last token).
    model, draft = tiny("tiny-llama"), tiny(draft_name, seed=1)
    rng = np.random.default_rng(4)
    prompt = random_tokens(rng, PROMPT)
    config = BankConfig(block_size=BLOCK)

    def serve(pc: BankPromptCache, tokens: list[int]) -> tuple[list[int], int]:
        cache, rest = pc.fetch_nearest_cache(KEY, tokens)
        if cache is None:
            cache = make_prompt_cache(model.model) + make_prompt_cache(draft.model)
        out = speculate(model, draft, list(rest), cache)
        pc.insert_cache(KEY, tokens + out, cache)
        return out, len(tokens) - len(rest)

    with Bank.open(tmp_path / "bank", config) as bank:
        pc = BankPromptCache(bank, model, draft_model=draft)
        out, hit = serve(pc, prompt)
        assert hit == 0 and out == speculate(model, draft, prompt, None)
        turn = prompt + out + random_tokens(rng, 6)
        follow, hit = serve(pc, turn)
        assert follow == speculate(model, draft, turn, None)
        # The model's cache holds the answer but (most often) its last token; the draft
        # model's the same or one less (all its drafts accepted): both restore to the
        # shorter.
        assert len(prompt) + len(out) - 2 <= hit <= len(prompt) + len(out)
        bank.flush()
        stats = pc.stats()
        assert stats["failures"] == 0 and stats["draft_bytes_written"] > 0
        if draft_name == "tiny-hybrid":  # its cache is prefilled again to be stored
            assert stats["recomputed_tokens"] > 0
        assert len(load_namespaces(bank.store)[0]) == 2
    with Bank.open(tmp_path / "bank", config) as bank:  # a restart
        pc = BankPromptCache(bank, model, draft_model=draft)
        again, hit = serve(pc, turn)
        assert again == follow and hit >= len(prompt) + len(out) - 2
        repeat, hit = serve(pc, prompt)
        assert repeat == out and hit == len(prompt) - 1
        salted = pc.salted("tenant-a")  # both models' namespaces under the salt
        assert salted.fetch_nearest_cache(KEY, prompt) == (None, prompt)
        assert salted.draft_prefix_cache is not None
        assert salted.draft_prefix_cache.namespace.root != pc.draft_prefix_cache.namespace.root  # type: ignore[union-attr]


def test_a_cache_without_the_draft_part_stores_the_model_and_restores_nothing() -> None:
    """mlx-lm's batched path never runs with a draft model; a cache of the model's layers
    alone (a caller without speculative decoding) stores the model's part, which a
    drafted fetch cannot use until the draft model's is stored too."""
    model, draft = tiny("tiny-qwen3"), tiny("tiny-llama", seed=1)
    prompt = random_tokens(np.random.default_rng(5), PROMPT)
    with temp_bank(BLOCK) as bank:
        pc = BankPromptCache(bank, model, draft_model=draft)
        cache = make_prompt_cache(model.model)
        model.model(mx.array(prompt)[None], cache=cache)
        pc.insert_cache(KEY, prompt, cache)
        assert pc.prefix_cache.match([*prompt, 1]) == len(prompt)
        assert pc.fetch_nearest_cache(KEY, [*prompt, 1]) == (None, [*prompt, 1])
        pc.insert_cache(KEY, prompt, cache[:2])  # neither the model's nor both
        assert pc.stats()["failures"] == 1
        both = make_prompt_cache(model.model) + make_prompt_cache(draft.model)
        speculate(model, draft, prompt, both)
        pc.insert_cache(KEY, prompt, both)
        restored, rest = pc.fetch_nearest_cache(KEY, [*prompt, 1])
        assert restored is not None and len(rest) == 1


# -- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_models")
    # tiny-llama answers with tokens that depend on the prompt (tiny-qwen3's tied
    # embeddings repeat the prompt's last token): the model; tiny-qwen3 drafts.
    return {
        "model": model_dir(root / "llama", "tiny-llama"),
        "draft": model_dir(root / "qwen3", "tiny-qwen3"),
    }


def test_mlx_lm_never_batches_a_draft_model(dirs: dict[str, Path]) -> None:
    """What the server relies on: mlx-lm's provider marks a model with a draft model not
    batchable, so every request goes to its sequential path (`_serve_single`), where
    the prompt cache holds both models' caches. Should a later mlx-lm batch them, its
    caches would hold the model's layers alone: this test says so first."""
    mls = importlib.import_module("mlx_lm.server")
    args = argparse.Namespace(
        model=str(dirs["model"]), adapter_path=None, draft_model=str(dirs["draft"]),
        pipeline=False, trust_remote_code=False, chat_template="",
        use_default_chat_template=False, kv_bits=None,
    )  # fmt: skip
    provider = mls.ModelProvider(args)
    provider.load_default()
    assert provider.draft_model is not None and provider.is_batchable is False


def same_answers(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same tokens, and their log-probabilities within float rounding (the model's
    passes over a restored prompt are not the ones over a fresh one)."""
    for a, b in zip(got, expected, strict=True):
        assert answer(a) == answer(b)
        mine, theirs = (r["choices"][0]["logprobs"]["content"] for r in (a, b))
        assert [t["id"] for t in mine] == [t["id"] for t in theirs]
        lp_mine, lp_theirs = ([t["logprob"] for t in x] for x in (mine, theirs))
        assert np.allclose(lp_mine, lp_theirs, atol=ATOL["float32"], rtol=0)


def test_the_server_with_a_draft_model_answers_as_without_the_bank(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    tok = hf_tokenizer(dirs["model"])
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    one, two = conversation("what is the weather in city 1?"), conversation("and in city 22?")
    greedy = {"temperature": 0.0, "max_tokens": 12, "logprobs": True}
    draft = ("--draft-model", str(dirs["draft"]), "--num-draft-tokens", "3")

    server = start(bank, dirs["model"], log, *draft)
    try:
        health = httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()
        said = (health["status"], health["bank_in_use"], health["draft_model"])
        assert said == ("ok", True, True)
        # Without the bank: a salt nobody used restores nothing.
        refs = [
            chat(server.url, m, cache_salt=f"fresh-{i}", **greedy) for i, m in enumerate((one, two))
        ]
        assert [cached(r) for r in refs] == [0, 0]
        first = chat(server.url, one, **greedy)
        assert cached(first) == 0  # the unsalted namespaces hold nothing yet
        # Sent together: mlx-lm serves them one after the other (sequential path).
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda m: chat(server.url, m, **greedy), [one, two]))
        tenant = [chat(server.url, one, cache_salt="tenant-a", **greedy) for _ in range(2)]
        metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    finally:
        assert server.stop() == 0, log.read_text()
    p1, p2 = ids(tok, one), ids(tok, two)
    assert cached(both[0]) == len(p1) - 1 and cached(both[1]) > 0
    assert [cached(r) for r in tenant] == [0, len(p1) - 1]
    same_answers([first, *both, *tenant], [refs[0], *refs, refs[0], refs[0]])
    assert metric(metrics, "cas_bank_bank_in_use") == 1
    assert metric(metrics, "cas_bank_prompt_cache_draft_bytes_written_total") > 0
    hits = sum(cached(r) for r in (*refs, first, *both, *tenant))
    assert metric(metrics, "cas_bank_prompt_cache_hit_tokens_total") == hits

    server = start(bank, dirs["model"], log, *draft)  # a restart: both models' caches kept
    try:
        again = [chat(server.url, m, **greedy) for m in (two, one)]
        tenant_again = chat(server.url, one, cache_salt="tenant-a", **greedy)
    finally:
        assert server.stop() == 0, log.read_text()
    assert [cached(r) for r in again] == [len(p2) - 1, len(p1) - 1]
    assert cached(tenant_again) == len(p1) - 1
    same_answers([*again, tenant_again], [refs[1], refs[0], refs[0]])
    with Bank.open(bank) as b:
        names = sorted(spec.name for spec in load_namespaces(b.store)[0].values())
    # The model's and the draft model's namespaces: unsalted, two fresh salts, a tenant.
    assert names == ["llama"] * 4 + ["qwen3"] * 4
