"""The block codec: bit-exact round trips over dtypes and shapes, and corrupt payloads.

A payload must come back bit for bit (NaN payloads and signed zeros included), with
or without lz4, from contiguous or strided input; any damage must surface as
`CorruptDataError` (or `verify` False), never as another exception or wrong arrays.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import CHECKS
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank.arrays import DTYPES, from_numpy, to_numpy
from cas_bank.blocks import codec, hashing
from cas_bank.blocks.hashing import Check, digest
from cas_bank.errors import CorruptDataError

DTYPE_NAMES = sorted(DTYPES)
FIXED = struct.Struct("<4sBBHQQ32s")


def random_storage(rng: np.random.Generator, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Random bits in `name`'s storage dtype: every bit pattern (NaNs, infs, -0) can occur."""
    d = DTYPES[name]
    if d.storage == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    n = int(np.prod(shape, dtype=np.int64)) * d.itemsize
    return np.frombuffer(rng.bytes(n), dtype=d.storage).reshape(shape).copy()


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
arrays_spec = st.lists(st.tuples(st.sampled_from(DTYPE_NAMES), shapes), min_size=1, max_size=5)


@settings(max_examples=50, deadline=None)
@given(
    spec=arrays_spec,
    compression=st.sampled_from(["auto", "lz4", "none"]),
    seed=st.integers(0, 2**32 - 1),
    zeros=st.booleans(),
)
def test_round_trip_is_bit_exact(
    spec: list[tuple[str, tuple[int, ...]]], compression: str, seed: int, zeros: bool
) -> None:
    rng = np.random.default_rng(seed)
    arrays = [
        np.zeros(shape, DTYPES[n].storage) if zeros else random_storage(rng, shape, n)
        for n, shape in spec
    ]
    dtypes = [DTYPES[n] for n, _ in spec]
    payload = codec.encode(arrays, dtypes, compression)  # type: ignore[arg-type]
    assert codec.verify(payload)
    out = codec.decode(payload, codec.embedded_digest(payload))
    assert [d.name for d in out.dtypes] == [n for n, _ in spec]
    for got, want in zip(out.arrays, arrays, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()
    if compression == "none":
        assert not out.compressed
    if compression == "lz4":
        assert out.compressed


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lo=st.integers(0, 6), width=st.integers(0, 6))
def test_strided_slices_round_trip(seed: int, lo: int, width: int) -> None:
    """A block cut out of a padded cache buffer ([..., lo:hi, :]) and a transposed array."""
    rng = np.random.default_rng(seed)
    buf = random_storage(rng, (1, 3, 12, 5), "float16")
    block = buf[..., lo : lo + width, :]
    transposed = random_storage(rng, (4, 3, 2), "bfloat16").transpose(2, 0, 1)
    payload = codec.encode([block, transposed], [DTYPES["float16"], DTYPES["bfloat16"]])
    out = codec.decode(payload)
    assert out.arrays[0].tobytes() == np.ascontiguousarray(block).tobytes()
    assert out.arrays[1].tobytes() == np.ascontiguousarray(transposed).tobytes()


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_nan_payloads_survive_mlx_round_trip(name: str) -> None:
    """Through MLX and back: every NaN payload, inf and -0.0 is kept bit for bit."""
    d = DTYPES[name]
    width = d.itemsize * 8
    exp_bits = {16: 5, 32: 8}[width] if name != "bfloat16" else 8
    mant = width - 1 - exp_bits
    exp_all = ((1 << exp_bits) - 1) << mant
    specials = [exp_all | 1, exp_all | (1 << (mant - 1)), exp_all | ((1 << mant) - 1), exp_all]
    specials += [1 << (width - 1), 0, 1]  # -0.0, +0.0, the smallest subnormal
    specials += [s | (1 << (width - 1)) for s in specials[:3]]  # negative NaNs
    raw = np.array(specials, dtype=np.uint16 if width == 16 else np.uint32)
    stored = raw.view(d.storage)
    mx_arr = from_numpy(stored, d)
    payload = codec.encode([to_numpy(mx_arr)], [d])
    back = from_numpy(codec.decode(payload).arrays[0], d)
    assert to_numpy(back).tobytes() == raw.tobytes()


def test_zeros_compress_and_noise_does_not() -> None:
    zeros = np.zeros((1, 2, 64, 128), np.float16)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((1, 2, 64, 128)).astype(np.float16)
    f16 = DTYPES["float16"]
    assert codec.decode(codec.encode([zeros], [f16])).compressed
    assert len(codec.encode([zeros], [f16])) < zeros.nbytes // 10
    assert not codec.decode(codec.encode([noise], [f16])).compressed


def test_decoded_uncompressed_arrays_are_views_of_the_payload() -> None:
    a = np.arange(2048, dtype=np.float32)
    payload = codec.encode([a], [DTYPES["float32"]], "none")
    out = codec.decode(payload).arrays[0]
    assert not out.flags.owndata and not out.flags.writeable


