"""The vision encoder's output for an image, in the bank beside the model's KV
(`VisionPrefixCache(..., features=True)`, the default).

A restore that covers an image skips its encoder already (the KV of its positions is
restored). An image that comes again after another prefix (another system prompt,
another conversation, the same screenshot in a new place) would be encoded again:
here its features are looked up first. They are stored in a namespace of their own
(`<model type>/vision-features`, the model's weights and config digests, the same
tenant salt), named by the image's key tokens alone (`image_keys.image_key_tokens`
of its digest: the same image is the same name wherever it sits; an image of fewer
than `MIN_SHORT_IMAGE_KEYS` positions, whose name would be under 124 bits, is encoded
each time instead), as a one-layer "KV" whose keys are the first half of each
feature row and whose values the second: the bank's blocks and end records, its
dedup, eviction, checks and salts hold them with no format of their own. A hit is
bit for bit the encoder's output (the bytes stored), so logits are the same either
way.

Worth it (measured, docs/design.md "Image keys (format v1)"): at Qwen2-VL-2B's
proportions (a quarter of its width and depth) one 448×448 image's encoder took 1.9×
the language model's whole prefill of its prompt, and its features are a fifth of
the KV of its positions.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cas_bank.arrays import dtype_of
from cas_bank.bank import Bank
from cas_bank.blocks.image_keys import MIN_SHORT_IMAGE_KEYS, ImageSpan, image_key_tokens
from cas_bank.namespace import Namespace
from cas_bank.spec import LayerSpec, ModelSpec


class FeatureCache:
    """Features of images (`[positions, width]`) in one namespace of a bank."""

    def __init__(self, bank: Bank, spec: ModelSpec, salt: str | bytes | None) -> None:
        self.bank = bank
        self.spec = spec
        self.namespace: Namespace = bank.namespace(spec, salt=salt)

    @classmethod
    def for_model(
        cls, bank: Bank, model_spec: ModelSpec, kind: str, width: int, dtype: mx.Dtype, salt: Any
    ) -> FeatureCache | None:
        """The feature cache of a model whose encoder gives rows of `width` in `dtype`;
        None where a row cannot be halved (an odd width)."""
        if width % 2:
            return None
        name = dtype_of(mx.zeros((1,), dtype=dtype)).name
        layer = LayerSpec.attention(kv_heads=1, head_dim=width // 2, dtype=name)
        spec = ModelSpec(
            name=f"{kind}/vision-features",
            layers=(layer,),
            weights_digest=model_spec.weights_digest,
            config_digest=model_spec.config_digest,
        )
        return cls(bank, spec, salt)

    @staticmethod
    def kept(span: ImageSpan) -> bool:
        """Whether the features of the image of `span` are kept: its key tokens are
        their whole name, so an image of fewer than `MIN_SHORT_IMAGE_KEYS` positions
        (under 124 bits) is encoded each time instead (it is small)."""
        return span.length >= MIN_SHORT_IMAGE_KEYS

    def salted(self, salt: str | bytes | None) -> FeatureCache:
        return FeatureCache(self.bank, self.spec, salt)

    def get(self, span: ImageSpan) -> mx.array | None:
        """The stored features of the image of `span`, or None (not all stored, or an
        image too short to be named safely: `kept`)."""
        if not self.kept(span):
            return None
        keys = image_key_tokens(span.digest, span.length)
        hit = self.namespace.restore(keys)
        if hit is None or hit.tokens != span.length:
            return None
        layer = hit.layers[0]
        assert layer is not None  # the one layer is attention
        k, v = layer
        n = span.length
        return mx.concatenate([k[0, 0, :n], v[0, 0, :n]], axis=-1)

    def put(self, span: ImageSpan, features: mx.array) -> None:
        """Store the features of the image of `span` (through the bank's background
        writer when it has one): its whole blocks, and its last rows as an end record.
        A full disk skips them (they only save an encoder run; the prompt's own store
        reports it as its `skip_store_when_full` says). An image too short to be named
        safely (`kept`) is not stored."""
        if not self.kept(span):
            return
        keys = image_key_tokens(span.digest, span.length)
        half = features.shape[-1] // 2
        layers = [(features[None, None, :, :half], features[None, None, :, half:])]
        mx.eval(layers)
        self.namespace.store_later(keys, layers, skip_when_full=True)
        if span.length % self.namespace.block_size:
            self.namespace.store_end_later(keys, layers, skip_when_full=True)
