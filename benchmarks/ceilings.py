"""Measuring helpers and the machine's ceilings, shared by every benchmark here.

A cas_bank figure means little alone: this machine has 2 noisy cores, a reference
BLAS and a software CRC in RocksDB. So each figure is printed beside its ceiling,
measured in the same run on the same bytes:

- memcpy: `np.copyto` into an array allocated beforehand (the hot tier's bound);
- raw RocksDB: rocksdict get/put with the bank's own options (BlobDB for payloads,
  RocksDB's read checksum off), no cas_bank code in between (the cold path's bound);
- XXH3-128: the check every payload of a format-4 bank carries (the `xxhash`
  package, one thread); blake3: the digest of older banks' payloads, in the bank's
  derive-key mode;
- payload files (the file tier): read on both cores into memory touched beforehand,
  as a plain copy out of the page cache (what loading an mlx-lm file does) and
  verified by the native reader (one copy and one pass of the payloads' own check: a
  verified restore's floor), and the same files re-digested with blake3 (the floor
  of a bank written before format version 4).

Timing: `sample` runs a function a few times (an untimed `setup` before each run)
and returns every duration; report medians (`median`) and tails (`percentile`).
`python -m benchmarks.ceilings` prints the machine-wide ceilings alone.
"""

from __future__ import annotations

import argparse
import array
import gc
import itertools
import json
import os
import statistics
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import xxhash
from rocksdict import Rdict, WriteBatch, WriteOptions

from cas_bank.arrays import address_of
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT
from cas_bank.blocks.rocks_options import db_options, family_options
from cas_bank.blocks.store import Family
from cas_bank.restore import row_runs

MiB = 1 << 20
GB = 1e9


# -- timing ------------------------------------------------------------------------
def sample(
    fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None
) -> list[float]:
    """Seconds of `repeats` calls of `fn`, each after an untimed `setup()`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out: list[float] = []
    gc.collect()  # once: a full collection per repeat costs more than what is timed
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("median of no samples")
    return float(statistics.median(xs))


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between samples (numpy's default)."""
    if not xs:
        raise ValueError("percentile of no samples")
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def dir_bytes(path: str | Path) -> int:
    """Bytes of every file under `path` (what the directory takes, logs and all)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def speed_fraction(seconds: float, ceiling_seconds: float) -> float:
    """How close a measured time is to its ceiling's: 1.0 means as fast as the ceiling."""
    return ceiling_seconds / seconds if seconds > 0 else float("inf")


def profile_top(fn: Callable[[], object], repeats: int = 1, top: int = 10) -> list[dict[str, Any]]:
    """Where `fn`'s time goes: the `top` functions by own time (cProfile), over `repeats` calls.

    Used where a target is missed, so the report says what to attack first.
    """
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({name})" if line else name,
                "calls": nc,
                "own_s": tt / repeats,
                "cum_s": ct / repeats,
                "own_share": tt / total if total else 0.0,
            }
        )
    rows.sort(key=lambda r: r["own_s"], reverse=True)
    return rows[:top]


# -- memcpy and blake3 ---------------------------------------------------------------
def memcpy_samples(nbytes: int, repeats: int = 7, *, threads: int = 1) -> list[float]:
    """`np.copyto` of `nbytes` into an array allocated (and touched) beforehand, split
    over `threads` threads (`np.copyto` releases the GIL)."""
    src = np.random.default_rng(0).integers(0, 255, max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1  # fault the pages in: the ceiling is the copy, not the page faults
    if threads <= 1:
        return sample(lambda: np.copyto(dst, src), repeats)
    cuts = np.linspace(0, src.size, threads + 1, dtype=np.int64).tolist()
    parts = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(cuts)]
    with ThreadPoolExecutor(threads) as pool:
        return sample(lambda: list(pool.map(lambda p: np.copyto(*p), parts)), repeats)


