"""Row runs: the rows of a restore's destination arrays as native runs, where a block's
rows go when payload files are read into them (`row_runs`, the native reader's segments:
`file_read.BlockFiles`), where small payloads kept in RocksDB are copied into them
(`copy_payloads`, from tables kept by the bank: `RunTables`), and a lease's rows copied
into them (`plan_copy`, `copy_planned`).

A view [..., T, D] whose last axis is contiguous and whose token axis steps one row at
a time holds each leading index's rows as one contiguous run. The runs at address 0
depend only on the views' shapes and strides, so they are made once (`_runs_template`,
`contiguous_row_runs`, `_copy_template`) and each restore places them at its arrays'
addresses by one native call (`cas_bank._fill.place`). Without the native helper (or
for views it cannot address this way) there are none: the caller reads or copies with
numpy.

Block rows: a block payload holds each attention array's block slice in C order; the
runs are int64 triples (offset, length, bytes to block i's rows per i).

A lease's rows: a hot restore with room copies the leased prefix once into arrays the
cache owns (`restore.assemble.Assembler.put_arrays`). `np.copyto` does it with plain
stores, which first read every destination line from memory only to overwrite it: the
destination rows are in no cache (a spare made a while ago, a fresh array). The native
helper (`cas_bank._fill.copy_runs`) streams them instead, as it does when it reads
payload files: measured here on two threads, 56 arrays of [1, 4, T, 128] bf16, 59 /
235 / 940 MB, 6.7 / 26.9 / 126 ms with `np.copyto` against 4.9 / 16.7 / 76 ms
streamed. The work is a list of (destination, source, length) runs, one per leading
index of each array; two threads take runs from a shared counter (this one and the
native partner thread, cas_bank/_native/pair.h).
"""

from __future__ import annotations

import array
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from cas_bank.arrays import address_of, lead_offsets
from cas_bank.native import fill_module

_fill = fill_module  # None when not built (or CAS_BANK_PURE_PYTHON=1): no segments
# Templates of views' runs kept by this module's memos (`_runs_template`,
# `_copy_template`), measured with their keys (the views' shapes and strides): 11 /
# 17 KiB an entry for medium-qwen3 (48 runs a block), 97 / 163 KiB for a 7B layout of
# 4-bit KV (1536 runs). A restore of each capacity (mlx-lm's 256-token steps) has its
# own, so 256 kept could hold 66 MiB at that 7B layout; 8 hold at most ~2 MiB. The
# bank keeps the ones its restores use (`restore.assemble._Shapes`, the lease's plans):
# these memos only spare a bank, or a lease, remaking what another made.
_TEMPLATES_KEPT = 8


@dataclass(frozen=True, slots=True, eq=False)
class RowRuns:
    """Native row runs of some views at address 0 (`template`, int64 triples) and how
    many belong to each view (`counts`, int64); and `tables`, where the copy-run tables
    made from them are kept: a bank's (`RunTables`, in its `restore.resources`), or None
    (made for each copy, never kept). The template itself is a memo of shapes (`kept_by`
    adds a bank's tables to it without copying it)."""

    template: np.ndarray
    counts: np.ndarray
    tables: RunTables | None = None

    def kept_by(self, tables: RunTables | None) -> RowRuns:
        """These runs, their copy-run tables kept by `tables`."""
        return RowRuns(self.template, self.counts, tables)


def row_runs(dests: Sequence[np.ndarray], rows: Sequence[int]) -> bytes | None:
    """The destination rows of every block as native int64 triples, in payload order:
    (block 0's address, length, bytes to block i's rows per i), a block of array j
    being `rows[j]` rows; None without the native reader or for views it cannot address
    this way.

    A view [..., T, D] whose last axis is contiguous and whose token axis steps one
    row at a time holds each leading index's block rows as one contiguous run. The
    triples at address 0 depend only on the views' shapes and strides (`_runs_template`,
    made once); each restore adds its arrays' addresses.
    """
    if _fill is None or not dests:
        return None
    key = tuple(
        (d.shape, d.strides, d.itemsize, d.ndim >= 2 and bool(d.flags.writeable)) for d in dests
    )
    made = _runs_template(key, tuple(rows))
    if made is None:
        return None
    return placed(made, np.fromiter(map(address_of, dests), dtype=np.int64, count=len(dests)))


