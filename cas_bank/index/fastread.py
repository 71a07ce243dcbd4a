"""Payload files read straight into a restore's destination arrays, and verified.

A block payload in the file tier (`blocks.files`) is the codec's bytes: a fixed
lead, the array descriptors, then each attention array's block slice in C order.
For an array of shape [..., T, D] the slice of block i is, for every leading index,
one contiguous run of rows [i*B, (i+1)*B) of the destination: so one `preadv` per
block puts the whole body where it belongs, with no intermediate copy, and blake3
then runs over those same runs (still in cache) in the payload's byte order: the
digest is the codec's, unchanged. Blocks go to a small thread pool: `preadv` and
blake3 both release the GIL, so two cores read and hash at once.

A payload that is not a plain (uncompressed) payload of the expected layout, whose
digest fails, or whose file is gone comes back as a failure; the caller reads it the
slow way or stops the restore there.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np

from cas_bank.arrays import DType
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT

_LEAD = struct.Struct("<4sBBHQQ32s")  # blocks.codec._FIXED
_DIGEST_AT = _LEAD.size - 32
_IOV_MAX = 512  # iovecs per preadv call (Linux allows 1024)
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
        # Every destination as [rows, T, D]: a block is one run per row.
        self._rows = [d.reshape(-1, d.shape[-2], d.shape[-1]) for d in dests]

    def _runs(self, index: int) -> list[memoryview]:
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        out: list[memoryview] = []
        for rows in self._rows:
            for r in range(rows.shape[0]):
                out.append(memoryview(rows[r, lo:hi]).cast("B"))  # type: ignore[arg-type]
        return out

    def read(self, index: int, path: Path, size: int, expected: bytes) -> str | None:
        """Read and verify block `index` from `path`; None if good, else why not."""
        head = bytearray(_LEAD.size + len(self.desc))
        if size != len(head) + self.body_len:
            return "payload file size does not fit the layout"
        runs = self._runs(index)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "payload file missing"
        try:
            iov: list[memoryview | bytearray] = [head, *runs]
            got, at = 0, 0
            for i in range(0, len(iov), _IOV_MAX):
                part = iov[i : i + _IOV_MAX]
                n = os.preadv(fd, part, at)
                want = sum(len(p) for p in part)
                got += n
                at += n
                if n != want:
                    break
        finally:
            os.close(fd)
        if got != size:
            return "payload file is truncated"
        magic, version, flags, _n, body_len, raw_len, claimed = _LEAD.unpack_from(head)
        if magic != b"CASB" or version != 1 or flags != 0 or body_len != raw_len:
            return "not a plain payload"
        if bytes(head[_LEAD.size :]) != self.desc or body_len != self.body_len:
            return "payload layout does not fit the spec"
        if claimed != expected:
            return "payload digest is not the header's"
        h = blake3.blake3(derive_key_context=PAYLOAD_CONTEXT)
        h.update(memoryview(head)[:_DIGEST_AT])
        h.update(memoryview(head)[_LEAD.size :])
        for run in runs:
            h.update(run)
        if h.digest() != claimed:
            return "payload digest mismatch"
        return None

    def read_all(self, items: Sequence[tuple[int, Path, int, bytes]]) -> list[str | None]:
        """`read` of every (index, path, size, digest), on the pool; results in order."""
        if len(items) < 2:
            return [self.read(*item) for item in items]
        return list(_executor().map(lambda item: self.read(*item), items))
