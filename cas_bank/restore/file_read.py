"""Payload files read, verified and copied into a restore's destination arrays.

A block payload in the file tier (`blocks.files`) is the codec's bytes: a fixed lead,
the array descriptors, then each attention array's block slice in C order.

With the native helper (`cas_bank._fill`, built with the package): one C call, without
the GIL, reads on the restoring thread and on the module's own partner thread
(cas_bank/_native/pair.h: no Python on its side) at once, both taking the blocks from a
shared counter; per block it checks the file's head and reads the body in runs of
256 KiB: an XXH3-128 payload straight into the destination rows, each run checked there
just after (one copy out of the page cache, one hashing pass); a blake3 one (banks
before format 4) into the thread's staging buffer, checked there, then copied out to
the rows. The rows of
a block that fails its digest hold unverified bytes, which the restore never hands
out (it ends before that block, and bytes beyond a cache's offset are never read).

Either check a payload's digest field names (`hashing.check_of`: XXH3-128 or blake3)
is computed this way.

Without it: one `preadv` of the whole file into the reading thread's reused buffer
(kept by the bank's `Resources`),
one check over it (the `xxhash` or `blake3` package), then, once it verified, one
strided copy per array into its rows of the destination.

Blocks go to the bank's helper threads on that path (`restore.workers`, handed in by
the caller; without them, one by one): `preadv`, the checks and `np.copyto` all
release the GIL.

A payload that is not a plain (uncompressed) payload of the expected layout, whose
digest fails, or whose file is gone comes back as a failure; the caller reads it the
slow way or stops the restore there.
"""

from __future__ import annotations

import array
import ctypes
import functools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, cast

import numpy as np

from cas_bank.arrays import DType
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT, check_of, payload_check
from cas_bank.native import fill_module
from cas_bank.restore import row_runs as runs_of
from cas_bank.restore.row_runs import RowRuns, placed, row_runs
from cas_bank.restore.workers import Workers

FilePath: TypeAlias = str | Path  # a payload file: restores name them as strings
Job: TypeAlias = tuple[int, FilePath, int, bytes]  # (block index, file, size, digest)

# The C helper (setup.py); None when not built or CAS_BANK_PURE_PYTHON=1 turned it
# off: the Python path below (cas_bank.native says which).
_fill = fill_module
_read_into = _fill.read_into if _fill is not None else None
_read_many = _fill.read_many if _fill is not None else None
_block_jobs = getattr(_fill, "block_jobs", None)

# What the native reader's codes mean (cas_bank/_native/fill.c).
_FAILURES = {
    1: "payload file missing",
    2: "payload file is truncated",  # or longer than its record says
    4: "payload digest mismatch",
    5: "payload file unreadable",
}

# The payload's lead (blocks.codec): the native reader is given its size and finds the
# digest field in its last `codec.DIGEST_LEN` bytes, as the codec puts it.
_LEAD_SIZE = codec.LEAD.size
_DIGEST_AT = codec.DIGEST_AT
_KEY_LEN = 32  # a block's key (its chain hash)
# Bytes copied in from memory (`BlockFiles.copy_in`) from which the native partner
# thread copies half: below, waking it costs more than it saves.
_TWO_THREADS_FROM = 4 << 20