def placed(runs: RowRuns, addresses: np.ndarray) -> bytes:
    """`runs` (a template at address 0, and how many triples each view has) moved to
    each view's address (int64): the native reader's segments (`_fill.place`)."""
    assert _fill is not None  # segments are made only for the native reader
    return cast(bytes, _fill.place(runs.template, runs.counts, addresses, 0))


def contiguous_row_runs(
    shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int], rows: Sequence[int]
) -> RowRuns | None:
    """`row_runs`' template (at address 0) for C-contiguous writable views of
    `shapes` and `itemsizes`, a block of view j being `rows[j]` rows: what a caller
    whose views are always such makes once (`assembler.Assembler`)."""
    key = tuple(
        (tuple(shape), _c_strides(shape, item), item, True)
        for shape, item in zip(shapes, itemsizes, strict=True)
    )
    return _runs_template(key, tuple(rows))


def _c_strides(shape: Sequence[int], item: int) -> tuple[int, ...]:
    """The strides of a C-contiguous array of `shape` and `item` bytes an element."""
    out, step = [], item
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@functools.lru_cache(maxsize=_TEMPLATES_KEPT)
def _runs_template(
    views: tuple[tuple[tuple[int, ...], tuple[int, ...], int, bool], ...], rows: tuple[int, ...]
) -> RowRuns | None:
    """`row_runs`' triples of views of these (shape, strides, itemsize, writable) at
    address 0, and how many belong to each view; None if one cannot be addressed."""
    runs: list[np.ndarray] = []
    for (shape, strides, item, writable), r in zip(views, rows, strict=True):
        if not writable:
            return None
        row = shape[-1] * item
        if strides[-1] != item or strides[-2] != row:
            return None
        runs.append(_runs_pattern(shape[:-2], strides[:-2], r * row))
    template = np.concatenate(runs)
    template.flags.writeable = False
    counts = np.array([len(p) for p in runs], dtype=np.int64)
    counts.flags.writeable = False
    return RowRuns(template, counts)


@functools.lru_cache(maxsize=256)
def _runs_pattern(lead: tuple[int, ...], strides: tuple[int, ...], run: int) -> np.ndarray:
    """`row_runs`' triples for a view at address 0 (read only: callers copy it)."""
    offsets = lead_offsets(lead, strides)
    triples = np.empty((len(offsets), 3), dtype=np.int64)
    triples[:, 0] = offsets
    triples[:, 1] = run
    triples[:, 2] = run
    triples.flags.writeable = False
    return triples


# -- a lease's rows copied in -------------------------------------------------------
_copy_runs = getattr(fill_module, "copy_runs", None) if fill_module is not None else None
_place = getattr(fill_module, "place", None) if fill_module is not None else None

View = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, strides, itemsize)


def available() -> bool:
    """Whether the native copy is built and loaded (`cas_bank.native`)."""
    return _copy_runs is not None


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The runs of one copy from some sources to destinations of some shapes: each run's
    (destination offset, source address, length), the source addresses already placed,
    and how many runs write each destination (`counts`). A lease keeps its plans (one per
    shape of destination): a restore only adds its destinations' addresses."""

    runs: bytes  # int64 triples
    counts: np.ndarray  # how many runs write each destination (int64)


def plan_copy(
    dests: Sequence[np.ndarray],
    sources: Sequence[np.ndarray],
    source_addresses: np.ndarray,
    rows: int,
) -> CopyPlan | None:
    """The plan of copying rows [0, rows) of each of `sources` ([..., T, D]) into rows
    [0, rows) of the destination beside it, from the sources' addresses (each view's
    first element, int64); None when the helper is missing or a view's rows are not
    one contiguous run per leading index (the caller copies with numpy then)."""
    if _copy_runs is None or _place is None or not dests:
        return None
    key = tuple(
        ((d.shape, d.strides, d.itemsize), (s.shape, s.strides, s.itemsize))
        for d, s in zip(dests, sources, strict=True)
    )
    made = _copy_template(key, rows)
    if made is None:
        return None
    template, counts = made
    return CopyPlan(_place(template, counts, source_addresses, 1), counts)


def copy_planned(plan: CopyPlan, dest_addresses: np.ndarray, *, two_threads: bool) -> None:
    """Copy as `plan` says into the destinations at `dest_addresses` (int64, one per
    destination, in the plan's order)."""
    assert _copy_runs is not None and _place is not None  # plans need the helper
    # Two threads: this one and the native partner (cas_bank/_native/pair.h).
    _copy_runs(_place(plan.runs, plan.counts, dest_addresses, 0), two_threads)


