"""A lease copied into a restore's destination arrays by the native helper.

A hot restore with room copies the leased prefix once into arrays the cache owns
(`restore.assemble.Assembler.put_arrays`). `np.copyto` does it with plain stores, which
first read every destination line from memory only to overwrite it: the destination
rows are in no cache (a spare made a while ago, a fresh array). The native helper
(`cas_bank._fill.copy_runs`) streams them instead, as it does when it reads payload
files: measured here on two threads, 56 arrays of [1, 4, T, 128] bf16, 59 / 235 /
940 MB, 6.7 / 26.9 / 126 ms with `np.copyto` against 4.9 / 16.7 / 76 ms streamed.

The work is a list of (destination, source, length) runs, one per leading index of
each array (a view [..., T, D] whose rows are contiguous holds each leading index's
first n rows as one run); two threads take runs from a shared counter (this one and
the native partner thread, cas_bank/_native/pair.h). Without the helper (or for views
it cannot address this way) the caller copies with numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cas_bank.arrays import lead_offsets
from cas_bank.native import fill_module

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
    made = _template(key, rows)
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


@functools.lru_cache(maxsize=256)
def _template(
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
