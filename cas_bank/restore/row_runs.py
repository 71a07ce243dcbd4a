"""Where a block's rows go in a restore's destination arrays: the native reader's
segments (`cas_bank._fill`, `fastread.BlockFiles`).

A block payload holds each attention array's block slice in C order; in a destination
view [..., T, D] whose last axis is contiguous and whose token axis steps one row at a
time, each leading index's block rows are one contiguous run. The runs at address 0
(int64 triples: offset, length, bytes to block i's rows per i) depend only on the
views' shapes and strides, so they are made once (`contiguous_row_runs`,
`_runs_template`) and each restore places them at its arrays' addresses by one
native call (`placed`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeAlias, cast

import numpy as np

from cas_bank.arrays import address_of, lead_offsets
from cas_bank.native import fill_module

# Native row runs at address 0 (int64 triples) and how many belong to each view.
RowRuns: TypeAlias = tuple[np.ndarray, np.ndarray]

_fill = fill_module  # None when not built (or CAS_BANK_PURE_PYTHON=1): no segments


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
    template, counts = runs
    return cast(bytes, _fill.place(template, counts, addresses, 0))


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


@functools.lru_cache(maxsize=256)
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
    return template, counts


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