@functools.lru_cache(maxsize=_TEMPLATES_KEPT)
def _copy_template(
    views: tuple[tuple[View, View], ...], rows: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The runs of `plan_copy` for views of these (shape, strides, itemsize) at
    address 0, and how many belong to each pair; None if a pair cannot be copied
    this way."""
    parts: list[np.ndarray] = []
    for dest, src in views:
        d_off, d_run = _lead_offsets(dest, rows)
        s_off, s_run = _lead_offsets(src, rows)
        if d_off is None or s_off is None or d_run != s_run or len(d_off) != len(s_off):
            return None
        part = np.empty((len(d_off), 3), dtype=np.int64)
        part[:, 0], part[:, 1], part[:, 2] = d_off, s_off, d_run
        parts.append(part)
    template = np.concatenate(parts)
    template.flags.writeable = False
    return template, np.array([len(p) for p in parts], dtype=np.int64)


def _lead_offsets(view: View, rows: int) -> tuple[np.ndarray | None, int]:
    """Byte offsets of each leading index's rows [0, rows) and their length, or None
    if those rows are not one contiguous run (or fewer than `rows` are there)."""
    shape, strides, item = view
    if len(shape) < 2 or shape[-2] < rows:
        return None, 0
    row = shape[-1] * item
    if strides[-1] != item or (rows > 1 and strides[-2] != row):
        return None, 0
    return lead_offsets(shape[:-2], strides[:-2]), rows * row


# -- payloads in memory copied in ---------------------------------------------------
def copy_payloads(
    segments: bytes,
    body_at: int,
    indices: Sequence[int],
    sources: Sequence[int],
    *,
    two_threads: bool,
    runs: RowRuns | None = None,
    addresses: np.ndarray | None = None,
) -> None:
    """Copy the bodies of plain payloads held in memory into their rows, one native call
    for all: block `indices[j]` (increasing) from the payload whose first byte is at
    `sources[j]`, its body starting `body_at` bytes in and laid out as the native
    reader reads a file's into `segments` (`row_runs`' triples placed at the
    destinations: block i's k-th run goes to address + i * step and takes the body's
    next `length` bytes). The caller holds the payloads until this returns and has
    checked each of them.

    `runs` and `addresses`: the template `segments` was placed from and the views'
    addresses, where the caller has them: the runs are then taken from a table at
    address 0 made once per layout (kept by the bank: `RunTables`) and placed by two
    native calls; a restore of 16 small blocks spent ~0.1 ms in the dozen numpy calls
    of making them (`_payload_runs`, the way without them)."""
    assert _copy_runs is not None  # only with the native helper (`available`)
    work: bytes | np.ndarray
    if runs is not None and addresses is not None and _place is not None:
        work = _placed_payload_runs(runs, addresses, body_at, indices, sources)
    else:
        work = _payload_runs(segments, body_at, indices, sources)
    _copy_runs(work, two_threads)


def _payload_runs(
    segments: bytes, body_at: int, indices: Sequence[int], sources: Sequence[int]
) -> np.ndarray:
    """`copy_payloads`' (destination, source, length) triples, from `segments`."""
    seg = np.frombuffer(segments, dtype=np.int64).reshape(-1, 3)
    lengths = seg[:, 1]
    body_offsets = np.cumsum(lengths) - lengths + body_at
    index = np.array(indices, dtype=np.int64)
    source = np.array(sources, dtype=np.int64)
    out = np.empty((len(index), len(seg), 3), dtype=np.int64)
    np.add(seg[:, 0], np.multiply.outer(index, seg[:, 2]), out=out[..., 0])
    np.add.outer(source, body_offsets, out=out[..., 1])
    out[..., 2] = lengths
    return out


