"""`VisionPrefixCache`: an mlx-vlm model's prompt caches in and out of a bank, with
its images in the key (docs/design.md, "Image keys (format v1)").

    vpc = VisionPrefixCache(bank, model)            # mlx-vlm Qwen2-VL, 2.5-VL or 3-VL
    prompt = vpc.prompt(input_ids, pixel_values, image_grid_thw)  # the processor's output
    cache, n = vpc.restore(prompt)                  # restored before the LM's prefill
    logits = vpc.prefill(prompt, cache, start=n)    # the rest; stores after, as for text

The bank stores the language model's KV under the prompt's key sequence
(`cas_bank.blocks.image_keys`): text ids as they are, an image's positions keyed by
the digest of its pixels and the offset inside it. Everything `PrefixCache` does for
text (salts, background stores, partial blocks, end records, `restore_exact`,
`explain`) works unchanged on it. Restores (`restore`, `match`, `restore_exact`,
`explain`) take the `VisionPrompt` (or text ids): its image spans set where a restore
is cut back (`image_keys.restore_point`), which a bare key sequence cannot.

A prefill from `n` runs the vision encoder only on the images with positions at or
after `n`, one image at a time (in a restore or not, so the features, and the logits,
are the same bits either way): an image that a restore covers costs nothing.
Multimodal RoPE: the positions of the whole prompt come from its ids and grids
(`get_rope_index`, no pixels needed); each chunk takes its slice, and after a
prefill or an exact restore the language model's rope deltas are set so that
`model.language_model(token[None], cache=cache)` decodes on at the right positions.

Supported: mlx-vlm's `qwen2_vl`, `qwen2_5_vl` and `qwen3_vl` (causal attention over
the image, one run of image tokens per image; Qwen3-VL's deepstack features, added to
the first layers' hidden states at the image's positions, are passed to each chunk for
its own image positions, and kept with the features). Refused with an error naming
the model: any other (Gemma 3 attends both ways inside an image, so its KV there
depends on where a prefill chunk starts), and prompts with video tokens (their spans
are not keyed yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cas_bank.bank import Bank
from cas_bank.blocks.hashing import as_token_array, max_token
from cas_bank.blocks.image_keys import (
    KEY_BIT,
    ImageSpan,
    image_digest,
    key_sequence,
    restore_point,
    spans_of,
)
from cas_bank.errors import InvalidInputError
from cas_bank.maintenance.explain import Explanation, explain

from .prefix_cache import PrefixCache
from .vlm_features import FeatureCache

SUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_WHY_NOT = {
    "gemma3": "Gemma 3 attends both ways inside an image, so a restore point inside one "
    "would change its KV",
}


class UnsupportedVisionModel(InvalidInputError):
    """A model whose image tokens cas_bank cannot key (its type named)."""


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt as the model takes it (`ids`, `pixel_values` and `grids` of its images,
    in order) and as the bank keys it (`keys`, `spans`)."""

    ids: np.ndarray
    keys: np.ndarray
    spans: tuple[ImageSpan, ...]
    pixel_values: np.ndarray | None
    grids: np.ndarray | None  # [images, 3]: (t, h, w) patches

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> VisionPrompt:
        """This prompt followed by text `tokens` (an answer, the next turn's words)."""
        more = as_token_array(tokens)
        return replace(
            self,
            ids=np.concatenate([self.ids, more]),
            keys=np.concatenate([self.keys, key_sequence(more, [])]),
        )


def check_supported(model: nn.Module) -> str:
    """The model's type, or `UnsupportedVisionModel` naming it and why."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if (
        getattr(model, "language_model", None) is None
        or getattr(model, "vision_tower", None) is None
    ):
        raise UnsupportedVisionModel(
            f"{type(model).__name__} is not an mlx-vlm vision-language model (no "
            f"language_model and vision_tower); an mlx-lm model takes PrefixCache"
        )
    if kind not in SUPPORTED:
        why = _WHY_NOT.get(str(kind), "its image tokens are not keyed by cas_bank yet")
        raise UnsupportedVisionModel(
            f"mlx-vlm model type {kind!r} is not supported on the bank: {why} "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    return str(kind)


@dataclass(frozen=True)
class _Feed:
    """What a prefill from `start` feeds the language model: the input rows of
    `prompt[start:]`, the whole prompt's positions and (Qwen3-VL) the image positions
    of `prompt[start:]` with each deepstack layer's rows for them, in order."""

    prompt: VisionPrompt
    start: int
    embeds: mx.array
    positions: mx.array
    visual: np.ndarray  # bool, one a position of prompt[start:]
    deepstack: list[mx.array]

    def deepstack_for(self, at: int, stop: int) -> dict[str, Any]:
        """The deepstack arguments of the chunk [at, stop) (none where it has no image)."""
        mask = self.visual[at - self.start : stop - self.start]
        if not self.deepstack or not mask.any():
            return {}
        first = int(np.count_nonzero(self.visual[: at - self.start]))
        n = int(np.count_nonzero(mask))
        return {
            "visual_pos_masks": mx.array(mask)[None],
            "deepstack_visual_embeds": [d[first : first + n] for d in self.deepstack],
        }


