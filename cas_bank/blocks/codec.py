"""Arrays <-> payload bytes: a small header, raw array bytes, a check (XXH3-128 or blake3).

Layout (all little-endian):

    magic "CASB" | version u8 | flags u8 | n_arrays u16 | body_len u64 | raw_len u64
    | digest 32 bytes | per array: dtype code u8, ndim u8, dims u32 * ndim
    | zero padding to 8 bytes | body

The digest field says which check it holds (`hashing.check_of`): XXH3-128 followed by
`hashing.XXH3_TAG` (format version 4's default) or a blake3 digest (every payload
written before). The check covers every other byte of the payload (the fixed fields
before it, then descriptors, padding and the body as stored), so a payload is checked
before anything is decompressed or interpreted, and a flipped flag or length is caught
like a flipped body byte. The body is the arrays' C-order bytes one after another,
lz4-compressed (flag bit 0) only where that is clearly smaller: float16/bfloat16 KV
does not compress, zeros do (docs/design.md, "Payload codec").
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import lz4.block
import numpy as np

from cas_bank.arrays import DTYPES_BY_CODE, DType
from cas_bank.blocks.hashing import Check, check_of, payload_check
from cas_bank.errors import CorruptDataError

MAGIC = b"CASB"
CODEC_VERSION = 1
FLAG_LZ4 = 1
# The lead: the fixed fields every payload starts with, its digest field last. Defined
# here only: the file tier takes a payload's digest from it and the restore's readers
# (restore.file_read, and the native one, given `LEAD.size`: cas_bank/_native/fill.c)
# check a plain payload's lead against `plain_lead`.
LEAD = struct.Struct("<4sBBHQQ32s")
DIGEST_LEN = 32
DIGEST_AT = LEAD.size - DIGEST_LEN
_SAMPLE = 64 * 1024
_LZ4_MAX_RATIO = 255  # an lz4 block expands at most about this much
_KEEP_RATIO = 0.9  # keep lz4's output only if at most this fraction of the raw size

Compression = Literal["auto", "lz4", "none"]


@dataclass(frozen=True, slots=True)
class Decoded:
    """Arrays of a payload, as numpy views of its bytes (bf16 as uint16)."""

    arrays: list[np.ndarray]
    dtypes: list[DType]
    compressed: bool


def _pieces(a: np.ndarray) -> list[memoryview]:
    """Contiguous memoryviews covering `a` in C order, without copying.

    A block sliced out of a padded cache buffer is strided on the token axis; its
    rows below that axis are contiguous, so the join below is its only copy.
    """
    if a.flags.c_contiguous:
        return [memoryview(a).cast("B")] if a.size else []  # type: ignore[arg-type]
    if a.strides[-1] != a.itemsize:
        # Strided on the last axis (a transposed view): rows are not contiguous, and
        # splitting down to single elements would cost a view each. Copy once instead.
        return [memoryview(np.ascontiguousarray(a)).cast("B")]  # type: ignore[arg-type]
    out: list[memoryview] = []
    for sub in a:
        out.extend(_pieces(sub))
    return out


def _worth_compressing(pieces: Sequence[memoryview], raw_len: int) -> bool:
    if not pieces or raw_len < 4096:
        return False
    parts: list[bytes] = []
    size = 0
    for p in pieces:  # the first 64 KiB, across pieces
        parts.append(bytes(p[: _SAMPLE - size]))
        size += len(parts[-1])
        if size >= _SAMPLE:
            break
    sample = b"".join(parts)
    return len(lz4.block.compress(sample, store_size=False)) < _KEEP_RATIO * len(sample)


def descriptors(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[DType]) -> bytes:
    """The array descriptors of a payload of arrays of `shapes` and `dtypes`, with the
    zero padding after them: what follows the lead."""
    desc = bytearray()
    for shape, d in zip(shapes, dtypes, strict=True):
        desc += struct.pack(f"<BB{len(shape)}I", d.code, len(shape), *shape)
    desc += b"\0" * (-(len(desc) + LEAD.size) % 8)
    return bytes(desc)


def encode(
    arrays: Sequence[np.ndarray],
    dtypes: Sequence[DType],
    compression: Compression = "auto",
    check: Check = "xxh3",
) -> bytes:
    """One payload holding `arrays` (numpy storage arrays, bf16 as uint16), checked by
    `check`."""
    if len(arrays) != len(dtypes):
        raise ValueError("arrays and dtypes differ in length")
    pieces: list[memoryview] = []
    for a, d in zip(arrays, dtypes, strict=True):
        if a.dtype != d.storage:
            raise ValueError(f"array of dtype {a.dtype} given as {d.name}")
        pieces += _pieces(a)
    desc = descriptors([a.shape for a in arrays], dtypes)
    raw_len = sum(p.nbytes for p in pieces)
    flags = 0
    body: Sequence[bytes | memoryview] = pieces
    if compression == "lz4" or (compression == "auto" and _worth_compressing(pieces, raw_len)):
        packed = lz4.block.compress(b"".join(pieces), store_size=False)
        if compression == "lz4" or len(packed) < _KEEP_RATIO * raw_len:
            body, flags = [packed], FLAG_LZ4
    body_len = sum(len(p) for p in body)
    lead = LEAD.pack(MAGIC, CODEC_VERSION, flags, len(arrays), body_len, raw_len, bytes(32))
    field = payload_check(lead[:DIGEST_AT], desc, *body, check=check)
    return b"".join([lead[:DIGEST_AT], field, desc, *body])


def is_payload(data: bytes | memoryview) -> bool:
    """Whether `data` starts as a payload does (its magic): nothing else is checked."""
    return data[:4] == MAGIC


def digest_field(data: bytes | memoryview) -> bytes:
    """The digest field of a payload's lead, as bytes (not checked: `embedded_digest`
    checks the magic and the length first)."""
    return bytes(data[DIGEST_AT : LEAD.size])


def plain_lead(n_arrays: int, body_len: int) -> bytes:
    """The lead, up to its digest field, of an uncompressed payload of `n_arrays` arrays
    and `body_len` body bytes: what a restore's reader expects a plain payload file to
    start with."""
    return LEAD.pack(MAGIC, CODEC_VERSION, 0, n_arrays, body_len, body_len, bytes(32))[:DIGEST_AT]


def read_plain_lead(data: bytes | bytearray | memoryview) -> tuple[bool, int, bytes]:
    """(whether `data`'s lead is a plain payload's, its body length, its digest field):
    plain is this codec's magic and version, no flag set and the body its raw bytes."""
    magic, version, flags, _n, body_len, raw_len, claimed = LEAD.unpack_from(data)
    plain = magic == MAGIC and version == CODEC_VERSION and flags == 0 and body_len == raw_len
    return plain, body_len, claimed


