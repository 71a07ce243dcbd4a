"""The file tier's direct read (restore.file_read): the native reader and the Python one
put the same verified bytes in the same rows and refuse the same damage."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CHECKS, hybrid_spec
from forking import holds_in_a_forked_child
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank.arrays import DTYPES, DType
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT, Check
from cas_bank.native import fill_module
from cas_bank.restore import file_read, row_runs
from cas_bank.restore.assemble import Assembler
from cas_bank.restore.file_read import BlockFiles

pytestmark = pytest.mark.skipif(
    file_read._read_into is None, reason="the native reader (cas_bank._fill) is not built"
)


def _layout(
    rng: np.random.Generator, n_arrays: int, heads: int, block: int, dtype: DType
) -> tuple[list[tuple[int, ...]], list[DType]]:
    # Rows of different sizes, as quantized KV has (packed values, scales, biases).
    dims = [int(rng.integers(1, 40)) for _ in range(n_arrays)]
    return [(1, heads, block, d) for d in dims], [dtype] * n_arrays


def _write(
    tmp: Path,
    rng: np.random.Generator,
    shapes: list[tuple[int, ...]],
    dtypes: list[DType],
    n: int,
    check: Check = "xxh3",
) -> tuple[list[Path], list[bytes], list[list[np.ndarray]]]:
    paths, payloads, blocks = [], [], []
    for i in range(n):
        arrays = [
            rng.integers(0, 255, int(np.prod(s)), dtype=np.uint8).view(np.uint8).astype(d.storage)
            if d.storage.kind in "iu"
            else rng.standard_normal(s).astype(d.storage)
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        arrays = [a.reshape(s) for a, s in zip(arrays, shapes, strict=True)]
        payload = codec.encode(arrays, dtypes, compression="none", check=check)
        path = tmp / f"b{i}"
        path.write_bytes(payload)
        paths.append(path)
        payloads.append(payload)
        blocks.append(arrays)
    return paths, payloads, blocks


def _dests(
    shapes: list[tuple[int, ...]], dtypes: list[DType], n: int, block: int
) -> list[np.ndarray]:
    return [
        np.full((*s[:-2], n * block, s[-1]), 7, dtype=d.storage)
        for s, d in zip(shapes, dtypes, strict=True)
    ]


def _read(
    native: bool, dests: list[np.ndarray], shapes, dtypes, block, items, *, batch: bool = False
) -> list[str | None]:
    reader = BlockFiles(dests, shapes, dtypes, block)
    if native:
        assert reader._segments is not None
    else:
        reader._segments = None
    if batch:  # both cores, one call each (the restore's way)
        return reader.read_all(items)
    return [reader.read(*item) for item in items]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_arrays=st.integers(1, 4),
    heads=st.integers(1, 3),
    block=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(sorted(DTYPES)),
    check=st.sampled_from(CHECKS),
)
def test_native_and_python_reads_fill_the_same_rows(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    n_arrays: int,
    heads: int,
    block: int,
    dtype: str,
    check: Check,
) -> None:
    tmp = tmp_path_factory.mktemp("file_read")
    rng = np.random.default_rng(seed)
    shapes, dtypes = _layout(rng, n_arrays, heads, block, DTYPES[dtype])
    n = 3
    paths, payloads, blocks = _write(tmp, rng, shapes, dtypes, n, check)
    items = [(i, paths[i], len(payloads[i]), codec.embedded_digest(payloads[i])) for i in range(n)]
    out = {}
    for native, batch in ((True, True), (True, False), (False, False)):
        dests = _dests(shapes, dtypes, n, block)
        assert _read(native, dests, shapes, dtypes, block, items, batch=batch) == [None] * n
        out[native] = dests
        for i, arrays in enumerate(blocks):
            for dest, a in zip(dests, arrays, strict=True):
                assert dest[..., i * block : (i + 1) * block, :].tobytes() == a.tobytes()
    for a, b in zip(out[True], out[False], strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("check", CHECKS)
def test_the_native_reader_finds_the_digest_where_the_codec_puts_it(
    tmp_path: Path, check: Check
) -> None:
    """The lead is defined once (`codec.LEAD`, its digest field last); the native reader
    (cas_bank/_native/fill.c) is given its size and takes the last `codec.DIGEST_LEN`
    bytes of it as the digest field. The head `BlockFiles` expects is the codec's own
    first bytes; a payload `codec.encode` wrote reads with the codec's lead size, and
    with the lead said to end anywhere else (C and Python disagreeing) it fails its
    check."""
    assert codec.LEAD.size == codec.DIGEST_AT + codec.DIGEST_LEN
    rng = np.random.default_rng(11)
    shapes, dtypes = _layout(rng, 2, 2, 4, DTYPES["float16"])
    paths, payloads, _blocks = _write(tmp_path, rng, shapes, dtypes, 1, check)
    digest = codec.embedded_digest(payloads[0])
    reader = BlockFiles(_dests(shapes, dtypes, 1, 4), shapes, dtypes, 4)
    head = reader._head(digest)
    assert head == payloads[0][: len(head)] and codec.digest_field(payloads[0]) == digest
    assert fill_module is not None
    for lead in (codec.LEAD.size - 8, codec.LEAD.size, codec.LEAD.size + 8):
        code, _errno = fill_module.read_into(
            os.fsdecode(paths[0]), head, lead, reader._segments, 0, PAYLOAD_CONTEXT
        )
        assert code == (0 if lead == codec.LEAD.size else 4), lead  # 4: digest mismatch


@pytest.mark.parametrize(
    "damage, why",
    [
        ("flip_body", "payload digest mismatch"),
        ("flip_head", "payload layout does not fit the spec"),
        ("flip_field", "payload digest is not the header's"),  # its kind's tag too
        ("other_kind", "payload digest is not the header's"),
        ("truncate", "payload file is truncated"),
        ("cut_head", "payload file is truncated"),  # inside the head read with the body
        ("extend", "payload file is truncated"),  # one byte longer than its record says
        ("missing", "payload file missing"),
        ("other_digest", "payload digest is not the header's"),
        ("compressed", "not a plain payload"),
    ],
)
def test_native_and_python_refuse_the_same_damage(
    tmp_path: Path, damage: str, why: str, check: Check
) -> None:
    rng = np.random.default_rng(5)
    block = 8
    shapes, dtypes = _layout(rng, 2, 2, block, DTYPES["float32"])
    paths, payloads, _ = _write(tmp_path, rng, shapes, dtypes, 1, check)
    path, payload = paths[0], payloads[0]
    expected = codec.embedded_digest(payload)
    size = len(payload)
    if damage == "flip_body":
        raw = bytearray(payload)
        raw[-3] ^= 1
        path.write_bytes(raw)
    elif damage == "flip_head":
        raw = bytearray(payload)
        raw[codec.LEAD.size + 2] ^= 1  # a descriptor's shape
        path.write_bytes(raw)
    elif damage == "flip_field":
        raw = bytearray(payload)
        raw[codec.DIGEST_AT + 20] ^= 1  # in the XXH3 tag, or a blake3 digest's byte
        path.write_bytes(raw)
    elif damage == "other_kind":  # the same bytes, checked by the other kind
        path.write_bytes(codec.with_check(payload, "blake3" if check == "xxh3" else "xxh3"))
    elif damage == "truncate":
        path.write_bytes(payload[:-10])
    elif damage == "cut_head":
        path.write_bytes(payload[: codec.LEAD.size + 2])
    elif damage == "extend":
        path.write_bytes(payload + b"\0")
    elif damage == "missing":
        path.unlink()
    elif damage == "other_digest":
        expected = bytes(32)
    elif damage == "compressed":
        zeros = [np.zeros(s, d.storage) for s, d in zip(shapes, dtypes, strict=True)]
        packed = codec.encode(zeros, dtypes, compression="lz4", check=check)
        path.write_bytes(packed)
        size, expected = len(packed), codec.embedded_digest(packed)
    for native, batch in ((True, True), (True, False), (False, False)):
        dests = _dests(shapes, dtypes, 1, block)
        item = (0, path, size, expected)
        got = _read(native, dests, shapes, dtypes, block, [item, item], batch=batch)
        for g in got:
            assert g is not None and g.startswith(why), (native, batch, got)


@pytest.mark.parametrize(
    "heads, dim",
    [
        (5, 300),  # rows of 76.8 KB: the 256 KiB runs end inside them
        (1, 1500),  # one row run of 384 KB, more than a run
        (7, 3),  # many rows of 768 bytes
        (40, 3),  # 80 rows a file: an XXH3 run ends at the native reader's 64 rows
    ],
)
def test_large_payloads_split_across_runs_land_in_their_rows(
    tmp_path: Path, heads: int, dim: int, check: Check
) -> None:
    rng = np.random.default_rng(heads * dim)
    block, n = 64, 5
    shapes = [(1, heads, block, dim), (1, heads, block, dim + 1)]
    dtypes = [DTYPES["float32"]] * 2
    paths, payloads, blocks = _write(tmp_path, rng, shapes, dtypes, n, check)
    items = [(i, paths[i], len(payloads[i]), codec.embedded_digest(payloads[i])) for i in range(n)]
    raw = bytearray(payloads[3])
    raw[-1] ^= 0x40  # block 3 damaged: the others still land
    paths[3].write_bytes(raw)
    for native, batch in ((True, True), (True, False), (False, False)):
        dests = _dests(shapes, dtypes, n, block)
        got = _read(native, dests, shapes, dtypes, block, items, batch=batch)
        assert got == [None, None, None, "payload digest mismatch", None], (native, batch)
        for i, arrays in enumerate(blocks):
            if i == 3:
                continue
            for dest, a in zip(dests, arrays, strict=True):
                assert dest[..., i * block : (i + 1) * block, :].tobytes() == a.tobytes()


def test_keep_freed_memory_checks_its_input_and_reports_what_it_did() -> None:
    from cas_bank.errors import InvalidInputError
    from cas_bank.restore.destinations import keep_freed_memory

    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidInputError, match="threshold"):
            keep_freed_memory(bad)  # type: ignore[arg-type]
    import platform

    took = keep_freed_memory(1 << 30)
    assert took is (platform.libc_ver()[0] == "glibc")  # mallopt is glibc's


def test_one_batch_reads_files_of_different_layouts_into_their_own_arrays(tmp_path: Path) -> None:
    """`read_files` of block files and a state file together (a hybrid restore's batch):
    each lands in its own arrays, with the native reader's batch and without it."""
    rng = np.random.default_rng(11)
    block, n = 16, 4
    shapes, dtypes = _layout(rng, 2, 3, block, DTYPES["float32"])
    paths, payloads, blocks = _write(tmp_path, rng, shapes, dtypes, n)
    state_shapes = [(1, 3, 40), (1, 2, 8, 8)]
    state_dtypes = [DTYPES["bfloat16"], DTYPES["float32"]]
    (tmp_path / "state").mkdir()
    s_paths, s_payloads, s_arrays = _write(tmp_path / "state", rng, state_shapes, state_dtypes, 1)
    for native in (True, False):
        dests = _dests(shapes, dtypes, n, block)
        state_dests = [
            np.zeros(s, d.storage) for s, d in zip(state_shapes, state_dtypes, strict=True)
        ]
        blocks_reader = BlockFiles(dests, shapes, dtypes, block)
        state_reader = BlockFiles(state_dests, state_shapes, state_dtypes)
        if not native:
            blocks_reader._segments = state_reader._segments = None
        jobs = [
            (
                state_reader,
                (0, s_paths[0], len(s_payloads[0]), codec.embedded_digest(s_payloads[0])),
            )
        ]
        jobs += [
            (blocks_reader, (i, paths[i], len(payloads[i]), codec.embedded_digest(payloads[i])))
            for i in range(n)
        ]
        assert file_read.read_files(jobs) == [None] * (n + 1), native
        for got, want in zip(state_dests, s_arrays[0], strict=True):
            assert got.tobytes() == want.tobytes()
        for i, arrays in enumerate(blocks):
            for dest, a in zip(dests, arrays, strict=True):
                assert dest[..., i * block : (i + 1) * block, :].tobytes() == a.tobytes()


@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    rows=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 9)), min_size=1, max_size=4),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_row_runs_made_once_from_shapes_are_those_found_from_the_views(
    lead: list[int], rows: list[tuple[int, int]], dtype: str
) -> None:
    """`contiguous_row_runs` (made once per set of shapes, by the Assembler) placed at
    the views' addresses gives the segments `row_runs` finds from the views themselves."""
    d = DTYPES[dtype]
    shapes = [(*lead, blocks * 4, dim) for blocks, dim in rows]
    views = [np.zeros(shape, dtype=d.storage) for shape in shapes]
    runs = row_runs.contiguous_row_runs(shapes, [d.itemsize] * len(shapes), [4] * len(shapes))
    assert runs is not None
    addresses = np.array([v.__array_interface__["data"][0] for v in views], dtype=np.int64)
    assert row_runs.placed(runs, addresses) == row_runs.row_runs(views, [4] * len(views))
    block = [(*lead, 4, dim) for _, dim in rows]
    given_runs = BlockFiles(views, block, [d] * len(views), runs=runs, addresses=addresses)
    assert given_runs._segments == BlockFiles(views, block, [d] * len(views))._segments


