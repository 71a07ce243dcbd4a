"""Vision-language models on the bank (runtime/vlm.py): a restored prefill gives logits
bit-identical to mlx-vlm's own computation with the same forward passes (its batched
vision encoder, its merge of features into the embeddings, its multimodal RoPE), for
one image, several, one image at two places, and a prompt whose image differs under
the same placeholder ids; decoding on after a restore is exact too; two images at one
place share no block; models whose image tokens cannot be keyed are refused.

Real tiny mlx-vlm models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with seeded weights and transformers'
image processor from a local configuration (runtime/vlm_models.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime.prefill import PrefillCancelled
from cas_bank.runtime.vlm import UnsupportedVisionModel, VisionPrefixCache, VisionPrompt
from cas_bank.runtime.vlm_models import (
    TinyVLM,
    build_vlm,
    image_processor,
    random_image,
    vlm_inputs,
)
from runtime_helpers import bit_equal, temp_bank, tiny
from test_disk_full import fill, mount_tmpfs, unmount

from cas_bank import Bank, BankConfig
from cas_bank.blocks.image_keys import KEY_BIT, MIN_IMAGE_KEYS
from cas_bank.errors import InvalidInputError
from cas_bank.maintenance.verify import verify

BLOCK = 16
CHUNK = 24  # several forward passes a prompt: the schedule matters


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def vlm(request: pytest.FixtureRequest) -> TinyVLM:
    return build_vlm(request.param, seed=3)


@pytest.fixture
def vpc(vlm: TinyVLM) -> Iterator[VisionPrefixCache]:
    with temp_bank(BLOCK) as bank:
        yield VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK)


TEXT = list(range(40, 77))  # 37 ids: the image starts inside block 2


def prompt(vpc: VisionPrefixCache, vlm: TinyVLM, parts: Sequence[Any]) -> VisionPrompt:
    return vpc.prompt(*vlm_inputs(vlm.image_processor, parts))


def reference(
    vlm: TinyVLM,
    a: VisionPrompt,
    a_ends: Sequence[int],
    b: VisionPrompt,
    n: int,
    b_ends: Sequence[int],
) -> tuple[mx.array, list[Any]]:
    """The last logits of `b` and the cache, by mlx-vlm alone with the very forward
    passes of store + restore: `a`'s prefill (ends `a_ends`) cut back to n, then `b`'s
    passes from n. Embeddings and positions of each prompt: mlx-vlm's
    `get_input_embeddings` over all of it."""
    model = vlm.model
    lm = model.language_model
    cache = [_kv() for _ in lm.model.layers]

    def passes(p: VisionPrompt, start: int, ends: Sequence[int]) -> mx.array:
        ids = mx.array(p.ids.astype(np.int32))[None]
        kw = {} if p.grids is None else {"image_grid_thw": mx.array(p.grids)}
        pixels = None if p.pixel_values is None else mx.array(p.pixel_values)
        emb = model.get_input_embeddings(ids, pixels, **kw)
        pos = emb.position_ids
        if pos.ndim == 2:
            pos = mx.broadcast_to(pos[None], (3, *pos.shape))
        stack = {}  # Qwen3-VL: the whole prompt's, sliced by the LM to each pass
        if getattr(emb, "deepstack_visual_embeds", None) is not None:
            stack = {
                "visual_pos_masks": emb.visual_pos_masks,
                "deepstack_visual_embeds": emb.deepstack_visual_embeds,
            }
        at, logits = start, None
        for end in ends:
            if end <= at:
                continue
            logits = lm(
                ids[:, at:end],
                inputs_embeds=emb.inputs_embeds[:, at:end],
                cache=cache,
                position_ids=pos[..., at:end],
                **stack,
            ).logits
            mx.eval([c.state for c in cache])
            at = end
        assert logits is not None
        return logits[0, -1]

    if n:
        stop = next(e for e in a_ends if e >= n)
        passes(a, 0, [e for e in a_ends if e <= stop])
        for c in cache:
            c.trim(stop - n)
    return passes(b, n, b_ends), cache


def _kv() -> Any:
    from mlx_lm.models.cache import KVCache

    return KVCache()


def store_then_restore(
    vpc: VisionPrefixCache, vlm: TinyVLM, a: VisionPrompt, b: VisionPrompt
) -> tuple[int, mx.array, list[Any], mx.array, list[Any]]:
    """Prefill and store `a`; restore and prefill `b`. Returns the restore point, b's
    logits and cache, and the reference's."""
    cache, n = vpc.restore(a)
    assert n == 0
    vpc.prefill(a, cache, n)
    a_ends = vpc.last_prefill.chunk_ends
    vpc.bank.flush()
    cache, n = vpc.restore(b)
    got = vpc.prefill(b, cache, n)
    want, ref_cache = reference(vlm, a, a_ends, b, n, vpc.last_prefill.chunk_ends)
    return n, got, cache, want, ref_cache


