"""Image keys, format v1 (cas_bank/blocks/image_keys.py): golden vectors, the rule
restated from its documentation, and the properties the bank relies on: two images
at one place share no block, one image at one place always does, text is unchanged."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator

import blake3
import numpy as np
import pytest
from conftest import attention_spec, bits, layers_bits, prefix_layers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig
from cas_bank.blocks.hashing import chain_hashes, end_hash, namespace_root
from cas_bank.blocks.image_keys import (
    IMAGE_DIGEST_CONTEXT,
    IMAGE_KEY_CONTEXT,
    KEY_BIT,
    MIN_IMAGE_KEYS,
    MIN_SHORT_IMAGE_KEYS,
    ImageSpan,
    image_digest,
    image_key_tokens,
    key_sequence,
    restore_point,
    spans_of,
)
from cas_bank.errors import InvalidInputError

ROOT = namespace_root("00" * 32, 4)
PIXELS = np.arange(24, dtype=np.float32).reshape(2, 12) / 7
DIGEST = "071de70c5283b79531b1198186b19a7cf3f71af2d753d90e4cc03b66396319c0"


def test_golden_vectors() -> None:
    d = image_digest(PIXELS, (1, 2, 2))
    assert d.hex() == DIGEST
    assert [int(k) for k in image_key_tokens(d, 4)] == [
        0xB989C508,
        0xBFD9DBEE,
        0xC7A61680,
        0xD82A5815,
    ]
    keys = key_sequence([1, 2, 3, 4, 5, 6], [ImageSpan(2, 3, d)])
    assert keys.tolist() == [1, 2, 3112813832, 3218725870, 3349550720, 6]
    (block,) = chain_hashes(ROOT, keys, 4)
    assert block.hex() == "7e52bb4adefb21811eca96dd06ad34b7099dae3b6436de1dc83c6b95d98efaf4"
    assert end_hash(block, keys[4:]).hex() == (
        "eabb0000f95f44cf52c960da9477fc7d15a402241446e36127118ffb10e90e35"
    )


def test_rule_as_documented() -> None:
    """The digest and the key tokens recomputed from the module's text with blake3 alone."""
    h = blake3.blake3(derive_key_context=IMAGE_DIGEST_CONTEXT)
    h.update(b"<f4")
    h.update((2).to_bytes(4, "little"))
    for d in (2, 12, 3, 1, 2, 2):
        h.update(d.to_bytes(8, "little"))
    h.update(PIXELS.astype("<f4").tobytes())
    assert h.hexdigest() == DIGEST
    stream = blake3.blake3(bytes.fromhex(DIGEST), derive_key_context=IMAGE_KEY_CONTEXT).digest(12)
    want = [
        KEY_BIT | (int.from_bytes(stream[i : i + 4], "little") & (KEY_BIT - 1)) for i in (0, 4, 8)
    ]
    assert image_key_tokens(bytes.fromhex(DIGEST), 3).tolist() == want


def test_digest_names_pixels_shape_and_grid() -> None:
    base = image_digest(PIXELS, (1, 2, 2))
    assert image_digest(PIXELS.copy(), (1, 2, 2)) == base
    assert image_digest(PIXELS.astype(">f4"), (1, 2, 2)) == base  # byte order is not content
    other = PIXELS.copy()
    other[1, 3] += 1e-6
    assert image_digest(other, (1, 2, 2)) != base
    assert image_digest(PIXELS.reshape(4, 6), (1, 2, 2)) != base
    assert image_digest(PIXELS, (1, 4, 1)) != base
    assert image_digest(PIXELS.astype(np.float16), (1, 2, 2)) != base


def test_bad_input_is_refused() -> None:
    d = bytes(32)
    with pytest.raises(InvalidInputError, match="below 2"):
        key_sequence([1, KEY_BIT], [])
    with pytest.raises(InvalidInputError, match="inside the 4 tokens"):
        key_sequence([1, 2, 3, 4], [ImageSpan(2, 3, d)])
    with pytest.raises(InvalidInputError, match="after the span before it"):
        key_sequence([1] * 8, [ImageSpan(0, 3, d), ImageSpan(2, 3, d)])
    with pytest.raises(InvalidInputError, match="2 runs"):
        spans_of(np.array([5, 9, 9, 5, 9]), 9, [d])
    # an object array's bytes are pointers, not pixels: no content to digest
    with pytest.raises(InvalidInputError, match="numbers"):
        image_digest(np.array([[1.0, 2.0]], dtype=object))


def test_spans_of_and_restore_point() -> None:
    d1, d2 = bytes([1]) * 32, bytes([2]) * 32
    spans = spans_of(np.array([5, 9, 9, 9, 9, 5] + [9] * 20), 9, [d1, d2])
    assert spans == [ImageSpan(1, 4, d1), ImageSpan(6, 20, d2)]
    assert restore_point(3, spans) == 1  # inside a 4-position image: its start
    assert restore_point(5, spans) == 5  # right after it: all its keys, 124 bits
    assert restore_point(6 + MIN_IMAGE_KEYS - 1, spans) == 6
    assert restore_point(6 + MIN_IMAGE_KEYS, spans) == 6 + MIN_IMAGE_KEYS
    assert restore_point(26, spans) == 26
    # an image of 3 positions (93 bits): never restored past, however deep the hit
    short = [ImageSpan(2, MIN_SHORT_IMAGE_KEYS - 1, d1), ImageSpan(9, 20, d2)]
    assert restore_point(5, short) == restore_point(40, short) == 2
    assert restore_point(2, short) == 2