def embedded_digest(data: bytes | memoryview) -> bytes:
    """The digest a payload claims for itself (not checked)."""
    if len(data) < LEAD.size or not is_payload(data):
        raise CorruptDataError("not a cas_bank payload (bad magic or truncated)")
    return bytes(data[DIGEST_AT : LEAD.size])


def verify(data: bytes | memoryview, expected: bytes | None = None) -> bool:
    """True if the payload's bytes match its digest (and `expected`, when given)."""
    try:
        claimed = embedded_digest(data)
    except CorruptDataError:
        return False
    if expected is not None and claimed != expected:
        return False
    view = memoryview(data)
    return payload_check(view[:DIGEST_AT], view[LEAD.size :], check=check_of(claimed)) == claimed


def with_check(data: bytes | memoryview, check: Check) -> bytes:
    """`data` (a payload that verifies) with its digest field recomputed as `check`:
    the same bytes otherwise. A payload that fails its check raises `CorruptDataError`."""
    if not verify(data):
        raise CorruptDataError("payload digest mismatch")
    if check_of(embedded_digest(data)) == check:
        return bytes(data)
    view = memoryview(data)
    field = payload_check(view[:DIGEST_AT], view[LEAD.size :], check=check)
    return b"".join([view[:DIGEST_AT], field, view[LEAD.size :]])


def decode(data: bytes | memoryview, expected: bytes | None = None) -> Decoded:
    """The arrays of a payload, after checking its digest; `CorruptDataError` otherwise.

    Uncompressed arrays are zero-copy read-only views of `data`.
    """
    if not verify(data, expected):
        raise CorruptDataError("payload digest mismatch")
    _magic, version, flags, n, body_len, raw_len, _ = LEAD.unpack_from(data)
    if version != CODEC_VERSION:
        raise CorruptDataError(
            f"payload format version {version} (this build reads {CODEC_VERSION})"
        )
    pos = LEAD.size
    shapes: list[tuple[int, ...]] = []
    dtypes: list[DType] = []
    sizes: list[int] = []
    try:
        for _i in range(n):
            code, ndim = struct.unpack_from("<BB", data, pos)
            shape = struct.unpack_from(f"<{ndim}I", data, pos + 2)
            d = DTYPES_BY_CODE[code]
            shapes.append(shape)
            dtypes.append(d)
            sizes.append(math.prod(shape) * d.itemsize)
            pos += 2 + 4 * ndim
    except (struct.error, KeyError) as e:
        raise CorruptDataError(f"bad array descriptor: {e}") from None
    pos += -pos % 8
    if pos + body_len != len(data):
        raise CorruptDataError("payload length disagrees with its header")
    # Sizes are checked before anything is allocated or decompressed.
    if sum(sizes) != raw_len or (not flags & FLAG_LZ4 and body_len != raw_len):
        raise CorruptDataError("array sizes disagree with the body length")
    if flags & FLAG_LZ4 and raw_len > _LZ4_MAX_RATIO * body_len + 64:
        raise CorruptDataError("lz4 body claims more bytes than lz4 can expand to")
    body: bytes | memoryview = memoryview(data)[pos:]
    if flags & FLAG_LZ4:
        try:
            body = lz4.block.decompress(body, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as e:
            raise CorruptDataError(f"lz4 body does not decompress: {e}") from None
        if len(body) != raw_len:
            raise CorruptDataError("lz4 body decompresses to the wrong size")
    arrays: list[np.ndarray] = []
    off = 0
    for shape, d, size in zip(shapes, dtypes, sizes, strict=True):
        arrays.append(
            np.frombuffer(body, dtype=d.storage, count=size // d.itemsize, offset=off).reshape(
                shape
            )
        )
        off += size
    return Decoded(arrays, dtypes, bool(flags & FLAG_LZ4))