class _LanguageModel(nn.Module):
    """The VLM's language model as `PrefixCache` drives an mlx-lm model: `(tokens,
    cache) -> logits`. Its parameters are the whole VLM's (the weights digest covers
    the vision tower) and its `args` the whole config. During a prefill `feed` holds
    the prompt's embeddings from `start` and its positions; each chunk takes its rows
    by the cache's offset."""

    def __init__(self, vlm: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.vlm = vlm
        self.args = vlm.config
        self.feed: _Feed | None = None

    @property
    def layers(self) -> Any:
        return self.vlm.language_model.model.layers

    def __call__(self, x: mx.array, cache: list[Any] | None = None) -> mx.array:
        lm = self.vlm.language_model
        if self.feed is None:  # text only (the spec's one-token probe)
            logits: mx.array = lm(x, cache=cache).logits
            return logits
        feed = self.feed
        at = cache[0].offset if cache else 0
        stop = at + x.shape[1]
        if not np.array_equal(np.asarray(x[0]), feed.prompt.keys[at:stop]):
            raise InvalidInputError("a chunk's tokens are not the prompt's keys at its offset")
        ids = mx.array(feed.prompt.ids[at:stop].astype(np.int32))[None]
        rows = feed.embeds[:, at - feed.start : stop - feed.start]
        out = lm(
            ids,
            inputs_embeds=rows,
            cache=cache,
            position_ids=feed.positions[..., at:stop],
            **feed.deepstack_for(at, stop),
        )
        chunk_logits: mx.array = out.logits
        return chunk_logits


class VisionPrefixCache(PrefixCache):
    """`PrefixCache` for an mlx-vlm model (see the module docstring). The keyword
    arguments are `PrefixCache`'s; `keep_hidden` is refused (its split of the model
    is a text model's). `features` (default True): keep each image's vision encoder
    output in the bank too (`runtime.vlm_features`), so an image seen before after
    another prefix is not encoded again. `last_encoded`: the images the last prefill
    ran the vision encoder on; `last_feature_hits`: those whose features it read."""

    def __init__(
        self, bank: Bank, model: nn.Module, *, features: bool = True, **kwargs: Any
    ) -> None:
        self.kind = check_supported(model)
        if kwargs.get("keep_hidden"):
            raise InvalidInputError("keep_hidden is not supported for vision-language models")
        self.vlm = model
        self.adapter = _LanguageModel(model)
        self._reset_rope()
        super().__init__(bank, self.adapter, **kwargs)
        self._reset_rope()  # the spec's probe left its own positions there
        self.last_encoded = self.last_feature_hits = 0
        cfg = model.config
        self.image_token = int(getattr(cfg, "image_token_index", None) or cfg.image_token_id)
        self.width = int(getattr(cfg, "text_config", cfg).hidden_size)
        # Qwen3-VL: the encoder's deepstack layers, kept beside its features
        self.deepstack_layers = len(getattr(cfg.vision_config, "deepstack_visual_indexes", []))
        self.features = (
            FeatureCache.for_model(
                bank,
                self.spec,
                self.kind,
                self.width * (1 + self.deepstack_layers),
                model.vision_tower.patch_embed.proj.weight.dtype,
                kwargs.get("salt"),
            )
            if features
            else None
        )

    def salted(self, salt: str | bytes | None) -> VisionPrefixCache:
        """This VisionPrefixCache for another tenant's salt (features salted alike)."""
        other = super().salted(salt)
        if other is not self and self.features is not None:
            assert isinstance(other, VisionPrefixCache)
            other.features = self.features.salted(salt)
        return other  # type: ignore[return-value]

    # -- prompts -------------------------------------------------------------------
    def prompt(
        self,
        input_ids: Any,
        pixel_values: Any = None,
        image_grid_thw: Any = None,
        **extra: Any,
    ) -> VisionPrompt:
        """The prompt of the processor's output (`prepare_inputs`'s `input_ids`,
        `pixel_values`, `image_grid_thw`; a batch of one): its images digested and its
        key sequence made. Video inputs are refused (not keyed yet)."""
        if any(extra.get(k) is not None for k in ("pixel_values_videos", "video_grid_thw")):
            raise InvalidInputError("video inputs are not supported on the bank yet")
        ids = as_token_array(np.asarray(input_ids))
        if max_token(ids) >= self.vocab_size:
            raise InvalidInputError(f"a token id is beyond the vocabulary of {self.kind!r}")
        if np.count_nonzero(ids == self.vlm.config.video_token_id):
            raise InvalidInputError("video tokens are not supported on the bank yet")
        if pixel_values is None:
            if np.count_nonzero(ids == self.image_token):
                raise InvalidInputError("the prompt has image tokens but no pixel_values")
            return VisionPrompt(ids, key_sequence(ids, []), (), None, None)
        pixels, grids = self._images(pixel_values, image_grid_thw)
        rows = np.cumsum([0, *(int(np.prod(g)) for g in grids)])
        digests = [
            image_digest(pixels[a:b], g) for a, b, g in zip(rows, rows[1:], grids, strict=False)
        ]
        spans = spans_of(ids, self.image_token, digests)
        merge = self.vlm.config.vision_config.spatial_merge_size**2
        for s, g in zip(spans, grids, strict=True):
            if s.length * merge != int(np.prod(g)):
                raise InvalidInputError(
                    f"image at {s.start}: {s.length} image tokens for a grid of {g.tolist()}"
                )
        return VisionPrompt(ids, key_sequence(ids, spans), tuple(spans), pixels, grids)

    def _images(self, pixel_values: Any, image_grid_thw: Any) -> tuple[np.ndarray, np.ndarray]:
        """The processor's pixel rows and each image's (t, h, w) grid of patches, checked
        against each other and the vision tower; InvalidInputError names what does not
        fit (before the tower would fail on it inside a prefill)."""
        if image_grid_thw is None:
            raise InvalidInputError("pixel_values need image_grid_thw (each image's patches)")
        if isinstance(pixel_values, mx.array) and pixel_values.dtype == mx.bfloat16:
            pixel_values = pixel_values.astype(mx.float32)  # exact; numpy has no bfloat16
        pixels, grids = np.asarray(pixel_values), np.asarray(image_grid_thw)
        if grids.dtype.kind not in "iu" or grids.ndim < 1 or grids.shape[-1] != 3:
            raise InvalidInputError(f"image_grid_thw {grids.tolist()}: 3 values an image")
        grids = grids.reshape(-1, 3)
        merge = self.vlm.config.vision_config.spatial_merge_size
        if (grids < 1).any() or (grids[:, 1:] % merge).any():
            raise InvalidInputError(
                f"image_grid_thw {grids.tolist()}: each (t, h, w) positive, h and w "
                f"multiples of {merge}"
            )
        width = int(np.prod(self.vlm.vision_tower.patch_embed.proj.weight.shape[1:]))
        if pixels.ndim != 2 or pixels.shape[1] != width:
            raise InvalidInputError(f"pixel_values of shape {pixels.shape}: rows of {width}")
        total = int(grids.prod(axis=1).sum())
        if total != len(pixels):
            raise InvalidInputError(
                f"pixel_values has {len(pixels)} patches; the grids say {total}"
            )
        return pixels, grids

    def tokens(self, tokens: Any) -> np.ndarray:
        """A prompt's keys (or a key sequence), checked: text ids in the vocabulary."""
        if isinstance(tokens, VisionPrompt):
            return tokens.keys
        toks = as_token_array(tokens)
        text = toks[toks < KEY_BIT]
        if text.size and max_token(text) >= self.vocab_size:
            raise InvalidInputError(f"a token id is beyond the vocabulary of {self.kind!r}")
        return toks

    # -- restore -------------------------------------------------------------------
    def match(self, tokens: Any) -> int:
        """Tokens `restore(prompt)` would cover now, without reading payloads."""
        p = self.as_prompt(tokens)
        return restore_point(super().match(p.keys), p.spans)

    def restore(self, tokens: Any) -> tuple[list[Any], int]:
        """A fresh cache holding the longest stored prefix of the prompt but its last
        token, and its length: never fewer than `MIN_IMAGE_KEYS` positions into an
        image, nor past one of fewer than `MIN_SHORT_IMAGE_KEYS` positions
        (`image_keys.restore_point`; the cache is cut back to it)."""
        p = self.as_prompt(tokens)
        cache, n = super().restore(p.keys)
        return cache, self._cut(cache, n, p.spans)

    def restore_exact(self, tokens: Any, *, with_hidden: bool = False) -> Any:
        """`PrefixCache.restore_exact` for a prompt: with the last token's logits (an end
        record of exactly this prompt) the language model's rope deltas are set, so
        decoding goes on with no prefill at all. A restore cut back before an image
        (`restore_point`) returns no logits: they are the last token's."""
        if with_hidden:
            raise InvalidInputError("with_hidden is not supported for vision-language models")
        p = self.as_prompt(tokens)
        cache, n, logits, _ = self._restore_exact(p.keys)
        m = self._cut(cache, n, p.spans)
        if m < n:  # cut back before an image too short to restore past: no logits
            return cache, m, None
        if logits is not None:
            self._set_rope(p)
        return cache, n, logits

    def explain(self, tokens: Any) -> Explanation:
        """`cas_bank.maintenance.explain` of the prompt's key sequence: where its restore
        stops and why (a divergence inside an image shows key tokens, >= 2**31), its
        restorable tokens cut back as a restore is (`restore_point`). Takes what the
        restores take: the `VisionPrompt`, or text ids."""
        p = self.as_prompt(tokens)
        why = explain(self.bank, self.namespace.root, p.keys)
        return replace(why, restorable_tokens=restore_point(why.restorable_tokens, p.spans))

    def as_prompt(self, tokens: Any) -> VisionPrompt:
        """`tokens` as the prompt a restore needs: a `VisionPrompt` as it is, text ids as
        a prompt with no image. A bare key sequence is refused: it does not say where
        its images start, and a restore cuts back to one (`restore_point`)."""
        if isinstance(tokens, VisionPrompt):
            return tokens
        ids = as_token_array(tokens)
        if max_token(ids) >= KEY_BIT:
            raise InvalidInputError(
                "a key sequence does not say where its images start: restore, match, "
                "restore_exact and explain take the VisionPrompt (vpc.prompt(...)) or text ids"
            )
        return self.prompt(ids)

    @staticmethod
    def _cut(cache: list[Any], n: int, spans: Sequence[ImageSpan]) -> int:
        m = restore_point(n, spans)
        if m < n:
            for c in cache:
                c.trim(n - m)
        return m

    # -- prefill -------------------------------------------------------------------
    def prefill(  # type: ignore[override]
        self, prompt: VisionPrompt, cache: list[Any], start: int = 0, **kwargs: Any
    ) -> mx.array:
        """`PrefixCache.prefill` of a `VisionPrompt` from `start` (what `restore` gave):
        the images with positions at or after `start` are encoded, one at a time, the
        rest of the prompt runs through the language model and is stored (blocks and
        end record, as for text), and the rope deltas are left set for decoding."""
        if not isinstance(prompt, VisionPrompt):
            raise InvalidInputError("prefill takes a VisionPrompt (vpc.prompt(...))")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(prompt):
            raise InvalidInputError(f"start={start!r} must leave tokens of the {len(prompt)}")
        positions = self._set_rope(prompt)
        embeds, deepstack = self._embeddings(prompt, start, kwargs.get("store", True))
        visual = prompt.ids[start:] == self.image_token
        self.adapter.feed = _Feed(prompt, start, embeds, positions, visual, deepstack)
        try:
            return super().prefill(prompt.keys, cache, start, **kwargs)
        finally:
            self.adapter.feed = None

    def _embeddings(
        self, prompt: VisionPrompt, start: int, store: bool
    ) -> tuple[mx.array, list[mx.array]]:
        """The language model's input rows of `prompt[start:]`: token embeddings, and
        each image's features at its positions (only images reaching `start` or past
        it are encoded, and their features stored with `store`); and each deepstack
        layer's rows of those image positions."""
        ids = mx.array(prompt.ids[start:].astype(np.int32))[None]
        text = self.vlm.language_model.model.embed_tokens(ids)
        pieces, at, encoded, hits = [], start, 0, 0
        stacks: list[mx.array] = []
        for i, s in enumerate(prompt.spans):
            if s.end <= start:
                continue
            features, hit = self.image_features(prompt, i, store=store)
            hits, encoded = hits + hit, encoded + (not hit)
            rows = features[max(s.start, start) - s.start :]
            pieces += [
                text[:, at - start : max(s.start, start) - start],
                rows[None, :, : self.width],
            ]
            stacks.append(rows[:, self.width :])
            at = s.end
        pieces.append(text[:, at - start :])
        self.last_encoded, self.last_feature_hits = encoded, hits
        embeds = mx.concatenate(pieces, axis=1) if len(pieces) > 1 else text
        w = self.width
        deepstack = (
            [
                mx.concatenate([r[:, j * w : (j + 1) * w] for r in stacks])
                for j in range(self.deepstack_layers)
            ]
            if stacks
            else []
        )
        return embeds, deepstack

    def image_features(
        self, prompt: VisionPrompt, i: int, *, store: bool = True
    ) -> tuple[mx.array, bool]:
        """Image `i`'s vision encoder output, [its positions, width] (Qwen3-VL: its
        deepstack layers' beside), and whether it came from the bank: else encoded now,
        alone, and kept in the bank with `store` (images of fewer than 4 positions are
        never kept). `UnsupportedVisionModel` where it would widen the embeddings."""
        span = prompt.spans[i]
        features = self.features.get(span) if self.features is not None else None
        if features is not None:
            return features, True
        features = self._encode(prompt, i)
        empty = mx.zeros((1, 0), dtype=mx.int32)
        self._check_widening(features, self.vlm.language_model.model.embed_tokens(empty))
        if self.features is not None and store and not self.bank.read_only:
            self.features.put(span, features)
        return features, False

    def _check_widening(self, features: mx.array, text: mx.array) -> None:
        """UnsupportedVisionModel where the encoder's features would widen the input
        rows (float32 features into bfloat16 embeddings): mlx-vlm runs such an image
        prompt, and keeps its KV, in the wider type, a text prompt in the narrower."""
        rows = mx.concatenate([text[0, :0], features[:0, : self.width]])
        if rows.dtype != text.dtype:
            wide, narrow = (str(d).rsplit(".", 1)[-1] for d in (features.dtype, text.dtype))
            raise UnsupportedVisionModel(
                f"mlx-vlm model type {self.kind!r}: its vision tower gives {wide} features "
                f"and its language model {narrow} embeddings, so an image prompt's KV "
                f"would be {wide} and a text prompt's {narrow}; give the model one dtype "
                f"(model.set_dtype)"
            )

    def _encode(self, prompt: VisionPrompt, i: int) -> mx.array:
        """The vision encoder's output for image `i` alone: [its positions, width],
        then (Qwen3-VL) each deepstack layer's [its positions, width], side by side."""
        assert prompt.pixel_values is not None and prompt.grids is not None
        sizes = [int(np.prod(g)) for g in prompt.grids]
        a = sum(sizes[:i])
        tower = self.vlm.vision_tower
        pixels = mx.array(prompt.pixel_values[a : a + sizes[i]])
        pixels = pixels.astype(tower.patch_embed.proj.weight.dtype)
        grid = mx.array(prompt.grids[i : i + 1].astype(np.int32))
        if self.kind == "qwen3_vl":
            features, deepstack = tower(pixels, grid)
            return mx.concatenate([features, *deepstack], axis=-1)
        out: mx.array = tower(pixels, grid, output_hidden_states=False)
        return out

    def positions(self, prompt: VisionPrompt) -> tuple[mx.array, mx.array]:
        """The prompt's multimodal RoPE positions [3, 1, T] and its rope delta (the
        model's own `get_rope_index`: ids and grids, no pixels)."""
        ids = mx.array(prompt.ids.astype(np.int32))[None]
        grids = None if prompt.grids is None else mx.array(prompt.grids.astype(np.int32))
        pos, deltas = self.vlm.language_model.get_rope_index(ids, grids, None, None)
        if pos.ndim == 2:
            pos = mx.broadcast_to(pos[None], (3, *pos.shape))
        return pos, deltas

    def _set_rope(self, prompt: VisionPrompt) -> mx.array:
        """Leave the language model's rope state as its own prefill of `prompt` would:
        decoding then takes positions from the cache's offset plus the delta."""
        pos, deltas = self.positions(prompt)
        lm = self.vlm.language_model
        lm._position_ids, lm._rope_deltas = pos, deltas
        return pos

    def _reset_rope(self) -> None:
        lm = self.vlm.language_model
        lm._position_ids = lm._rope_deltas = None

    def __repr__(self) -> str:
        return f"VisionPrefixCache({self.kind!r}, block_size={self.block_size})"