def _buffer(scratch: threading.local | None, size: int) -> bytearray:
    """A buffer of at least `size` bytes: this thread's in `scratch` (the bank's,
    `cas_bank.restore.resources`), reused; a new one where there is none."""
    if scratch is None:
        return bytearray(size)
    buf: bytearray | None = getattr(scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = scratch.buf = bytearray(size)
    return buf


@dataclass(frozen=True, slots=True)
class Layout:
    """What a plain payload of some block arrays looks like: its descriptors (padded)
    and body size, where each array sits in it (offset, count, dtype, shape), its
    lead up to the digest, its whole size, and each array's rows a block."""

    desc: bytes
    body_len: int
    parts: tuple[tuple[int, int, np.dtype[np.generic], tuple[int, ...]], ...]
    lead_prefix: bytes
    file_len: int
    rows: tuple[int, ...]


def layout_of(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[DType]) -> Layout:
    """The `Layout` of plain payloads of block arrays of `shapes` and `dtypes`, for a
    caller that keeps it (`assembler`: a `BlockFiles` per restore then looks up
    nothing; ~20 us of a cold restore)."""
    return _layout(tuple(map(tuple, shapes)), tuple(dtypes))


@functools.lru_cache(maxsize=64)
def _layout(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[DType, ...]) -> Layout:
    """`Layout` of block arrays of `shapes` and `dtypes`: the same few each restore of
    a model asks for, made once (a restore of 48 arrays spent ~0.1 ms making it)."""
    desc = codec.descriptors(shapes, dtypes)
    parts = []
    at = _LEAD_SIZE + len(desc)
    for shape, d in zip(shapes, dtypes, strict=True):
        n = math.prod(shape)
        parts.append((at, n, d.storage, shape))
        at += n * d.itemsize
    body_len = at - _LEAD_SIZE - len(desc)
    return Layout(
        desc,
        body_len,
        tuple(parts),
        codec.plain_lead(len(parts), body_len),
        at,
        tuple(s[-2] if len(s) >= 2 else 0 for s in shapes),
    )


class BlockFiles:
    """Reads block payload files into the writable views `dests` (each [..., T, D]).

    `shapes` are one block's arrays: block i of array j fills rows
    [i * r, (i + 1) * r) of `dests[j]`'s axis -2, r being `shapes[j][-2]` (the block
    size). A state payload is block 0 of arrays whose shapes are the whole state's.
    """

    def __init__(
        self,
        dests: Sequence[np.ndarray],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[DType],
        block_size: int | None = None,
        *,
        runs: RowRuns | None = None,
        addresses: np.ndarray | None = None,
        layout: Layout | None = None,
        scratch: threading.local | None = None,
    ) -> None:
        """`runs` and `addresses`: where the caller has them, `dests`' row runs at
        address 0 (`contiguous_row_runs` of their shapes: the caller vouches that each
        view is C-contiguous and writable) and each view's address (int64). `layout`:
        `layout_of(shapes, dtypes)`, where the caller keeps it (its shapes then vouched
        for as `block_size` rows). `scratch`: where the reading threads keep the buffer
        the reader without the native helper reuses (the bank's); None: one a read."""
        self._scratch = scratch
        if layout is None:
            if block_size is not None and any(s[-2] != block_size for s in shapes):
                raise ValueError(f"block arrays of shapes {list(shapes)} are not {block_size} rows")
            layout = _layout(tuple(map(tuple, shapes)), tuple(dtypes))
        self.desc, self.body_len = layout.desc, layout.body_len
        self._parts = layout.parts
        self._lead_prefix = layout.lead_prefix
        self._file_len = layout.file_len
        self._dests = list(dests)
        # What the segments were placed from, kept for `copy_in` (None: made from the views).
        self._runs, self._addresses = runs, addresses
        if runs is not None and addresses is not None:
            self._segments = placed(runs, addresses) if _read_into is not None else None
        else:
            self._segments = row_runs(self._dests, layout.rows)

    @property
    def native(self) -> bool:
        """Whether the native reader fills these destinations (else the Python path)."""
        return self._segments is not None

    @property
    def file_len(self) -> int:
        """The size of a plain payload file of this layout."""
        return self._file_len

    def _head(self, expected: bytes) -> bytes:
        """The head a plain payload of this layout with digest `expected` starts with."""
        return self._lead_prefix + expected + self.desc

    def _native(self, index: int, path: FilePath, size: int, expected: bytes) -> str | None:
        """`read` by the native reader (`self._segments` is set)."""
        assert _read_into is not None and self._segments is not None
        if size != self._file_len:  # compressed, or not this layout
            return "not a plain payload"
        code, errno = _read_into(
            os.fsdecode(path),
            self._head(expected),
            _LEAD_SIZE,
            self._segments,
            index,
            PAYLOAD_CONTEXT,
        )
        return self._failure(code, errno, (index, path, size, expected))

    def read(self, index: int, path: FilePath, size: int, expected: bytes) -> str | None:
        """Read and verify block `index` from `path` into its rows of the destination;
        None if good, else why not."""
        if self._segments is not None:
            return self._native(index, path, size, expected)
        return self._python(index, path, size, expected)

    def _python(self, index: int, path: FilePath, size: int, expected: bytes) -> str | None:
        """`read` without the native helper.

        One `preadv` of the whole file into this thread's buffer, one check over it
        (the kind its digest field names: one call of xxhash or blake3), then one strided copy per
        array into its rows of the destination. A block is copied into the
        destination only once it is verified.
        """
        head_len = _LEAD_SIZE + len(self.desc)
        if size != head_len + self.body_len:  # compressed, or not this layout
            return "not a plain payload"
        buf = _buffer(self._scratch, size)
        view = memoryview(buf)[:size]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "payload file missing"
        # A byte past the end is asked for too: a file longer than its record says
        # fills it (the native reader's check, `preadv_full`'s probe in fill.c).
        probe = bytearray(1)
        try:
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:], probe], got)
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
        if got != size:
            return "payload file is truncated"
        plain, body_len, claimed = codec.read_plain_lead(buf)
        if not plain:
            return "not a plain payload"
        if view[_LEAD_SIZE:head_len] != self.desc or body_len != self.body_len:
            return "payload layout does not fit the spec"
        if claimed != expected:
            return "payload digest is not the header's"
        if payload_check(view[:_DIGEST_AT], view[_LEAD_SIZE:], check=check_of(claimed)) != claimed:
            return "payload digest mismatch"
        for dest, (at, count, dtype, shape) in zip(self._dests, self._parts, strict=True):
            src = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape)
            if dest.shape == shape and index == 0:
                np.copyto(dest, src)
            else:
                rows = shape[-2]
                np.copyto(dest[..., index * rows : (index + 1) * rows, :], src)
        return None

    @property
    def copies_in(self) -> bool:
        """Whether payloads held in memory can be copied in by `copy_in` (the native
        copy and these destinations' runs)."""
        return self._segments is not None and runs_of.available()

    def holds(self, payload: bytes, expected: bytes) -> bool:
        """Whether `payload` (a record's bytes) is a plain payload of this layout whose
        digest field is `expected` and whose check confirms it: what the native reader
        checks of a file (its head, then the check over the rest), and all `copy_in`
        needs. Anything else (compressed, another layout, damaged) is False: the caller
        decodes it, and the codec says what is wrong with it."""
        if len(payload) != self._file_len or not payload.startswith(self._head(expected)):
            return False
        view = memoryview(payload)
        check = payload_check(view[:_DIGEST_AT], view[_LEAD_SIZE:], check=check_of(expected))
        return check == expected

    def copy_in(self, payloads: Sequence[tuple[int, bytes]]) -> None:
        """Copy each (block index, payload) into that block's rows, in one native call
        (`copies_in` only); every payload `holds` here. A block's rows are the same a
        read of its file would fill."""
        if not payloads:
            return
        assert self._segments is not None
        # A bytes object's buffer, as ctypes passes one to C (no copy; held by `payloads`).
        address = ctypes.c_void_p
        sources = [ctypes.cast(cast(Any, p), address).value or 0 for _, p in payloads]
        runs_of.copy_payloads(
            self._segments,
            _LEAD_SIZE + len(self.desc),
            [i for i, _ in payloads],
            sources,
            two_threads=len(payloads) * self.body_len >= _TWO_THREADS_FROM,
            runs=self._runs,
            addresses=self._addresses,
        )

    def read_all(self, items: Sequence[Job], workers: Workers | None = None) -> list[str | None]:
        """`read` of every (index, path, size, digest), on both cores; results in order
        (`read_files`)."""
        return read_files([(self, item) for item in items], workers)

    def _failure(self, code: int, errno: int, item: Job) -> str | None:
        """What a native reader's (code, errno) for `item` means: None if it was good."""
        if code == 0:
            return None
        if code == 3:  # not the head expected: say why the slow way (rare)
            return self._python(*item) or "payload head mismatch"
        why = _FAILURES.get(code, f"native reader failed with code {code}")
        return f"{why} ({os.strerror(errno)})" if errno else why