def test_a_restores_state_reader_places_the_runs_its_shapes_fix() -> None:
    """An Assembler's reader of a state payload file (its state rows made once per set
    of shapes) writes where a reader finding them from the state views would."""
    assembler = Assembler(hybrid_spec(), 2, 4, 16, state=True)
    reader = assembler.state_files()
    assert reader is not None
    views = [d.view for d in assembler._state_dests]
    found = BlockFiles(views, assembler.state_shapes, assembler.state_dtypes)
    assert reader._segments == found._segments


# -- the native partner thread (cas_bank/_native/pair.h) -------------------------------


def _batch(tmp: Path, seed: int, n: int = 6) -> tuple[Any, ...]:
    """`n` block files of one layout, and what `_read_batch` needs to read and check them."""
    tmp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    block = 16
    shapes, dtypes = _layout(rng, 2, 2, block, DTYPES["float32"])
    paths, payloads, blocks = _write(tmp, rng, shapes, dtypes, n)
    items = [(i, paths[i], len(payloads[i]), codec.embedded_digest(payloads[i])) for i in range(n)]
    return shapes, dtypes, block, items, blocks


def _read_batch(case: tuple[Any, ...]) -> bool:
    """One `read_files` of the case's files into fresh rows: whether each landed right."""
    shapes, dtypes, block, items, blocks = case
    dests = _dests(shapes, dtypes, len(items), block)
    reader = BlockFiles(dests, shapes, dtypes, block)
    if file_read.read_files([(reader, item) for item in items]) != [None] * len(items):
        return False
    return all(
        dest[..., i * block : (i + 1) * block, :].tobytes() == a.tobytes()
        for i, arrays in enumerate(blocks)
        for dest, a in zip(dests, arrays, strict=True)
    )


