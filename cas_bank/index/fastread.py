"""Payload files read, verified and copied into a restore's destination arrays.

A block payload in the file tier (`blocks.files`) is the codec's bytes: a fixed lead,
the array descriptors, then each attention array's block slice in C order.

With the native helper (`cas_bank._fill`, built with the package): one C call on the
restoring thread and one on a pool thread, without the GIL, take the blocks from a
shared counter; per block it checks the file's head, reads the body in runs of 256 KiB
into the thread's staging buffer, hashes each run while it is in the core's cache and
copies it out to the destination rows: one copy out of the page cache, one hashing
pass, one copy from cache to the rows. The rows of a block that fails
its digest hold unverified bytes, which the restore never hands out (it ends before
that block, and bytes beyond a cache's offset are never read).

Without it: one `preadv` of the whole file into the reading thread's reused buffer,
one blake3 call over it, then, once it verified, one strided copy per array into its
rows of the destination.

Blocks go to a small thread pool on that path: `preadv`, blake3 and `np.copyto` all
release the GIL.

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

try:
    from cas_bank import _fill
except ImportError:  # not built (no C compiler at install): the Python path below
    _fill = None  # type: ignore[assignment]
_read_into = _fill.read_into if _fill is not None else None
_read_many = _fill.read_many if _fill is not None else None

# What the native reader's codes mean (cas_bank/_native/fill.c).
_FAILURES = {
    1: "payload file missing",
    2: "payload file is truncated",  # or longer than its record says
    4: "payload digest mismatch",
    5: "payload file unreadable",
}

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
        self._segments = _row_runs(self._dests, self.block_size)
        # A plain payload's lead up to its digest, and its whole size.
        self._lead_prefix = _LEAD.pack(
            b"CASB", 1, 0, len(self._parts), self.body_len, self.body_len, bytes(32)
        )[:_DIGEST_AT]
        self._file_len = _LEAD.size + len(self.desc) + self.body_len

    def _head(self, expected: bytes) -> bytes:
        """The head a plain payload of this layout with digest `expected` starts with."""
        return self._lead_prefix + expected + self.desc

    def _native(self, index: int, path: Path, size: int, expected: bytes) -> str | None:
        """`read` by the native reader (`self._segments` is set)."""
        assert _read_into is not None and self._segments is not None
        if size != self._file_len:  # compressed, or not this layout
            return "not a plain payload"
        code, errno = _read_into(
            os.fsdecode(path),
            self._head(expected),
            _LEAD.size,
            self._segments,
            index,
            PAYLOAD_CONTEXT,
        )
        return self._failure(code, errno, (index, path, size, expected))

    def read(self, index: int, path: Path, size: int, expected: bytes) -> str | None:
        """Read and verify block `index` from `path` into its rows of the destination;
        None if good, else why not."""
        if self._segments is not None:
            return self._native(index, path, size, expected)
        return self._python(index, path, size, expected)

    def _python(self, index: int, path: Path, size: int, expected: bytes) -> str | None:
        """`read` without the native helper.

        One `preadv` of the whole file into this thread's buffer, one blake3 over it
        (a single call: blake3's SIMD, without the GIL), then one strided copy per
        array into its rows of the destination. A block is copied into the
        destination only once it is verified.
        """
        head_len = _LEAD.size + len(self.desc)
        if size != head_len + self.body_len:  # compressed, or not this layout
            return "not a plain payload"
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
        """`read` of every (index, path, size, digest), on both cores; results in order."""
        if self._segments is not None and _read_many is not None and len(items) > 1:
            return self._native_all(items)
        if len(items) < 2:
            return [self.read(*item) for item in items]
        return list(_executor().map(lambda item: self.read(*item), items))

    def _native_all(self, items: Sequence[tuple[int, Path, int, bytes]]) -> list[str | None]:
        """`read_all` by the native reader: one C call on this thread and one on the
        pool's, taking files from a shared counter (no task per block)."""
        assert _read_many is not None and self._segments is not None
        out: list[str | None] = ["not a plain payload"] * len(items)
        plain = [k for k, (_, _, size, _) in enumerate(items) if size == self._file_len]
        if not plain:
            return out
        paths = tuple(os.fsencode(items[k][1]) for k in plain)
        heads = tuple(self._head(items[k][3]) for k in plain)
        indices = np.array([items[k][0] for k in plain], dtype=np.int64).tobytes()
        counter = np.zeros(1, dtype=np.int64)
        codes = np.zeros(2 * len(plain), dtype=np.int32)
        args = (paths, heads, indices, _LEAD.size, self._segments, PAYLOAD_CONTEXT, counter, codes)
        helper = _executor().submit(_read_many, *args)
        try:
            _read_many(*args)
        finally:
            helper.result()
        for j, k in enumerate(plain):
            code, errno = int(codes[2 * j]), int(codes[2 * j + 1])
            out[k] = self._failure(code, errno, items[k])
        return out

    def _failure(self, code: int, errno: int, item: tuple[int, Path, int, bytes]) -> str | None:
        """What a native reader's (code, errno) for `item` means: None if it was good."""
        if code == 0:
            return None
        if code == 3:  # not the head expected: say why the slow way (rare)
            return self._python(*item) or "payload head mismatch"
        why = _FAILURES.get(code, f"native reader failed with code {code}")
        return f"{why} ({os.strerror(errno)})" if errno else why


def _row_runs(dests: Sequence[np.ndarray], block_size: int) -> bytes | None:
    """The destination rows of every block as native int64 triples, in payload order:
    (block 0's address, length, bytes to block i's rows per i); None without the
    native reader or for views it cannot address this way.

    A view [..., T, D] whose last axis is contiguous and whose token axis steps one
    row at a time holds each leading index's block rows as one contiguous run.
    """
    if _read_into is None or not dests:
        return None
    runs: list[np.ndarray] = []
    for dest in dests:
        if dest.ndim < 2 or not dest.flags.writeable:
            return None
        item = dest.itemsize
        row = dest.shape[-1] * item
        if dest.strides[-1] != item or dest.strides[-2] != row:
            return None
        offsets = np.zeros(1, dtype=np.int64)
        for n, stride in zip(dest.shape[:-2], dest.strides[:-2], strict=True):
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).ravel()
        triples = np.empty((len(offsets), 3), dtype=np.int64)
        triples[:, 0] = dest.__array_interface__["data"][0] + offsets
        triples[:, 1] = block_size * row
        triples[:, 2] = block_size * row
        runs.append(triples)
    return np.concatenate(runs).tobytes()