def read_files(
    jobs: Sequence[tuple[BlockFiles, Job]], workers: Workers | None = None
) -> list[str | None]:
    """`reader.read(*item)` of every (reader, item), on both cores; results in order.

    With the native reader, one C call reads on this thread and on its partner thread,
    both taking the files from a shared counter (no task per file); files it cannot
    read this way (the Python path's, one of another size) are read after, on
    `workers`' pool (the bank's, `restore.resources`), or one by one here without it.
    """
    out: list[str | None] = [None] * len(jobs)
    native = [
        k
        for k, (reader, (_, _, size, _)) in enumerate(jobs)
        if reader.native and size == reader._file_len
    ]
    if _read_many is not None and len(native) > 1:
        paths = tuple(os.fsencode(jobs[k][1][1]) for k in native)
        heads = tuple(jobs[k][0]._head(jobs[k][1][3]) for k in native)
        segments = tuple(cast(bytes, jobs[k][0]._segments) for k in native)
        # array, not numpy: a cold restore paid ~10 us a numpy call here.
        indices = array.array("q", [jobs[k][1][0] for k in native])
        codes = array.array("i", bytes(8 * len(native)))  # (code, errno) a file
        # On this thread and the native partner (cas_bank/_native/pair.h) at once;
        # it says how many files failed.
        if _read_many(paths, heads, indices, _LEAD_SIZE, segments, PAYLOAD_CONTEXT, codes):
            for j, k in enumerate(native):
                reader, item = jobs[k]
                out[k] = reader._failure(codes[2 * j], codes[2 * j + 1], item)
        if len(native) == len(jobs):
            return out
        done = set(native)
        rest = [k for k in range(len(jobs)) if k not in done]
    else:
        rest = list(range(len(jobs)))
    if len(rest) < 2 or workers is None:
        for k in rest:
            out[k] = jobs[k][0].read(*jobs[k][1])
    else:
        results = workers.map(lambda k: jobs[k][0].read(*jobs[k][1]), rest)
        for k, why in zip(rest, results, strict=True):
            out[k] = why
    return out