def test_two_threads_reading_at_once_each_fill_their_own_rows(tmp_path: Path) -> None:
    """The partner takes one call at a time: a second caller meanwhile reads alone, and
    every call's rows come out whole, whoever read them."""
    cases = [_batch(tmp_path / f"t{k}", k) for k in range(2)]
    bad: list[int] = []

    def reads(k: int) -> None:
        bad.extend(k for _ in range(40) if not _read_batch(cases[k]))

    threads = [threading.Thread(target=reads, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_with_a_partner_of_its_own(tmp_path: Path) -> None:
    """The parent's partner thread is not in a forked child: the child starts its own."""
    assert fill_module is not None
    case = _batch(tmp_path, 5)
    assert _read_batch(case)
    parent = fill_module.partner_tid()
    assert parent != 0

    def in_the_child() -> bool:
        assert fill_module is not None
        ok = fill_module.partner_tid() == 0 and _read_batch(case)
        return ok and fill_module.partner_tid() not in (0, parent)

    assert holds_in_a_forked_child(in_the_child)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a system that pins threads to CPUs, and two CPUs",
)
def test_the_partner_is_kept_off_the_reading_threads_cpu(tmp_path: Path) -> None:
    assert fill_module is not None
    case = _batch(tmp_path, 7)
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed)[:2]:  # the reading thread moves: so does the partner
            os.sched_setaffinity(0, {cpu})
            assert _read_batch(case)
            mask = os.sched_getaffinity(fill_module.partner_tid())
            assert mask and cpu not in mask and mask <= allowed
    finally:
        os.sched_setaffinity(0, allowed)