def _placed_payload_runs(
    runs: RowRuns,
    addresses: np.ndarray,
    body_at: int,
    indices: Sequence[int],
    sources: Sequence[int],
) -> bytes:
    """`copy_payloads`' triples from the layout's table at address 0 (`_make_block_runs`):
    the blocks' rows, each view's address added to their destinations and each
    payload's to their sources (`_fill.place`). The tables are `runs.tables`' (the
    bank's), or made for this copy where the runs have none."""
    assert _place is not None
    template, counts, tables = runs.template, runs.counts, runs.tables
    n, first = len(indices), indices[0]
    blocks = _blocks_for(indices[-1] + 1)
    made_of = (template.tobytes(), body_at, blocks)
    table: np.ndarray = _kept(tables, ("blocks", *made_of), lambda: _make_block_runs(*made_of))
    if indices[-1] - first == n - 1:  # a run of blocks: a slice of the table
        rows = table[first : first + n]
    else:
        rows = table[np.array(indices, dtype=np.int64)]
    tiled_of = (counts.tobytes(), n, len(template))
    per_view, per_block = _kept(tables, ("tiled", *tiled_of), lambda: _tiled(*tiled_of))
    at_views = _place(rows, per_view, np.tile(addresses, n), 0)
    return cast(bytes, _place(at_views, per_block, array.array("q", sources), 1))


def _kept(tables: RunTables | None, key: TableKey, make: Callable[[], Any]) -> Any:
    """What `make` makes for `key`, kept by `tables` where there are some."""
    return make() if tables is None else tables.get(key, make)


def _blocks_for(n: int) -> int:
    """The table size made to hold `n` blocks (a power of two from
    64, so that restores of other lengths find it made)."""
    return max(64, 1 << (n - 1).bit_length())


def _make_block_runs(template: bytes, body_at: int, blocks: int) -> np.ndarray:
    """Blocks 0..blocks-1's copy runs at address 0 for views of row runs `template`
    (int64 triples, `row_runs`' at address 0): (offset in its view, offset in the
    payload, length), shaped (blocks, runs, 3); read only."""
    seg = np.frombuffer(template, dtype=np.int64).reshape(-1, 3)
    lengths = seg[:, 1]
    out = np.empty((blocks, len(seg), 3), dtype=np.int64)
    index = np.arange(blocks, dtype=np.int64)
    np.add(seg[:, 0], np.multiply.outer(index, seg[:, 2]), out=out[..., 0])
    out[..., 1] = np.cumsum(lengths) - lengths + body_at
    out[..., 2] = lengths
    out.flags.writeable = False
    return out


def _tiled(counts: bytes, n: int, runs: int) -> tuple[np.ndarray, np.ndarray]:
    """For `n` blocks: how many runs each view has, block after block (`counts` n
    times), and how many each block has (`runs` each); int64, read only."""
    per_view = np.tile(np.frombuffer(counts, dtype=np.int64), n)
    per_block = np.full(n, runs, dtype=np.int64)
    per_view.flags.writeable = per_block.flags.writeable = False
    return per_view, per_block


# A table's kind ("blocks", "tiled"), the template or counts it is made of, two sizes.
TableKey = tuple[str, bytes, int, int]


class RunTables:
    """One bank's copy-run tables of small payloads (`_placed_payload_runs`: a layout's
    runs of blocks 0..2^k-1 at address 0, and their counts tiled for n blocks), the most
    recently used kept within `max_bytes` together (`BankConfig.run_table_bytes`,
    `Bank.stats().run_table_held_bytes` says what they hold): a layout of many runs a block
    (4-bit KV at 16-token blocks: 144) makes 13.5 MiB of table at 4096 blocks, and
    sixteen kept by count held 27 MiB. One over the bound is made for its copy and
    not kept; 0 keeps none. Thread-safe; `clear` (the bank's close) releases them.

    A bound of their own, not `hot_bytes`: a table is a layout's, used by every restore
    of small payloads of it, where the hot tier and the leases hold prompts; charged
    there, it would go with the least recently used prompt and `hot_bytes=0` (the tools,
    a reopened bank's cold reads) would make every restore remake it."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"run table bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[TableKey, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: TableKey, make: Callable[[], Any]) -> Any:
        """The table of `key`, made by `make` (arrays, or a tuple of them) the first
        time and kept while it fits (two threads at once may both make it: either is
        right)."""
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found[0]
        made = make()
        arrays = made if isinstance(made, tuple) else (made,)
        size = len(key[1]) + sum(int(a.nbytes) for a in arrays)
        if size > self.max_bytes:
            return made
        with self._lock:
            old = self._kept.pop(key, None)
            self._bytes += size - (old[1] if old is not None else 0)
            self._kept[key] = (made, size)
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self._bytes -= dropped
        return made

    @property
    def bytes(self) -> int:
        """Bytes the tables kept hold now (their keys' template bytes too)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        """Release every table."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0