def layout_copy_samples(
    sources: Sequence[np.ndarray], capacity: int, repeats: int = 7, *, sets: int = 4
) -> list[float]:
    """A hot restore's copy alone: each of `sources` (`[..., tokens, dim]`) copied into
    the first tokens of a destination with room for `capacity` tokens, on two threads
    as the restore copies: by the native streamed copy (`cas_bank.restore.row_runs`)
    where it is built, else the arrays shared between two threads (`np.copyto`
    releases the GIL). The destinations are `sets` sets taken in turn: resident (touched
    beforehand) but not in cache, as a restore's fresh arrays are, where `memcpy_samples`
    copies into one warm buffer again and again."""
    shapes = [(*a.shape[:-2], capacity, a.shape[-1]) for a in sources]
    dests = [
        [np.ones(shape, dtype=a.dtype) for shape, a in zip(shapes, sources, strict=True)]
        for _ in range(sets)
    ]
    rounds = itertools.count()
    rows = sources[0].shape[-2] if sources else 0
    from_addresses = np.array([address_of(a) for a in sources], dtype=np.int64)
    to_addresses = [np.array([address_of(d) for d in ds], dtype=np.int64) for ds in dests]
    # Planned once, as a lease keeps its plan (`restore.lease_copy`): each copy only places it.
    plan = row_runs.plan_copy(dests[0], sources, from_addresses, rows) if dests else None

    def copy() -> None:
        at = next(rounds) % sets
        views = dests[at]
        if plan is not None:
            row_runs.copy_planned(plan, to_addresses[at], two_threads=True)
            return
        arrays = itertools.count()

        def work() -> None:
            while (j := next(arrays)) < len(sources):
                np.copyto(views[j][..., : sources[j].shape[-2], :], sources[j])

        other = helper.submit(work)
        work()
        other.result()

    with ThreadPoolExecutor(1) as helper:
        return sample(copy, repeats)