@settings(max_examples=50, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)),
        max_size=6,
    ),
    lead=st.binary(max_size=24),
    desc=st.binary(max_size=40),
)
def test_the_native_names_and_heads_are_the_file_tiers_and_the_readers(
    tmp_path_factory: pytest.TempPathFactory,
    pairs: list[tuple[bytes, bytes]],
    lead: bytes,
    desc: bytes,
) -> None:
    """`block_jobs` names each block's file as `FileTier.name` does and makes the head
    `BlockFiles._head` expects, for any keys and digest fields."""
    from cas_bank.blocks.files import FileTier
    from cas_bank.blocks.rocks import RocksStore
    from cas_bank.blocks.store import Family

    tmp = tmp_path_factory.mktemp("names")
    tier = FileTier(RocksStore(tmp / "db"), tmp / "payloads")
    keys, digests = b"".join(k for k, _ in pairs), b"".join(d for _, d in pairs)
    paths, heads = fill_module.block_jobs(tier.prefix(Family.BLOCKS), keys, digests, lead, desc)
    assert [os.fsdecode(p) for p in paths] == [tier.name(Family.BLOCKS, k, d) for k, d in pairs]
    assert list(heads) == [lead + d + desc for _, d in pairs]
    with pytest.raises(ValueError, match="32-byte"):
        fill_module.block_jobs(b"/", keys + b"x", digests + b"x", lead, desc)