def read_plain_blocks(
    reader: BlockFiles,
    prefix: bytes,
    keys: bytes,
    digests: bytes,
    first: int,
    before: tuple[BlockFiles, Job] | None = None,
) -> list[str | None] | None:
    """`read_files` of blocks first, first + 1, ... whose payloads are plain files of
    `reader`'s layout, named by their keys and digest fields (32 bytes each,
    concatenated) in the file tier's directory `prefix` (`FileTier.prefix`), and of the
    job `before` (a state) ahead of them; results in that order. The native helper
    names each file and makes its head (`block_jobs`): a reopened restore of 64 blocks
    did that in Python, ~5 us a block cold. None where the native reader is not built
    or cannot fill `reader`'s views: the caller goes `read_files`' way."""
    if _block_jobs is None or _read_many is None or not reader.native:
        return None
    if len(keys) % _KEY_LEN or len(digests) != len(keys) // _KEY_LEN * codec.DIGEST_LEN:
        return None
    names, heads = _block_jobs(prefix, keys, digests, reader._lead_prefix, reader.desc)
    ahead: list[str | None] = []
    if before is not None and not (before[0].native and before[1][2] == before[0]._file_len):
        ahead, before = [before[0].read(*before[1])], None  # rare: a compressed state
    paths, segments = names, (cast(bytes, reader._segments),) * len(names)
    indices = array.array("q", range(first, first + len(names)))
    if before is not None:
        b_reader, (b_index, b_path, _, b_digest) = before
        paths = (os.fsencode(b_path), *names)
        heads = (b_reader._head(b_digest), *heads)
        segments = (cast(bytes, b_reader._segments), *segments)
        indices.insert(0, b_index)

    def job(k: int) -> tuple[BlockFiles, Job]:
        """The job at position k of the call (the state first, when it is in it)."""
        if before is not None:
            if k == 0:
                return before
            k -= 1
        digest = digests[codec.DIGEST_LEN * k : codec.DIGEST_LEN * (k + 1)]
        return reader, (first + k, os.fsdecode(names[k]), reader._file_len, digest)

    codes = array.array("i", bytes(8 * len(paths)))  # (code, errno) a file
    out: list[str | None] = [None] * len(paths)
    if _read_many(paths, heads, indices, _LEAD_SIZE, segments, PAYLOAD_CONTEXT, codes):
        for k in range(len(paths)):
            if codes[2 * k]:
                job_reader, item = job(k)
                out[k] = job_reader._failure(codes[2 * k], codes[2 * k + 1], item)
    return ahead + out