def blake3_samples(nbytes: int, chunk: int = MiB, repeats: int = 5) -> list[float]:
    """Digests of `nbytes` in `chunk`-sized payloads, one thread, the bank's mode."""
    data = np.random.default_rng(1).integers(0, 255, max(chunk, 1), dtype=np.uint8).tobytes()
    n = max(1, nbytes // chunk)

    def run() -> None:
        for _ in range(n):
            h = blake3.blake3(derive_key_context=PAYLOAD_CONTEXT)
            h.update(data)
            h.digest()

    return sample(run, repeats)


def xxh3_samples(nbytes: int, chunk: int = MiB, repeats: int = 5) -> list[float]:
    """XXH3-128 checks of `nbytes` in `chunk`-sized payloads, one thread (the package)."""
    data = np.random.default_rng(1).integers(0, 255, max(chunk, 1), dtype=np.uint8).tobytes()
    n = max(1, nbytes // chunk)

    def run() -> None:
        for _ in range(n):
            xxhash.xxh3_128_digest(data)

    return sample(run, repeats)


def blake3_floor_samples(paths: Sequence[Path], workdir: Path, repeats: int = 5) -> list[float]:
    """`file_read_samples(verified=True)` of copies of `paths` whose check is blake3
    (`codec.with_check`): the verified floor a bank written before format 4 has."""
    workdir.mkdir(parents=True, exist_ok=True)
    copies = []
    for i, p in enumerate(paths):
        copy = workdir / f"{i}-{p.name}"
        copy.write_bytes(codec.with_check(p.read_bytes(), "blake3"))
        copies.append(copy)
    try:
        return file_read_samples(copies, repeats, verified=True)
    finally:
        for copy in copies:
            copy.unlink()


def file_read_samples(
    paths: Sequence[Path], repeats: int = 5, *, verified: bool, threads: int = 2
) -> list[float]:
    """Seconds to read every payload file of `paths` on `threads` threads into memory
    touched beforehand: a plain `preadv` of each file, or (`verified`) the native
    reader's verified read of its body as a restore does it: one call of
    `cas_bank._fill.read_many` for all of them, on this thread and its native partner
    (a Python call a file through a pool measured slower than the restore's own read
    on a loaded host, so it was no floor)."""
    try:
        from cas_bank._fill import read_many
    except ImportError as e:  # a build without the native helper has no such floor
        raise RuntimeError("the native reader (cas_bank._fill) is not built") from e
    if not paths:
        raise ValueError("no payload files to read")
    sizes = [p.stat().st_size for p in paths]
    dest = np.ones(sum(sizes), dtype=np.uint8)  # touched: the floor is not page faults
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    lead = codec.LEAD.size
    work: list[tuple[str, bytes, bytes, memoryview]] = []
    for p, size, at in zip(paths, sizes, starts, strict=True):
        raw = p.read_bytes()
        body_len = struct.unpack_from("<Q", raw, 8)[0]  # the lead's body length
        head = raw[: size - body_len]
        addr = dest.ctypes.data + at + len(head)
        segs = np.array([[addr, body_len, 0]], dtype=np.int64).tobytes()
        work.append((str(p), head, segs, memoryview(dest)[at : at + size]))

    def plain(item: tuple[str, bytes, bytes, memoryview]) -> None:
        fd = os.open(item[0], os.O_RDONLY)
        try:
            os.preadv(fd, [item[3]], 0)
        finally:
            os.close(fd)

    if verified:
        names = tuple(os.fsencode(w[0]) for w in work)
        heads, segments = tuple(w[1] for w in work), tuple(w[2] for w in work)
        indices = array.array("q", bytes(8 * len(work)))
        codes = array.array("i", bytes(8 * len(work)))  # (code, errno) a file

        def checked() -> None:
            if read_many(names, heads, indices, lead, segments, PAYLOAD_CONTEXT, codes):
                raise RuntimeError(f"the native reader failed: (code, errno) {codes.tolist()}")

        return sample(checked, repeats, setup=evict_cpu_caches)
    with ThreadPoolExecutor(threads) as pool:
        return sample(lambda: list(pool.map(plain, work)), repeats, setup=evict_cpu_caches)


_SCRATCH: np.ndarray | None = None


def evict_cpu_caches(nbytes: int = 96 << 20) -> None:
    """Write one byte of every cache line of a buffer larger than the last-level cache
    (32 MiB here): what a floor read next finds in the CPU's caches is what a restore
    finds after other work, not the previous repeat's bytes (a payload set under the
    L3's size read back to back otherwise stays partly in it)."""
    global _SCRATCH
    if _SCRATCH is None or _SCRATCH.size < nbytes:
        _SCRATCH = np.zeros(nbytes, dtype=np.uint8)
    _SCRATCH[::64] += 1


# -- raw RocksDB with the bank's options ---------------------------------------------
@contextmanager
def raw_db(path: str | Path) -> Iterator[tuple[Any, dict[Family, Any]]]:
    """A bank directory (or a new one) opened by rocksdict alone, with `RocksStore`'s options.

    Yields the database and its column families, read with RocksDB's checksums as the
    bank reads every family (docs/design.md, "Damage and full disk"). Closes every
    handle on exit, so the directory can be opened again in this process.
    """
    families = {f.value: family_options(f) for f in Family}
    db = Rdict(str(path), options=db_options("wal"), column_families=families)
    cfs: dict[Family, Any] = {}
    try:
        for f in Family:
            if f.value in families:
                cfs[f] = db.get_column_family(f.value)
        yield db, cfs
    finally:
        for cf in cfs.values():
            cf.close()
        cfs.clear()
        db.close()


def raw_open_samples(path: str | Path, repeats: int = 5) -> list[float]:
    """Seconds to open the database at `path` with rocksdict alone (close untimed)."""
    out: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with raw_db(path) as (db, _cfs):
            out.append(time.perf_counter() - t0)
            del db
    return out


def raw_read_samples(
    path: str | Path, keys: dict[Family, list[bytes]], repeats: int = 5
) -> tuple[list[float], int]:
    """Seconds to get `keys` (single gets, as the bank reads payloads), each run right
    after a fresh open of the database (the open is not timed); and the bytes read."""
    out: list[float] = []
    nbytes = 0
    for _ in range(repeats):
        with raw_db(path) as (_db, cfs):
            t0 = time.perf_counter()
            got = [cfs[f][k] for f, ks in keys.items() for k in ks]
            out.append(time.perf_counter() - t0)
            nbytes = sum(len(v) for v in got)
    return out, nbytes


def raw_put_samples(
    path: str | Path, batches: Sequence[Sequence[tuple[Family, bytes, bytes]]], wal: bool = True
) -> list[float]:
    """Seconds per batch to write `batches` into a fresh database at `path`, one
    `WriteBatch` each (as `RocksStore.put_batch` writes), with the WAL as the bank has it."""
    out: list[float] = []
    with raw_db(path) as (db, _cfs):
        handles = {f: db.get_column_family_handle(f.value) for f in Family}
        wopt: Any = WriteOptions()
        wopt.disable_wal = not wal
        for batch in batches:
            t0 = time.perf_counter()
            wb = WriteBatch(raw_mode=True)
            for f, k, v in batch:
                wb.put(k, v, handles[f])
            db.write(wb, wopt)
            out.append(time.perf_counter() - t0)
        db.flush()
        handles.clear()
    return out


def rocks_value_samples(
    path: str | Path, value_size: int, count: int, repeats: int = 3
) -> dict[str, float]:
    """Raw put and get of `count` random values of `value_size` bytes in the blocks family:
    put, read after a reopen, and warm read (the same values again), in GB/s."""
    rng = np.random.default_rng(2)
    values = [rng.integers(0, 255, value_size, dtype=np.uint8).tobytes() for _ in range(count)]
    keys = [i.to_bytes(8, "big") + b"k" * 24 for i in range(count)]
    total = value_size * count
    put = raw_put_samples(
        path, [[(Family.BLOCKS, k, v) for k, v in zip(keys, values, strict=True)]]
    )
    cold, _ = raw_read_samples(path, {Family.BLOCKS: keys}, repeats)
    with raw_db(path) as (_db, cfs):
        cf = cfs[Family.BLOCKS]
        _ = [cf[k] for k in keys]
        warm = sample(lambda: [cf[k] for k in keys], repeats)
    return {
        "value_bytes": value_size,
        "values": count,
        "put_gbps": gbps(total, put[0]),
        "read_after_reopen_gbps": gbps(total, median(cold)),
        "warm_read_gbps": gbps(total, median(warm)),
    }


# -- the machine's ceilings ------------------------------------------------------------
def machine_ceilings(
    workdir: Path, *, memcpy_bytes: int = 64 * MiB, rocks_mib: int = 64
) -> dict[str, Any]:
    """The machine-wide ceilings: memcpy, XXH3-128, blake3, raw RocksDB at two value sizes."""
    workdir.mkdir(parents=True, exist_ok=True)
    mem = memcpy_samples(memcpy_bytes, 7)
    hashed = max(1, min(memcpy_bytes, 64 * MiB) // MiB) * MiB
    b3 = blake3_samples(hashed, MiB, 5)
    xx = xxh3_samples(hashed, MiB, 5)
    out: dict[str, Any] = {
        "memcpy_bytes": memcpy_bytes,
        "memcpy_gbps": gbps(memcpy_bytes, median(mem)),
        "blake3_gbps": gbps(hashed, median(b3)),
        "xxh3_gbps": gbps(hashed, median(xx)),
        "rocks": [],
    }
    for size in (256 * 1024, MiB):
        count = max(1, rocks_mib * MiB // size)
        out["rocks"].append(rocks_value_samples(workdir / f"raw-{size}", size, count))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the machine's ceilings (tiny sizes with `--quick`)."""
    import tempfile

    p = argparse.ArgumentParser(prog="python -m benchmarks.ceilings", description=main.__doc__)
    p.add_argument("--quick", action="store_true", help="a few MiB only (smoke test)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cas_bank_ceilings_") as tmp:
        if args.quick:
            res = machine_ceilings(Path(tmp), memcpy_bytes=2 * MiB, rocks_mib=2)
        else:
            res = machine_ceilings(Path(tmp))
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
