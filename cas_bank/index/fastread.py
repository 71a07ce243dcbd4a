"""Payload files read, verified and copied into a restore's destination arrays.

A block payload in the file tier (`blocks.files`) is the codec's bytes: a fixed lead,
the array descriptors, then each attention array's block slice in C order. Per block:
one `preadv` of the whole file into the reading thread's reused buffer, one blake3
call over it (the codec's digest; blake3-py's fixed cost per call made hashing the
destination's row runs one call each slower than this extra copy), then, once it
verified, one strided copy per array into its rows of the destination. Blocks go to a
small thread pool: `preadv`, blake3 and `np.copyto` release the GIL.

A payload that is not a plain (uncompressed) payload of the expected layout, whose
digest fails, or whose file is gone comes back as a failure; the caller reads it the
slow way or stops the restore there.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np

from cas_bank.arrays import DType
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT

_LEAD = struct.Struct("<4sBBHQQ32s")  # blocks.codec._FIXED
_DIGEST_AT = _LEAD.size - 32
_THREADS = 2

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="cas_bank-fastread")
    return _pool


def expected_head(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[DType]) -> tuple[bytes, int]:
    """The descriptors (padded) a payload of these block arrays carries, and its body size."""
    desc = bytearray()
    body = 0
    for shape, d in zip(shapes, dtypes, strict=True):
        desc += struct.pack(f"<BB{len(shape)}I", d.code, len(shape), *shape)
        body += int(np.prod(shape)) * d.itemsize
    desc += b"\0" * (-(len(desc) + _LEAD.size) % 8)
    return bytes(desc), body


_scratch = threading.local()  # each reading thread's reused buffer


def _buffer(size: int) -> bytearray:
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratch.buf = bytearray(size)
    return buf


class BlockFiles:
    """Reads block payload files into the writable views `dests` (each [..., T, D])."""

    def __init__(
        self,
        dests: Sequence[np.ndarray],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[DType],
        block_size: int,
    ) -> None:
        self.block_size = block_size
        self.desc, self.body_len = expected_head(shapes, dtypes)
        self._dests = list(dests)
        # Where each array of a block sits in the payload body, and its shape.
        self._parts: list[tuple[int, int, np.dtype[np.generic], tuple[int, ...]]] = []
        at = _LEAD.size + len(self.desc)
        for shape, d in zip(shapes, dtypes, strict=True):
            n = int(np.prod(shape))
            self._parts.append((at, n, d.storage, tuple(shape)))
            at += n * d.itemsize

    def read(self, index: int, path: Path, size: int, expected: bytes) -> str | None:
        """Read and verify block `index` from `path`; None if good, else why not.

        One `preadv` of the whole file into this thread's buffer, one blake3 over it
        (a single call: blake3's SIMD, without the GIL), then one strided copy per
        array into its rows of the destination. A block is copied into the
        destination only once it is verified.
        """
        head_len = _LEAD.size + len(self.desc)
        if size != head_len + self.body_len:
            return "payload file size does not fit the layout"
        buf = _buffer(size)
        view = memoryview(buf)[:size]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "payload file missing"
        try:
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
        if got != size:
            return "payload file is truncated"
        magic, version, flags, _n, body_len, raw_len, claimed = _LEAD.unpack_from(buf)
        if magic != b"CASB" or version != 1 or flags != 0 or body_len != raw_len:
            return "not a plain payload"
        if view[_LEAD.size : head_len] != self.desc or body_len != self.body_len:
            return "payload layout does not fit the spec"
        if claimed != expected:
            return "payload digest is not the header's"
        h = blake3.blake3(derive_key_context=PAYLOAD_CONTEXT)
        h.update(view[:_DIGEST_AT])
        h.update(view[_LEAD.size :])
        if h.digest() != claimed:
            return "payload digest mismatch"
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        for dest, (at, count, dtype, shape) in zip(self._dests, self._parts, strict=True):
            src = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape)
            np.copyto(dest[..., lo:hi, :], src)
        return None

    def read_all(self, items: Sequence[tuple[int, Path, int, bytes]]) -> list[str | None]:
        """`read` of every (index, path, size, digest), on the pool; results in order."""
        if len(items) < 2:
            return [self.read(*item) for item in items]
        return list(_executor().map(lambda item: self.read(*item), items))
