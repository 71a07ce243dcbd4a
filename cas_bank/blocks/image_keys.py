"""Image keys, format v1: the key sequence of a prompt whose tokens hold images
(docs/design.md, "Image keys (format v1)").

A vision-language prompt holds placeholder ids at an image's positions: the same ids
for every image, so its KV cannot be named by its token ids alone. The bank names it by
the prompt's *key sequence*: every text position keeps its token id; position i of an
image (i = 0 for its first placeholder) holds the key token

    KEY_BIT | u32le(XOF(blake3 derive_key(IMAGE_KEY_CONTEXT), image digest)[4i : 4i+4]) & 0x7fffffff

where the image digest is `image_digest` of the pixels as the processor feeds them.
The chain rule (`hashing.chain_hashes`, `end_hash`) is unchanged and runs over the key
sequence: every block, partial block, end record, `explain` and `verify` keys an
image's positions by (image digest, offset) with no other code path, and a text-only
prompt is its own key sequence (its chain, hashes and golden vectors as before).

Text ids are below 2**31 and key tokens at or above it, so a key never equals a text
id. Each key token carries 31 bits of its image; `restore_point` keeps a restore from
stopping fewer than `MIN_IMAGE_KEYS` positions into an image, so a restored prefix
relies on at least 248 bits of every image it covers, or on all of an image shorter
than that; an image of fewer than `MIN_SHORT_IMAGE_KEYS` positions (under 124 bits:
a 1-position image's 31 bits fall to 2**31 tries) is never restored past. The bank
itself does not know where images start: `Namespace.restore` and `match` on a key
sequence stop where the chain does, and a caller cuts the hit back to
`restore_point(hit.tokens, spans)`. `runtime.vlm.VisionPrefixCache` does, and refuses
a bare key sequence (no spans) in its restores.

These are persistent keys: a change here is a version bump, and the golden vectors in
tests/test_image_keys.py must fail first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from cas_bank.blocks.hashing import DIGEST_SIZE, as_token_array
from cas_bank.errors import InvalidInputError

IMAGE_KEY_VERSION = 1
IMAGE_DIGEST_CONTEXT = "cas_bank 2026-12-06 image digest v1"
IMAGE_KEY_CONTEXT = "cas_bank 2026-12-06 image key v1"
KEY_BIT = 1 << 31
MIN_IMAGE_KEYS = 8
MIN_SHORT_IMAGE_KEYS = 4


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image's placeholder positions in a prompt: `length` positions from `start`,
    keyed by `digest` (`image_digest`)."""

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


def image_digest(pixels: np.ndarray, grid: Iterable[int] = ()) -> bytes:
    """The content digest of one image as the model's processor feeds it: blake3 (its
    own derive-key context) of the dtype, the shape and the little-endian bytes of its
    pixel array, then its grid (Qwen2-VL's (t, h, w) patches; empty where there is none).

    The decoded pixels rather than the encoded file: the same picture sent as PNG or as
    WebP, or re-encoded, keys the same, and every processor setting that changes what
    the model sees (resizing, normalization, patching) changes the key by itself,
    where a digest of the file would have to list every such setting to be safe.
    """
    arr = np.ascontiguousarray(pixels)
    if arr.dtype.kind not in "biufc":  # an object array's bytes are pointers
        raise InvalidInputError(f"image pixels must be numbers, not {arr.dtype}")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    dims = [int(g) for g in grid]
    h = blake3.blake3(derive_key_context=IMAGE_DIGEST_CONTEXT)
    h.update(arr.dtype.str.encode())
    h.update(len(arr.shape).to_bytes(4, "little"))
    for d in (*arr.shape, len(dims), *dims):
        h.update(int(d).to_bytes(8, "little"))
    h.update(arr.tobytes() if arr.size else b"")
    return h.digest()


def image_key_tokens(digest: bytes, length: int) -> np.ndarray:
    """The key tokens of an image's positions 0..length-1 (uint32, each >= KEY_BIT)."""
    if len(digest) != DIGEST_SIZE:
        raise InvalidInputError(f"an image digest is {DIGEST_SIZE} bytes, got {len(digest)}")
    stream = blake3.blake3(digest, derive_key_context=IMAGE_KEY_CONTEXT).digest(4 * length)
    keys = np.frombuffer(stream, dtype="<u4") & np.uint32(KEY_BIT - 1)
    return (keys | np.uint32(KEY_BIT)).astype("<u4")


def check_spans(spans: Sequence[ImageSpan], n_tokens: int) -> list[ImageSpan]:
    """`spans` in order, each inside the prompt and none overlapping another, or an
    `InvalidInputError` naming the first bad one."""
    out = sorted(spans, key=lambda s: s.start)
    at = 0
    for s in out:
        if s.length < 1 or s.start < at or s.end > n_tokens:
            raise InvalidInputError(
                f"image span [{s.start}, {s.end}) must be non-empty, inside the "
                f"{n_tokens} tokens and after the span before it (ending at {at})"
            )
        if len(s.digest) != DIGEST_SIZE:
            raise InvalidInputError(f"image span at {s.start}: digest of {len(s.digest)} bytes")
        at = s.end
    return out


def key_sequence(tokens: object, spans: Sequence[ImageSpan]) -> np.ndarray:
    """The key sequence of a prompt: `tokens` (text ids, < 2**31) with every image
    span's positions replaced by its key tokens. No spans: the tokens themselves."""
    arr = as_token_array(tokens)
    if arr.size and int(arr.max()) >= KEY_BIT:
        raise InvalidInputError("token ids must be below 2**31 (key tokens are at or above it)")
    if not spans:
        return arr
    out = arr.copy()
    for s in check_spans(spans, len(arr)):
        out[s.start : s.end] = image_key_tokens(s.digest, s.length)
    return out


def restore_point(n: int, spans: Sequence[ImageSpan]) -> int:
    """The deepest restore point at or before `n` that rests on enough of each image
    it reaches: `n`, or the start of the first image that `n` falls fewer than
    `MIN_IMAGE_KEYS` positions into (fewer than 248 bits of it), or falls past the
    start of at all when the image has fewer than `MIN_SHORT_IMAGE_KEYS` positions
    (under 124 bits in all)."""
    for s in sorted(spans, key=lambda s: s.start):
        too_few = s.length < MIN_SHORT_IMAGE_KEYS or n < s.start + min(MIN_IMAGE_KEYS, s.length)
        if s.start < n and too_few:
            return s.start
    return n


def spans_of(tokens: np.ndarray, placeholder: int, digests: Sequence[bytes]) -> list[ImageSpan]:
    """The spans of the runs of `placeholder` in `tokens`, the i-th run keyed by
    `digests[i]` (one run per image: a runtime whose images can touch passes their
    spans itself). InvalidInputError when the runs and the digests do not pair up."""
    is_ph = np.concatenate([[False], tokens == placeholder, [False]])
    edges = np.flatnonzero(is_ph[1:] != is_ph[:-1])
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(digests):
        raise InvalidInputError(
            f"the prompt has {len(starts)} runs of image token {placeholder} but "
            f"{len(digests)} images"
        )
    return [ImageSpan(int(a), int(b - a), d) for a, b, d in zip(starts, ends, digests, strict=True)]