@pytest.mark.parametrize(
    "damage", ["none", "flip_body", "missing", "truncate", "other_digest", "compressed_state"]
)
def test_plain_blocks_read_by_native_names_are_read_files_own(tmp_path: Path, damage: str) -> None:
    """`read_plain_blocks` (names and heads made natively, a state job ahead of the
    blocks) fills the same rows and says the same of every file as `read_files` of the
    same jobs, whatever one block's file suffered."""
    from cas_bank.blocks.files import FileTier
    from cas_bank.blocks.rocks import RocksStore
    from cas_bank.blocks.store import Family

    rng = np.random.default_rng(3)
    block, n, first = 8, 5, 1
    shapes, dtypes = _layout(rng, 2, 2, block, DTYPES["float32"])
    tier = FileTier(RocksStore(tmp_path / "db"), tmp_path / "payloads")
    written, payloads, blocks = _write(tmp_path, rng, shapes, dtypes, n)
    keys = [rng.bytes(32) for _ in range(n)]
    digests = [codec.embedded_digest(p) for p in payloads]
    for key, digest, path in zip(keys, digests, written, strict=True):
        os.replace(path, tier.name(Family.BLOCKS, key, digest))
    names = [tier.name(Family.BLOCKS, k, d) for k, d in zip(keys, digests, strict=True)]
    state_shapes, state_dtypes = [(1, 3, 40)], [DTYPES["float32"]]
    (tmp_path / "state").mkdir()
    s_paths, s_payloads, s_arrays = _write(tmp_path / "state", rng, state_shapes, state_dtypes, 1)
    s_item = (0, str(s_paths[0]), len(s_payloads[0]), codec.embedded_digest(s_payloads[0]))
    hurt = 3
    if damage == "flip_body":
        raw = bytearray(payloads[hurt])
        raw[-5] ^= 4
        Path(names[hurt]).write_bytes(raw)
    elif damage == "missing":
        os.unlink(names[hurt])
    elif damage == "truncate":
        Path(names[hurt]).write_bytes(payloads[hurt][:-1])
    elif damage == "other_digest":
        digests[hurt] = bytes(32)
        os.replace(names[hurt], tier.name(Family.BLOCKS, keys[hurt], bytes(32)))
        names[hurt] = tier.name(Family.BLOCKS, keys[hurt], bytes(32))
    elif damage == "compressed_state":  # read by itself, ahead of the call
        packed = codec.encode([s_arrays[0][0] * 0], state_dtypes, compression="lz4")
        s_paths[0].write_bytes(packed)
        s_item = (0, str(s_paths[0]), len(packed), codec.embedded_digest(packed))
    got = {}
    for way in ("native names", "read_files"):
        dests = _dests(shapes, dtypes, n, block)
        state_dests = [
            np.zeros(s, d.storage) for s, d in zip(state_shapes, state_dtypes, strict=True)
        ]
        reader = BlockFiles(dests, shapes, dtypes, block)
        state_job = (BlockFiles(state_dests, state_shapes, state_dtypes), s_item)
        if way == "native names":
            out = file_read.read_plain_blocks(
                reader,
                tier.prefix(Family.BLOCKS),
                b"".join(keys[first:]),
                b"".join(digests[first:]),
                first,
                state_job,
            )
        else:
            jobs = [state_job] + [
                (reader, (i, names[i], reader.file_len, digests[i])) for i in range(first, n)
            ]
            out = file_read.read_files(jobs)
        assert out is not None
        got[way] = (out, [d.tobytes() for d in dests], [d.tobytes() for d in state_dests])
    assert got["native names"] == got["read_files"]
    results = got["native names"][0]
    assert len(results) == 1 + n - first
    bad = [k for k, why in enumerate(results) if why is not None]
    if damage == "compressed_state":  # not plain: the restore then reads it its own way
        assert bad == [0] and str(results[0]).startswith("not a plain payload")
    else:
        assert bad == ([] if damage == "none" else [1 + hurt - first])
    if damage == "none":
        for i in range(first, n):
            for dest, a in zip(got["native names"][1], blocks[i], strict=True):
                rows = np.frombuffer(dest, a.dtype).reshape(*a.shape[:-2], n * block, a.shape[-1])
                assert rows[..., i * block : (i + 1) * block, :].tobytes() == a.tobytes()