def decode_step(vlm: TinyVLM, cache: list[Any], token: int) -> mx.array:
    return vlm.model.language_model(mx.array([[token]]), cache=cache).logits[0, -1]


def decode_reference(vlm: TinyVLM, cache: list[Any], p: VisionPrompt, token: int) -> mx.array:
    """The logits of `token` after `p`, at the position mlx-vlm's own `get_rope_index`
    gives it in `p` + token (no rope state of the model read)."""
    lm = vlm.model.language_model
    ids = mx.array([*p.ids.tolist(), token], dtype=mx.int32)[None]
    grids = None if p.grids is None else mx.array(p.grids.astype(np.int32))
    pos, _ = lm.get_rope_index(ids, grids, None, None)
    pos = pos if pos.ndim == 3 else mx.broadcast_to(pos[None], (3, *pos.shape))
    return lm(ids[:, -1:], cache=cache, position_ids=pos[..., -1:]).logits[0, -1]


def test_one_image_restored_exactly_and_decodes_on(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    img = random_image(1)
    a = prompt(vpc, vlm, [TEXT, img, [5, 6, 7, 8, 9]])
    b = prompt(vpc, vlm, [TEXT, img, [5, 6, 11, 12, 13, 14]])
    n, got, cache, want, ref_cache = store_then_restore(vpc, vlm, a, b)
    (span,) = b.spans
    assert n == span.end + 3  # the text, the image, its end token, 5, 6: the partial block
    assert vpc.last_encoded == 0  # the image was restored: no encoder run
    assert bit_equal(got, want)
    # Decoding goes on from the multimodal positions (the rope delta after a restore).
    assert vlm.model.language_model._rope_deltas.item() != 0
    for tok in (3, 4):
        assert bit_equal(decode_step(vlm, cache, tok), decode_reference(vlm, ref_cache, b, tok))
        b = b.extend([tok])


def test_several_images(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    i1, i2, i3 = random_image(1), random_image(2, (112, 56)), random_image(3, (56, 84))
    a = prompt(vpc, vlm, [TEXT, i1, [7, 8], i2, [9], i3, [10, 11, 12]])
    b = prompt(vpc, vlm, [TEXT, i1, [7, 8], i2, [9], i3, [10, 20, 21, 22]])
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert n == b.spans[-1].end + 2
    assert vpc.last_encoded == 0
    assert bit_equal(got, want)


def test_one_image_at_two_places(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    img = random_image(4)
    a = prompt(vpc, vlm, [TEXT, img, list(range(100, 120)), img, [1, 2, 3]])
    b = prompt(vpc, vlm, [TEXT, img, list(range(100, 120)), img, [1, 4, 5]])
    s1, s2 = b.spans
    assert s1.digest == s2.digest and np.array_equal(
        b.keys[s1.start : s1.end], b.keys[s2.start : s2.end]
    )
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert n == s2.end + 2
    assert bit_equal(got, want)


def test_other_image_under_the_same_ids(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """b's token ids equal a's everywhere; its image differs: b restores nothing of the
    image (only the text before it) and encodes it, exactly."""
    a = prompt(vpc, vlm, [TEXT, random_image(1), [5, 6, 7]])
    b = prompt(vpc, vlm, [TEXT, random_image(2), [5, 6, 7, 8]])
    assert np.array_equal(a.ids, b.ids[:-1])
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert n == b.spans[0].start  # the text and <vision_start>: the partial block up to it
    assert vpc.last_encoded == 1
    assert bit_equal(got, want)


def test_two_images_at_one_place_share_no_block(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    a = prompt(vpc, vlm, [TEXT, random_image(1), list(range(200, 240))])
    b = prompt(vpc, vlm, [TEXT, random_image(2), list(range(200, 240))])
    for p in (a, b):
        vpc.prefill(p, vpc.new_cache())
    vpc.bank.flush()
    ha, hb = vpc.namespace.chain(a.keys), vpc.namespace.chain(b.keys)
    first = a.spans[0].start // BLOCK
    assert ha[:first] == hb[:first]
    assert not set(ha[first:]) & set(hb)
    assert vpc.bank.stats().blocks == first + 2 * (len(ha) - first)
    assert vpc.match(b.extend([1])) == len(b)  # each is whole in the bank
    c = prompt(vpc, vlm, [TEXT, random_image(3), list(range(200, 240))])
    why = vpc.explain(c)
    assert why.divergence is not None and why.divergence.token == c.spans[0].start
    assert why.divergence.prompt_token >= KEY_BIT and why.divergence.stored_token >= KEY_BIT
    assert why.restorable_tokens == vpc.match(c) == c.spans[0].start
    # verify recomputes every chain hash from its header's (key) tokens: all sound
    report = verify(vpc.bank)
    assert report.problems == [] and report.blocks_checked == vpc.bank.stats().blocks
    assert report.ends_checked >= 2  # the prompts' and their images' features'


def test_restore_never_rests_on_few_image_keys(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """A stored prompt whose whole blocks end 3 positions into an image, with no end
    record: a restore stops at the image's start instead, and is exact."""
    img = random_image(5)
    a = prompt(vpc, vlm, [list(range(40, 85)), img])  # image tokens from 46 (block 2 ends at 48)
    b = prompt(vpc, vlm, [list(range(40, 85)), img, [1, 2]])
    assert a.spans[0].start == 46 and len(a) < 64
    vpc.keep_end = False
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert vpc.namespace.match(b.keys[:-1]) == 48  # the bank alone would give 48
    assert n == 46 < 46 + MIN_IMAGE_KEYS
    assert bit_equal(got, want)
    assert vpc.explain(b).restorable_tokens == 46  # explain tells the restore's cut
    with pytest.raises(InvalidInputError, match="VisionPrompt"):
        vpc.explain(b.keys)


def test_exact_repeat_needs_no_prefill(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    p = prompt(vpc, vlm, [TEXT, random_image(6), [5, 6, 7]])
    logits = vpc.prefill(p, vpc.new_cache())
    want_next = decode_step(vlm, _replay(vlm, vpc, p), 9)
    vpc.bank.flush()
    cache, n, got = vpc.restore_exact(p)
    assert n == len(p) and got is not None and bit_equal(got, logits)
    assert bit_equal(decode_step(vlm, cache, 9), want_next)


def _replay(vlm: TinyVLM, vpc: VisionPrefixCache, p: VisionPrompt) -> list[Any]:
    _, cache = reference(vlm, p, [], p, 0, vpc.last_prefill.chunk_ends)
    return cache


def test_salted_tenants_share_nothing(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    p = prompt(vpc, vlm, [TEXT, random_image(1), [5, 6, 7]])
    vpc.prefill(p, vpc.new_cache())
    vpc.bank.flush()
    assert vpc.match(p) == len(p) - 1
    assert vpc.salted("tenant-b").match(p) == 0


def test_refused_models_are_named() -> None:
    with temp_bank(BLOCK) as bank:
        with pytest.raises(UnsupportedVisionModel, match=r"'gemma3'.*both ways inside an image"):
            VisionPrefixCache(bank, build_vlm("tiny-gemma3").model)
        with pytest.raises(UnsupportedVisionModel, match="not an mlx-vlm vision-language"):
            VisionPrefixCache(bank, tiny("tiny-qwen3"))


@pytest.mark.parametrize("features", [True, False])
def test_image_after_another_prefix(vlm: TinyVLM, features: bool) -> None:
    """The same image after other text: its KV is not shared (the prefix differs), its
    encoder output is (`features`): read from the bank, the same bits, exact logits."""
    with temp_bank(BLOCK) as bank:
        vpc = VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK, features=features)
        img = random_image(7, (112, 112))  # 16 image tokens: a whole feature block
        a = prompt(vpc, vlm, [TEXT, img, [5, 6, 7]])
        b = prompt(vpc, vlm, [[9, 9, *TEXT], img, [5, 6, 8]])
        n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
        assert n == 0
        assert (vpc.last_encoded, vpc.last_feature_hits) == ((0, 1) if features else (1, 0))
        assert bit_equal(got, want)
        if features:  # another tenant reads none of them
            other = vpc.salted("other")
            assert other.features is not None
            assert other.features.get(b.spans[0]) is None
            assert vpc.features is not None and vpc.features.get(b.spans[0]) is not None


def test_next_turn_restores_prompt_and_answer(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """Prefill, decode an answer on the restored positions, store prompt + answer
    (`store` takes a VisionPrompt); the next turn restores all of it, exactly."""
    p = prompt(vpc, vlm, [TEXT, random_image(8), [5, 6, 7]])
    cache, n = vpc.restore(p)
    logits = vpc.prefill(p, cache, n)
    p_ends = vpc.last_prefill.chunk_ends
    answer = []
    for _ in range(3):
        answer.append(int(mx.argmax(logits).item()))
        logits = decode_step(vlm, cache, answer[-1])
    turn = p.extend(answer)
    vpc.store(turn, cache)
    vpc.bank.flush()
    nxt = turn.extend([30, 31, 32])
    cache, n = vpc.restore(nxt)
    assert n == len(turn)
    got = vpc.prefill(nxt, cache, n)
    decode_ends = [len(p) + i for i in range(1, len(answer) + 1)]
    want, _ = reference(vlm, turn, [*p_ends, *decode_ends], nxt, n, vpc.last_prefill.chunk_ends)
    assert bit_equal(got, want)


def test_bad_prompts_are_refused(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    ids, pixels, grid = vlm_inputs(vlm.image_processor, [TEXT, random_image(1), [5]])
    with pytest.raises(InvalidInputError, match="image tokens but no pixel_values"):
        vpc.prompt(ids)
    with pytest.raises(InvalidInputError, match="the grids say"):
        vpc.prompt(ids, pixels[:-4], grid)
    with pytest.raises(InvalidInputError, match=r"1 runs of image token .* but 2 images"):
        vpc.prompt(ids, np.concatenate([pixels, pixels]), np.concatenate([grid, grid]))
    with pytest.raises(InvalidInputError, match="video"):
        vpc.prompt(ids, pixels, grid, pixel_values_videos=pixels, video_grid_thw=grid)
    with pytest.raises(InvalidInputError, match="prefill takes a VisionPrompt"):
        vpc.prefill(vpc.prompt(ids, pixels, grid).keys, vpc.new_cache())  # type: ignore[arg-type]


def test_prompt_takes_mlx_arrays(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """What mlx-vlm's `prepare_inputs` returns: MLX arrays with a batch axis."""
    ids, pixels, grid = vlm_inputs(vlm.image_processor, [TEXT, random_image(1), [5]])
    p = vpc.prompt(ids, pixels, grid)
    q = vpc.prompt(mx.array(ids)[None], mx.array(pixels), mx.array(grid))
    assert np.array_equal(p.keys, q.keys) and p.spans == q.spans
    r = vpc.prompt(mx.array(ids)[None], mx.array(pixels).astype(mx.bfloat16), mx.array(grid))
    assert r.spans[0].digest != p.spans[0].digest  # other pixels (rounded): another image


def test_a_bare_key_sequence_is_not_restored(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """A key sequence alone does not say where its images start: restore, match and
    restore_exact refuse it (they would stop where the bank does, here 2 positions
    into an image) and take the VisionPrompt instead, whose spans set the cut."""
    img = random_image(5)
    a = prompt(vpc, vlm, [list(range(40, 85)), img])  # blocks end 2 positions into it
    b = prompt(vpc, vlm, [list(range(40, 85)), img, [1, 2]])
    vpc.keep_end = False
    vpc.prefill(a, vpc.new_cache())
    vpc.bank.flush()
    assert vpc.namespace.match(b.keys[:-1]) == a.spans[0].start + 2
    for call in (vpc.restore, vpc.match, vpc.restore_exact):
        with pytest.raises(InvalidInputError, match="VisionPrompt"):
            call(b.keys)
    assert vpc.match(b) == vpc.restore(b)[1] == a.spans[0].start


def test_exact_repeat_of_text_ids_decodes_on(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """restore_exact of text ids (no VisionPrompt) after a prompt with an image: its
    rope state is the text's, not the image prompt's left behind."""
    text = vpc.prompt(np.arange(40, 90))
    vpc.prefill(text, vpc.new_cache())
    ends = vpc.last_prefill.chunk_ends
    vpc.prefill(prompt(vpc, vlm, [TEXT[:5], random_image(1), [5, 6]]), vpc.new_cache())
    vpc.bank.flush()
    cache, n, logits = vpc.restore_exact(list(range(40, 90)))
    assert n == 50 and logits is not None
    got = decode_step(vlm, cache, 3)
    _, ref_cache = reference(vlm, text, [], text, 0, ends)
    at_50 = mx.full((3, 1, 1), 50, dtype=mx.int32)  # text positions: one a token
    lm = vlm.model.language_model
    want = lm(mx.array([[3]]), cache=ref_cache, position_ids=at_50).logits[0, -1]
    assert bit_equal(got, want)


def test_pixels_and_grids_that_do_not_fit_are_refused(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """Pixels and grids that the vision tower cannot take are refused by `prompt`, with
    what does not fit named, before any restore or store (the bank keeps what it has)."""
    ids, pixels, grid = vlm_inputs(vlm.image_processor, [TEXT, random_image(1), [5]])
    vpc.prefill(vpc.prompt(ids, pixels, grid), vpc.new_cache())
    vpc.bank.flush()
    blocks = vpc.bank.stats().blocks
    (t, h, w) = grid[0].tolist()
    bad = {
        "image_grid_thw": (pixels, None),
        "3 values": (pixels, grid[:, :2]),
        "multiples of 2": (pixels, np.array([[t, h // 2, w * 2]])),  # same patches, odd h
        "positive": (pixels, np.array([[t, -h, -w]])),
        "rows of 1176": (pixels[:, :-1], grid),
    }
    for why, (px, g) in bad.items():
        with pytest.raises(InvalidInputError, match=why):
            vpc.prompt(ids, px, g)
    assert vpc.bank.stats().blocks == blocks
    assert vpc.match(vpc.prompt(ids, pixels, grid)) == len(ids) - 1


def test_features_are_stored_as_the_prompt_is(vpc: VisionPrefixCache, vlm: TinyVLM) -> None:
    """`prefill(..., store=False)` stores nothing, the image's features neither."""
    p = prompt(vpc, vlm, [TEXT, random_image(1), [5, 6, 7]])
    vpc.prefill(p, vpc.new_cache(), store=False)
    vpc.bank.flush()
    assert vpc.last_encoded == 1 and vpc.bank.stats().blocks == 0
    assert vpc.features is not None and vpc.features.get(p.spans[0]) is None


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB (skipped where it cannot be mounted)."""
    mount_tmpfs(tmp_path / "mnt", "8m")
    try:
        yield tmp_path / "mnt"
    finally:
        unmount(tmp_path / "mnt")


def test_a_full_disk_skips_the_features_store(small_disk: Path) -> None:
    """`skip_store_when_full` on a bank that writes inline: the features' store skips
    the full disk as the prompt's does, and the prefill answers (one model: the store
    path is the same for all)."""
    vlm = build_vlm("tiny-qwen2-vl", seed=3)
    config = BankConfig(block_size=BLOCK, write_behind=0, file_min_bytes=0, hot_bytes=0)
    with Bank.open(small_disk / "bank", config) as bank:
        vpc = VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK, skip_store_when_full=True)
        fill(small_disk, 0)
        p = prompt(vpc, vlm, [TEXT, random_image(1), [5, 6, 7]])
        logits = vpc.prefill(p, vpc.new_cache())
        assert logits.shape == (vpc.vocab_size,) and bank.degraded is not None


def test_a_vision_tower_wider_than_the_language_model_is_refused() -> None:
    """float32 features into bfloat16 embeddings: mlx-vlm widens the image prompt's
    embeddings (and so its KV) to float32, against the bfloat16 of a text prompt; the
    prefill refuses it, naming both dtypes, before any forward pass or store."""
    vlm = build_vlm("tiny-qwen2-vl", seed=3)
    vlm.model.language_model.set_dtype(mx.bfloat16)
    with temp_bank(BLOCK) as bank:
        vpc = VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK)
        p = prompt(vpc, vlm, [TEXT, random_image(1), [5, 6, 7]])
        with pytest.raises(UnsupportedVisionModel, match=r"float32 features.*bfloat16"):
            vpc.prefill(p, vpc.new_cache())
        bank.flush()
        assert (bank.stats().blocks, bank.stats().ends) == (0, 0)


def test_a_reopened_bank_restores_and_decodes_on(vlm: TinyVLM, tmp_path: Path) -> None:
    """Stored, closed, reopened: a restore + prefill of a longer prompt (two images) and
    an exact repeat give mlx-vlm's logits, and decoding goes on at the positions
    mlx-vlm gives the next token (the rope deltas set from the reopened bank's hit)."""
    parts = [TEXT, random_image(1), [7, 8], random_image(2, (112, 56)), [9, 10]]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK)) as bank:
        vpc = VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK)
        a = prompt(vpc, vlm, [*parts, [11]])
        a_logits = vpc.prefill(a, vpc.new_cache())
        a_ends = vpc.last_prefill.chunk_ends
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK)) as bank:
        vpc = VisionPrefixCache(bank, vlm.model, chunk_size=CHUNK)
        b = prompt(vpc, vlm, [*parts, [12, 13, 14]])
        cache, n = vpc.restore(b)
        got = vpc.prefill(b, cache, n)
        want, ref_cache = reference(vlm, a, a_ends, b, n, vpc.last_prefill.chunk_ends)
        assert n == len(a) - 1 and vpc.last_encoded == 0 and bit_equal(got, want)
        assert bit_equal(decode_step(vlm, cache, 3), decode_reference(vlm, ref_cache, b, 3))
        cache, n, logits = vpc.restore_exact(a)
        assert n == len(a) and logits is not None and bit_equal(logits, a_logits)
        _, ref_cache = reference(vlm, a, [], a, 0, a_ends)
        assert bit_equal(decode_step(vlm, cache, 3), decode_reference(vlm, ref_cache, a, 3))


def test_a_cancelled_prefill_inside_an_image_is_cut_back(
    vpc: VisionPrefixCache, vlm: TinyVLM
) -> None:
    """A prefill cancelled 3 positions into an image stores up to there (whole blocks
    and an end record); the next attempt's restore stops at the image's start, exact."""
    p = prompt(vpc, vlm, [TEXT, random_image(7, (112, 112)), [5, 6, 7]])
    first = p.spans[0].start + 3
    vpc.chunk_size = first
    with pytest.raises(PrefillCancelled):
        vpc.prefill(p, vpc.new_cache(), cancelled=lambda: True)
    vpc.bank.flush()
    assert vpc.namespace.match(p.keys[:-1]) == first  # the bank alone
    cache, n = vpc.restore(p)
    assert n == vpc.match(p) == p.spans[0].start
    got = vpc.prefill(p, cache, n)
    want, _ = reference(vlm, p, [first], p, n, vpc.last_prefill.chunk_ends)
    assert bit_equal(got, want)


def test_an_image_of_few_positions_is_never_restored_past(
    vpc: VisionPrefixCache, vlm: TinyVLM
) -> None:
    """A processor that lets a 28x28 image be one position keys it by 31 bits: a
    restore stops at its start, however much of the prompt after it the bank holds."""
    small = image_processor(min_pixels=28 * 28)
    tail = list(range(100, 140))
    a = vpc.prompt(*vlm_inputs(small, [TEXT, random_image(1, (28, 28)), tail]))
    b = vpc.prompt(*vlm_inputs(small, [TEXT, random_image(1, (28, 28)), [*tail, 1]]))
    assert b.spans[0].length == 1
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert vpc.namespace.match(b.keys[:-1]) == len(a)  # the bank alone
    assert n == b.spans[0].start and bit_equal(got, want)


def test_features_of_an_image_of_few_positions_are_not_kept(
    vpc: VisionPrefixCache, vlm: TinyVLM
) -> None:
    """A one-position image's features would be named by its 31 bits alone: they are
    neither stored nor looked up; the image is encoded each time (it is small)."""
    small = image_processor(min_pixels=28 * 28)
    img = random_image(1, (28, 28))
    a = vpc.prompt(*vlm_inputs(small, [TEXT, img, [5, 6]]))
    b = vpc.prompt(*vlm_inputs(small, [[9, *TEXT], img, [5, 6]]))
    n, got, _, want, _ = store_then_restore(vpc, vlm, a, b)
    assert n == 0 and (vpc.last_encoded, vpc.last_feature_hits) == (1, 0)
    assert bit_equal(got, want)
    assert vpc.features is not None and vpc.features.get(a.spans[0]) is None


def test_an_exact_repeat_with_an_image_of_few_positions_prefills(
    vpc: VisionPrefixCache, vlm: TinyVLM
) -> None:
    """restore_exact of a prompt holding a one-position image: the end record's logits
    would come with a cache cut back to the image, so none are returned; the prefill
    from the cut is exact."""
    small = image_processor(min_pixels=28 * 28)
    p = vpc.prompt(*vlm_inputs(small, [TEXT, random_image(1, (28, 28)), [5, 6]]))
    vpc.prefill(p, vpc.new_cache())
    p_ends = vpc.last_prefill.chunk_ends
    vpc.bank.flush()
    cache, n, logits = vpc.restore_exact(p)
    assert n == p.spans[0].start and logits is None
    got = vpc.prefill(p, cache, n)
    want, _ = reference(vlm, p, p_ends, p, n, vpc.last_prefill.chunk_ends)
    assert bit_equal(got, want)
