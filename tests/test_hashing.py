"""Chain hashing, format v1: golden vectors, an independent re-derivation, token checks.

The hex digests below are persistent keys of every bank on disk. If one of these
tests fails, the hash format changed: bump HASH_FORMAT_VERSION, never the vectors.
"""

from __future__ import annotations

import os

import blake3
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank import InvalidInputError, LayerSpec, ModelSpec
from cas_bank.blocks import hashing
from cas_bank.blocks.hashing import (
    BLOCK_CONTEXT,
    HASH_FORMAT_VERSION,
    PAYLOAD_CONTEXT,
    ROOT_CONTEXT,
    as_token_array,
    chain_hashes,
    digest,
    hash_block,
    namespace_root,
)


def golden_spec() -> ModelSpec:
    """Built here, not in conftest, so that a fixture change cannot move the vectors."""
    return ModelSpec(
        name="tiny-attn",
        layers=tuple(
            LayerSpec.attention(kv_heads=2, head_dim=8, dtype="float16") for _ in range(2)
        ),
        weights_digest="w-tiny-attn",
    )


GOLDEN_FINGERPRINT = "dcab78ca2aa93e4429067fc2087ad9e86d16a28e0e9f4cde46401fc20791b276"
GOLDEN_ROOT_64 = "c94a6754793a51d52b8cb720d3a08e468102d7e976cffe3c289e25c6d1595f18"
GOLDEN_ROOT_ZERO_FP_4 = "699f9ac2aa603a63d00f0effa0ad007582a8375fd2299f7a6958acb7132bbb4a"
GOLDEN_CHAIN_ZERO_ROOT = [  # root = 32 zero bytes, tokens 0..7, block_size 4
    "5b3a4e773fdf0cc1ba130b245a0836231eb48d6c2575e26ef8513366b2ece3f1",
    "92d0d3540678097572a7c969b80e74f05adab8a9398ba9af38e525ff9ff1b273",
]
GOLDEN_CHAIN_SPEC_ROOT = [  # root = GOLDEN_ROOT_64, 9 tokens incl. 2**32-1, block_size 4
    "49905ce9eb04c65ea23e70c0d6bd44c3c30cb9207a5b0c177cb91cf00eeb6e73",
    "d8beb5841555e1495370ed3c98fc22b9632876f47ba5a7b62510f33b7c6abaa4",
]
GOLDEN_PAYLOAD_DIGEST_ABC = "37c67e88a58bfc2e18caaa12a3138c75e22e2bad572be160d79957acb98d6c06"


def test_format_version_is_one() -> None:
    assert HASH_FORMAT_VERSION == 1


def test_spec_fingerprint_golden() -> None:
    assert golden_spec().fingerprint == GOLDEN_FINGERPRINT


def test_namespace_root_golden() -> None:
    assert namespace_root(GOLDEN_FINGERPRINT, 64).hex() == GOLDEN_ROOT_64
    assert namespace_root("00" * 32, 4).hex() == GOLDEN_ROOT_ZERO_FP_4


def test_chain_golden_vectors() -> None:
    got = chain_hashes(bytes(32), list(range(8)), 4)
    assert [h.hex() for h in got] == GOLDEN_CHAIN_ZERO_ROOT
    root = bytes.fromhex(GOLDEN_ROOT_64)
    toks = [0, 1, 2**32 - 1, 7, 65535, 65536, 3, 3, 9]  # the 9th token is a partial tail
    assert [h.hex() for h in chain_hashes(root, toks, 4)] == GOLDEN_CHAIN_SPEC_ROOT


def test_payload_digest_golden() -> None:
    assert digest(b"abc").hex() == GOLDEN_PAYLOAD_DIGEST_ABC


def test_chain_matches_an_independent_derivation() -> None:
    """blake3 derive-key over parent || little-endian uint32 tokens, written out by hand."""
    rng = np.random.default_rng(1)
    toks = [int(t) for t in rng.integers(0, 2**32, 20, dtype=np.uint64)]
    root = bytes(range(32))
    parent = root
    want = []
    for i in range(5):
        h = blake3.blake3(derive_key_context=BLOCK_CONTEXT)
        h.update(parent + b"".join(t.to_bytes(4, "little") for t in toks[i * 4 : (i + 1) * 4]))
        parent = h.digest()
        want.append(parent)
    assert chain_hashes(root, toks, 4) == want
    r = blake3.blake3(derive_key_context=ROOT_CONTEXT)
    r.update(bytes(32) + (4).to_bytes(4, "little") + (1).to_bytes(4, "little"))
    assert namespace_root("00" * 32, 4) == r.digest()


def test_fingerprint_ignores_tokenizer_but_not_weights() -> None:
    spec = golden_spec()
    assert spec.model_copy(update={"tokenizer": "byte"}).fingerprint == spec.fingerprint
    other = ModelSpec(name=spec.name, layers=spec.layers, weights_digest="w-other")
    assert other.fingerprint != spec.fingerprint
    bf16 = ModelSpec(
        name=spec.name,
        layers=tuple(LayerSpec.attention(2, 8, "bfloat16") for _ in range(2)),
        weights_digest=spec.weights_digest,
    )
    assert bf16.fingerprint != spec.fingerprint