def test_encode_rejects_a_dtype_mismatch() -> None:
    with pytest.raises(ValueError, match="array of dtype float32 given as float16"):
        codec.encode([np.zeros(3, np.float32)], [DTYPES["float16"]])
    with pytest.raises(ValueError, match="differ in length"):
        codec.encode([np.zeros(3, np.float32)], [])


def _payload(compression: str = "none", check: Check = "xxh3") -> tuple[bytes, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    arrays = [random_storage(rng, (1, 2, 4, 8), "bfloat16"), np.zeros((1, 2, 4, 8), np.uint16)]
    dtypes = [DTYPES["bfloat16"], DTYPES["uint16"]]
    return codec.encode(arrays, dtypes, compression, check), arrays  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), compression=st.sampled_from(["none", "lz4"]), check=st.sampled_from(CHECKS))
def test_any_flipped_byte_is_detected(data: st.DataObject, compression: str, check: Check) -> None:
    payload, _ = _payload(compression, check)
    assert hashing.check_of(codec.embedded_digest(payload)) == check
    pos = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(payload)
    bad[pos] ^= flip
    assert not codec.verify(bytes(bad))
    assert not codec.verify(bytes(bad), codec.embedded_digest(payload))  # the header's
    with pytest.raises(CorruptDataError):
        codec.decode(bytes(bad))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), compression=st.sampled_from(["none", "lz4"]), check=st.sampled_from(CHECKS))
def test_truncated_or_extended_payloads_are_detected(
    data: st.DataObject, compression: str, check: Check
) -> None:
    payload, _ = _payload(compression, check)
    cut = data.draw(st.integers(0, len(payload) - 1))
    for bad in (payload[:cut], payload + b"\0" * data.draw(st.integers(1, 9))):
        assert not codec.verify(bad)
        with pytest.raises(CorruptDataError):
            codec.decode(bad)


def test_expected_digest_must_match() -> None:
    payload, _ = _payload()
    assert codec.verify(payload, codec.embedded_digest(payload))
    assert not codec.verify(payload, bytes(32))
    with pytest.raises(CorruptDataError, match="digest"):
        codec.decode(payload, bytes(32))


def test_not_a_payload() -> None:
    for junk in (b"", b"CAS", b"XXXX" + bytes(100)):
        assert not codec.verify(junk)
        with pytest.raises(CorruptDataError):
            codec.embedded_digest(junk)
        with pytest.raises(CorruptDataError):
            codec.decode(junk)


def _resign(fixed: tuple[object, ...], rest: bytes) -> bytes:
    """A payload whose digest is valid over malformed content (a writer's bug, not bit rot)."""
    magic, version, flags, n, body_len, raw_len, _ = fixed
    head = FIXED.pack(magic, version, flags, n, body_len, raw_len, bytes(32))
    check = digest(head[: FIXED.size - 32], rest)
    return FIXED.pack(magic, version, flags, n, body_len, raw_len, check) + rest


@pytest.mark.parametrize(
    "change",
    [
        "flags_lz4_on_raw",
        "raw_len_huge",
        "body_len_short",
        "n_arrays_more",
        "version",
        "dtype_code",
        "dim_huge",
        "lz4_bomb",
    ],
)
def test_well_signed_malformed_payloads_raise_corrupt_data(change: str) -> None:
    """Decoding never lets a struct, lz4 or numpy error (or a huge allocation) escape."""
    payload, _ = _payload("none")
    magic, version, flags, n, body_len, raw_len, d = FIXED.unpack_from(payload)
    rest = bytearray(payload[FIXED.size :])
    if change == "flags_lz4_on_raw":
        flags |= codec.FLAG_LZ4
    elif change == "raw_len_huge":
        flags |= codec.FLAG_LZ4
        raw_len = 1 << 62
    elif change == "body_len_short":
        body_len -= 4
    elif change == "n_arrays_more":
        n += 1
    elif change == "version":
        version += 1
    elif change == "dtype_code":
        rest[0] = 250
    elif change == "dim_huge":
        struct.pack_into("<I", rest, 2, 0xFFFFFFFF)
    elif change == "lz4_bomb":  # consistent sizes, but far more than lz4 can expand to
        struct.pack_into("<I", rest, 2 + 12, 1 << 30)  # array 0: (1, 2, 4, 2**30) bf16
        flags |= codec.FLAG_LZ4
        raw_len = 2 * 4 * (1 << 30) * 2 + 1 * 2 * 4 * 8 * 2
    bad = _resign((magic, version, flags, n, body_len, raw_len, d), bytes(rest))
    assert codec.verify(bad)
    with pytest.raises(CorruptDataError):
        codec.decode(bad)