prompts = st.tuples(
    st.lists(st.integers(0, 1000), min_size=0, max_size=40),  # text before
    st.integers(1, 40),  # image length
    st.lists(st.integers(0, 1000), min_size=0, max_size=40),  # text after
    st.sampled_from([1, 4, 16]),  # block size
)


def _prompt(before: list[int], n: int, after: list[int], digest: bytes) -> np.ndarray:
    tokens = [*before, *([7] * n), *after]
    return key_sequence(tokens, [ImageSpan(len(before), n, digest)])


@settings(max_examples=60, deadline=None)
@given(prompts, st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_two_images_at_one_place_share_no_block(p, d1: bytes, d2: bytes) -> None:
    before, n, after, bs = p
    if d1 == d2:
        return
    a = chain_hashes(ROOT, _prompt(before, n, after, d1), bs)
    b = chain_hashes(ROOT, _prompt(before, n, after, d2), bs)
    first_image_block = len(before) // bs
    assert a[:first_image_block] == b[:first_image_block]  # the text before: shared
    assert not set(a[first_image_block:]) & set(b)  # from the image on: nothing
    tail_at = len(a) * bs
    ka, kb = _prompt(before, n, after, d1), _prompt(before, n, after, d2)
    if tail_at < len(before) + n:  # the image reaches the tail: the end records differ
        assert end_hash(a[-1] if a else ROOT, ka[tail_at:]) != end_hash(
            b[-1] if b else ROOT, kb[tail_at:]
        )


@settings(max_examples=60, deadline=None)
@given(prompts, st.binary(min_size=32, max_size=32))
def test_one_image_at_one_place_always_shares(p, d: bytes) -> None:
    before, n, after, bs = p
    a = _prompt(before, n, after, d)
    assert chain_hashes(ROOT, a, bs) == chain_hashes(ROOT, _prompt(before, n, after, d), bs)
    # and a prompt that goes on after it keeps every block of it
    longer = chain_hashes(ROOT, _prompt(before, n, [*after, 1, 2, 3], d), bs)
    assert longer[: len(a) // bs] == chain_hashes(ROOT, a, bs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, KEY_BIT - 1), max_size=80), st.sampled_from([1, 4, 16]))
def test_text_chains_unchanged(tokens: list[int], bs: int) -> None:
    keys = key_sequence(tokens, [])
    assert keys.tolist() == tokens
    assert chain_hashes(ROOT, keys, bs) == chain_hashes(ROOT, tokens, bs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(0, 200))
def test_restore_point_never_rests_on_few_keys(lengths: list[int], n: int) -> None:
    spans, at = [], 3
    for i, length in enumerate(lengths):
        spans.append(ImageSpan(at, length, bytes([i]) * 32))
        at += length + 2
    m = restore_point(n, spans)
    assert m <= n
    for s in spans:
        inside = min(max(m - s.start, 0), s.length)
        assert inside == 0 or inside >= max(min(MIN_IMAGE_KEYS, s.length), MIN_SHORT_IMAGE_KEYS)


# -- the bank on key sequences (no mlx-vlm: the core library alone) ----------------


@pytest.fixture(scope="module")
def key_bank() -> Iterator[Bank]:
    config = BankConfig(block_size=8, write_behind=0)
    with tempfile.TemporaryDirectory(prefix="cas_bank_ik_") as d, Bank.open(d, config) as bank:
        yield bank


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(0, 300), min_size=0, max_size=30),
    st.integers(1, 30),
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.booleans(),
    st.data(),
)
def test_bank_restores_an_image_only_to_itself(
    key_bank: Bank, before: list[int], n: int, after: list[int], same: bool, data: st.DataObject
) -> None:
    """Store a prompt (blocks and end record) with image d1; restore the same ids with
    d1 or d2 at that place: whole blocks, a partial block or the end record take the
    image's positions only for d1, and what comes back is that prompt's own KV."""
    ns = key_bank.namespace(attention_spec(), salt=data.draw(st.binary(min_size=16, max_size=16)))
    d1, d2 = bytes([1]) * 32, bytes([2]) * 32
    a = _prompt(before, n, after, d1)
    b = _prompt(before, n, [*after, 5], d1 if same else d2)
    ns.store(a, prefix_layers(ns.spec, a.tolist()))
    ns.store_end(a, prefix_layers(ns.spec, a.tolist()))
    hit = ns.restore(b[:-1])
    got = 0 if hit is None else hit.tokens
    image_start = len(before)
    assert got == (len(a) if same else image_start)
    if hit is not None:
        want = prefix_layers(ns.spec, b.tolist())
        assert layers_bits(hit.layers, ns.spec) == [
            [bits(x[..., :got, :]) for x in layer] for layer in want
        ]


def test_the_core_never_imports_mlx_vlm() -> None:
    code = (
        "import sys, numpy as np\n"
        "import cas_bank\n"
        "from cas_bank.blocks.image_keys import key_sequence, image_digest, ImageSpan\n"
        "key_sequence([1, 2, 3], [ImageSpan(1, 1, image_digest(np.zeros(3)))])\n"
        "assert 'mlx_vlm' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