def test_root_depends_on_block_size() -> None:
    assert namespace_root(GOLDEN_FINGERPRINT, 64) != namespace_root(GOLDEN_FINGERPRINT, 32)


def test_partial_tail_has_no_hash() -> None:
    assert chain_hashes(bytes(32), [1, 2, 3], 4) == []
    assert chain_hashes(bytes(32), [], 4) == []
    assert len(chain_hashes(bytes(32), list(range(11)), 4)) == 2


def test_token_containers_agree() -> None:
    toks = [5, 0, 2**32 - 1, 17, 4, 4, 4, 4]
    want = chain_hashes(bytes(32), toks, 4)
    for form in (
        tuple(toks),
        np.array(toks, dtype=np.int64),
        np.array(toks, dtype=np.uint32),
        np.array([toks], dtype=np.uint64),  # [1, T]
        mx.array(toks, dtype=mx.uint32),
        mx.array([toks], dtype=mx.uint32),
        [np.int64(t) for t in toks],
    ):
        assert chain_hashes(bytes(32), form, 4) == want, type(form)


@settings(max_examples=40, deadline=None)
@given(
    a=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=24),
    b=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=24),
)
def test_hashes_name_whole_prefixes(a: list[int], b: list[int]) -> None:
    """Block i of two sequences has the same name iff their first (i+1)*B tokens agree."""
    ha, hb = chain_hashes(bytes(32), a, 4), chain_hashes(bytes(32), b, 4)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[: (i + 1) * 4] == b[: (i + 1) * 4])
    if ha:
        assert ha[0] == hash_block(bytes(32), np.array(a[:4], dtype=np.uint32))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1, 2], "token id -1 is outside [0, 2**32)"),
        ([1, 2**32], "token id 4294967296 is outside [0, 2**32)"),
        ([1, 2.0], "token ids must be ints; got float 2.0"),
        ([1, True], "token ids must be ints; got bool True"),
        (["a", "b"], "token ids must be ints; got str 'a'"),
        ("abcd", "tokens must be a sequence of int ids, not a string"),
        (b"abcd", "tokens must be a sequence of int ids, not a string"),
        (np.array([[1, 2], [3, 4]]), "tokens must be 1-D (or [1, T]); got shape (2, 2)"),
        (np.array([1.0, 2.0]), "token ids must be integers; got dtype float64"),
        (np.array([1, -3]), "token id -3 is outside [0, 2**32)"),
        (np.array([2**40], dtype=np.uint64), "token id 1099511627776 is outside [0, 2**32)"),
        (mx.array([1.5, 2.0]), "token ids must be integers; got dtype float32"),
        (mx.array([1, -2]), "token id -2 is outside [0, 2**32)"),
    ],
)
def test_bad_tokens_are_named(tokens: object, message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        as_token_array(tokens)
    assert message in str(err.value)


def test_large_inputs_hash_the_same_on_threads() -> None:
    """Parts of 1 MiB and more go to blake3's thread pool: the digest must not change."""
    big = np.random.default_rng(3).bytes(3 << 20)
    single = blake3.blake3(derive_key_context=PAYLOAD_CONTEXT, max_threads=1)
    single.update(b"head")
    single.update(big)
    assert digest(b"head", memoryview(big)) == single.digest()


def test_native_chain_helper_is_built() -> None:
    """`pip install -e .` builds cas_bank._chain (setup.py); without it lookups fall back
    to the slower Python loop. CAS_BANK_PURE_PYTHON=1 turns it off on purpose."""
    if os.environ.get("CAS_BANK_PURE_PYTHON"):
        pytest.skip("the native helper is turned off")
    assert hashing._native_chain is not None


@settings(max_examples=60, deadline=None)
@given(
    root=st.binary(min_size=32, max_size=32),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=700),
    block_size=st.sampled_from([1, 2, 4, 16, 64, 248, 256, 300]),
)
def test_native_and_python_chains_agree(root: bytes, tokens: list[int], block_size: int) -> None:
    """Every input, every block size (one or several BLAKE3 chunks per block)."""
    data = np.array(tokens, dtype="<u4").tobytes()
    want = hashing.chain_hashes_python(root, data, block_size)
    assert chain_hashes(root, tokens, block_size) == want
    if want:
        assert want[0] == hash_block(root, np.array(tokens[:block_size], dtype=np.uint32))


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=700))
def test_max_token_is_numpys_max_native_or_not(tokens: list[int]) -> None:
    """The vocabulary check's maximum (`max_token`): the native loop where it is built
    and numpy's reduction agree on every array, the empty one giving 0."""
    arr = hashing.as_token_array(tokens)
    want = int(arr.max()) if tokens else 0
    assert hashing.max_token(arr) == want
    native, hashing._native_max_id = hashing._native_max_id, None
    try:
        assert hashing.max_token(arr) == want
    finally:
        hashing._native_max_id = native
