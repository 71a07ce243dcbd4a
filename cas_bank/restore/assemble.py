"""A restore's destination arrays, assembled: decoded blocks, payload files and a lease
copied into fresh MLX arrays (`Assembler`), with room for the prompt's later tokens.

What an `Assembler` of one spec, block size and capacity allocates and checks is made
once (`_Shapes`, kept by the bank's `Resources`). Its arrays come from a lease's copy
made ahead (`restore.lease_copy`), else from the spares the bank keeps (`cas_bank.restore.spares`),
else fresh and unfilled (`destinations.Destination.allocate`); blocks are copied in as they
are decoded, payload files read straight into them (`restore.file_read`), a lease by the
native row copy (`restore.row_runs`). All of that is the bank's (`cas_bank.restore.resources`),
handed in: nothing here is kept per process.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import mlx.core as mx
import numpy as np

from cas_bank.arrays import DType, HeldArrays, cpu_fillable, dtype_named, to_numpy
from cas_bank.blocks.codec import Decoded
from cas_bank.errors import CorruptDataError
from cas_bank.restore import lease_copy, row_runs
from cas_bank.restore.destinations import Destination, addresses_of
from cas_bank.restore.file_read import BlockFiles, Layout, layout_of
from cas_bank.restore.resources import Resources
from cas_bank.restore.row_runs import RowRuns, RunTables, contiguous_row_runs
from cas_bank.restore.spares import Filled, SpareSet, spare_set
from cas_bank.spec import ArraySpec, ModelSpec, group_layers

# A destination's field, read by a C-level map (a restore's every array at once).
_FILLABLE = attrgetter("fillable")
_TWO_THREADS_FROM = 4 << 20  # bytes to copy; below, a helper's half costs more than it saves


@dataclass(frozen=True, slots=True)
class _Shapes:
    """What an `Assembler` of one spec, block size, capacity and state allocates and
    checks: the same few each restore of a model asks for (capacities are rounded up
    to mlx-lm's step), made once. Rebuilding these lists per restore cost ~0.1 ms of a
    hybrid model's 48 arrays."""

    capacity: int
    specs: tuple[ArraySpec, ...]
    dtypes: tuple[DType, ...]
    state_shapes: tuple[tuple[int, ...], ...]
    state_dtypes: tuple[DType, ...]
    wanted: tuple[tuple[tuple[int, ...], DType], ...]  # attention arrays, then states
    sizes: tuple[int, ...]  # bytes of each of `wanted`
    attention_bytes: int  # bytes of the attention arrays of `wanted` (a lease's copy)
    block_shapes: tuple[tuple[int, ...], ...]
    fits: tuple[tuple[tuple[int, ...], np.dtype[np.generic]], ...]  # a block's (shape, dtype)
    spares: SpareSet  # `wanted` grouped for the spares' pool
    row_runs: RowRuns | None  # the attention destinations' block rows (`BlockFiles`)
    state_runs: RowRuns | None  # the state destinations' rows, one block of them
    block_layout: Layout  # a block payload's (`BlockFiles`)
    state_layout: Layout | None  # a state payload's, when the states are allocated
    serial: int  # this instance's own number (never reused): a key for what it fixes


_SERIALS = itertools.count()


def _shapes(
    resources: Resources | None, spec: ModelSpec, block_size: int, capacity: int, state: bool
) -> _Shapes:
    """`_Shapes` of `spec`, kept by the bank's resources by its fingerprint (which fixes
    its layers: a bank reopened, with a spec of its own, finds them too), or made now
    where there are none."""
    if resources is None:
        return _make_shapes(spec, block_size, capacity, state, None)
    key = (spec.fingerprint, block_size, capacity, state)
    tables = resources.run_tables
    made: _Shapes = resources.shapes.get(
        key, lambda: _make_shapes(spec, block_size, capacity, state, tables)
    )
    return made


def prime_shapes(
    resources: Resources, spec: ModelSpec, block_size: int, capacities: Sequence[int]
) -> None:
    """Make the `_Shapes` of restores of `spec` into each of `capacities` tokens now
    (with and without a boundary state, for a hybrid model), kept by `resources`: a
    reopened bank's first restore then finds them (`cas_bank.bank`; making them cost
    that restore's allocation 0.21 against 0.06 ms at medium-qwen3 1k tokens)."""
    for capacity in capacities:
        for state in (False, True) if spec.is_hybrid else (False,):
            _shapes(resources, spec, block_size, capacity, state)


def _make_shapes(
    spec: ModelSpec, block_size: int, capacity: int, state: bool, tables: RunTables | None
) -> _Shapes:
    """`_Shapes` of these; their row runs' copy-run tables kept by `tables` (the bank's)."""
    specs = spec.block_arrays
    dtypes = tuple(dtype_named(s.dtype) for s in specs)
    state_specs = spec.state_arrays
    state_shapes = tuple(s.shape for s in state_specs) if state else ()
    state_dtypes = tuple(dtype_named(s.dtype) for s in state_specs) if state else ()
    wanted = (
        *((s.with_tokens(capacity), d) for s, d in zip(specs, dtypes, strict=True)),
        *zip(state_shapes, state_dtypes, strict=True),
    )
    block_shapes = tuple(s.with_tokens(block_size) for s in specs)
    block_runs = contiguous_row_runs(
        [shape for shape, _ in wanted[: len(specs)]],
        [d.itemsize for d in dtypes],
        [block_size] * len(specs),
    )
    state_runs = (
        contiguous_row_runs(
            state_shapes, [d.itemsize for d in state_dtypes], [s[-2] for s in state_shapes]
        )
        if state_shapes and all(len(s) >= 2 for s in state_shapes)
        else None
    )
    block_runs = block_runs.kept_by(tables) if block_runs is not None else None
    state_runs = state_runs.kept_by(tables) if state_runs is not None else None
    sizes = tuple(math.prod(shape) * d.itemsize for shape, d in wanted)
    return _Shapes(
        capacity,
        specs,
        dtypes,
        state_shapes,
        state_dtypes,
        wanted,
        sizes,
        sum(sizes[: len(specs)]),
        block_shapes,
        tuple((shape, d.storage) for shape, d in zip(block_shapes, dtypes, strict=True)),
        spare_set(wanted),
        block_runs,
        state_runs,
        layout_of(block_shapes, dtypes),
        layout_of(state_shapes, state_dtypes) if state_shapes else None,
        next(_SERIALS),
    )


class Assembler:
    """Copies decoded blocks straight into fresh MLX arrays (one copy per block).

    A block put `later` (one already in memory, from the hot tier) is copied when the
    arrays are handed out, on two threads when there is enough to copy: one core
    alone does not reach the memory bandwidth, and `np.copyto` releases the GIL.
    """

    def __init__(
        self,
        spec: ModelSpec,
        n_blocks: int,
        block_size: int,
        capacity: int = 0,
        *,
        state: bool = False,
        lease: HeldArrays | None = None,
        resources: Resources | None = None,
    ) -> None:
        """Arrays for `n_blocks` blocks, with room for `capacity` tokens if that is more
        (the cache's later tokens then land in place: no copy of the restored ones),
        and (`state`) for a recurrent state read from its payload file. `lease`: the
        arrays all `n_blocks` blocks come from (`put_arrays`), when they do: their copy
        may be made already (`restore.lease_copy`). `resources`: the bank's spares, shape
        memo, scratch buffers and GPU prefetch (None: none of them)."""
        self.spec = spec
        self.block_size = block_size
        self._resources = resources
        rows = n_blocks * block_size
        shapes = _shapes(resources, spec, block_size, max(rows, capacity), state)
        self._keep_shapes(shapes)
        # Every token a restore hands out is written by a block, every state byte by its
        # payload: no zero fill needed. One allocation for all of them, less the spares
        # the bank keeps ready (`cas_bank.restore.spares`).
        # Staged destinations (`arrays.cpu_fillable`: a GPU backend not known, or
        # CAS_BANK_FILL_COPY) take no MLX memory.
        self._spared = cpu_fillable() and resources is not None
        # A lease's copy made ahead (`restore.lease_copy`), else spares, else new arrays.
        self._from_lease = lease if self._spared and not state and row_runs.available() else None
        ahead = self._copied_ahead(rows)
        everything = ahead if ahead is not None else self._allocate(shapes.sizes)
        n_arrays = len(self.specs)
        self.dests = everything[:n_arrays]
        self._state_dests = everything[n_arrays:]
        self._views = [d.view for d in self.dests]
        self._addresses: np.ndarray | None = None
        # Whether payload files may be read into the views: MLX's own memory, or the
        # staging buffers of a device a CPU pointer cannot fill (`arrays.cpu_fillable`).
        self.direct = all(map(_FILLABLE, self.dests))
        self._later: list[tuple[int, list[np.ndarray]]] = []  # (first token, arrays)
        self._later_bytes = 0
        self._lease: tuple[HeldArrays, int] | None = None  # copied natively (restore.row_runs)
        self._ahead_rows = 0 if ahead is None else rows  # rows made already
        self._handed: int | None = None  # the blocks `layers` handed out

    def _keep_shapes(self, shapes: _Shapes) -> None:
        """What `shapes` fixes, on this assembler: capacity, specs, dtypes, the arrays
        wanted, the spares' grouping, the row runs and payload layouts, the block checks."""
        self.capacity = shapes.capacity
        self.specs, self.dtypes = shapes.specs, shapes.dtypes
        self.state_shapes, self.state_dtypes = shapes.state_shapes, shapes.state_dtypes
        self._wanted = shapes.wanted
        self._spare_set = shapes.spares
        self._serial = shapes.serial
        self._attention_bytes = shapes.attention_bytes
        self._row_runs = shapes.row_runs
        self._state_runs = shapes.state_runs
        self._block_layout, self._state_layout = shapes.block_layout, shapes.state_layout
        # What each array of a block must be, checked before its copy.
        self.block_shapes = shapes.block_shapes
        self._fits = shapes.fits

    def _allocate(self, sizes: tuple[int, ...]) -> list[Destination]:
        """Destinations of every wanted array: the bank's spares where it keeps them
        (already written), the rest new and unfilled."""
        resources = self._resources
        spares = resources.spares if resources is not None and self._spared else None
        ready = spares.take(self._spare_set) if spares is not None else {}  # all written
        return Destination.allocate(self._wanted, overwritten=True, ready=ready, sizes=sizes)

    def _copied_ahead(self, rows: int) -> list[Destination] | None:
        """The lease's first `rows` rows in destinations made ahead, if they are."""
        lease, resources = self._from_lease, self._resources
        if lease is None or not rows or resources is None:
            return None
        return lease_copy.take_ahead(resources.spares, lease, self._serial, rows)

    def put(self, index: int, block: Decoded, *, later: bool = False) -> None:
        """Check `block` against the spec (`CorruptDataError` if it does not fit) and
        copy it in as block `index`, now or (`later`) when `layers` is called."""
        arrays = block.arrays
        if len(arrays) != len(self._views):
            raise CorruptDataError(f"block holds {len(arrays)} arrays, expected {len(self._views)}")
        for src, (shape, dtype) in zip(arrays, self._fits, strict=True):
            if src.shape != shape or src.dtype != dtype:
                raise CorruptDataError(f"block array of shape {src.shape} does not fit the spec")
        start = index * self.block_size
        if later:
            self._later.append((start, arrays))
            self._later_bytes += sum(a.nbytes for a in arrays)
        else:
            self._copy([(start, arrays)], 0, len(self._views))

    def _copy(self, runs: list[tuple[int, list[np.ndarray]]], lo: int, hi: int) -> None:
        """Copy arrays lo..hi-1 of each (first token, arrays) of `runs` into place."""
        views = self._views[lo:hi]
        for start, arrays in runs:
            for src, view in zip(arrays[lo:hi], views, strict=True):
                np.copyto(view[..., start : start + src.shape[-2], :], src)

    def _copy_later(self, n_blocks: int) -> None:
        if self._lease is not None:
            self._copy_lease(*self._lease)
            self._lease = None
        end = n_blocks * self.block_size
        blocks = [b for b in self._later if b[0] < end]
        n = len(self._views)
        self._later, later_bytes, self._later_bytes = [], self._later_bytes, 0
        if later_bytes < _TWO_THREADS_FROM or n < 2:
            self._copy(blocks, 0, n)
            return
        arrays = itertools.count()  # shared: each thread takes the next array to copy

        def copy_arrays() -> None:
            while (j := next(arrays)) < n:
                self._copy(blocks, j, j + 1)

        if self._resources is None:
            copy_arrays()
        else:  # on this thread and the bank's helper (`restore.workers`)
            self._resources.workers.together(copy_arrays)

    def _copy_lease(self, arrays: HeldArrays, rows: int) -> None:
        """A lease's first `rows` rows into place by the native copy (streamed stores,
        `restore.row_runs`, planned once per lease: `restore.lease_copy`), or by numpy where
        it cannot."""
        plan, nbytes = lease_copy.plan(arrays, self._serial, self._views, rows)
        if plan is not None:
            two = nbytes >= _TWO_THREADS_FROM and len(arrays) > 1
            row_runs.copy_planned(plan, self.addresses(), two_threads=two)
            return
        self._later.append((0, [v[..., :rows, :] for v in arrays.numpy_views()]))
        self._later_bytes += nbytes

    def put_arrays(self, arrays: Sequence[mx.array], n_blocks: int) -> None:
        """Copy blocks 0..n_blocks-1 from MLX arrays (a lease) into place, when handed
        out: one copy per array (on two threads, by `_copy_later`), a lease's by the
        native copy where it is built."""
        n = n_blocks * self.block_size
        if arrays is self._from_lease and n <= self._ahead_rows:
            return  # copied ahead: these destinations hold them already
        if isinstance(arrays, HeldArrays) and row_runs.available() and self._lease is None:
            self._lease = (arrays, n)
            return
        whole = arrays.numpy_views() if isinstance(arrays, HeldArrays) else map(to_numpy, arrays)
        views = [v[..., :n, :] for v in whole]
        self._later.append((0, views))
        self._later_bytes += sum(int(v.nbytes) for v in views)

    def handed_out(self) -> None:
        """Once this restore's arrays are evaluated: on CUDA, move them to the GPU
        (`resources.GpuPrefetch`: the CPU filled them in unified memory); then have the next
        restore's arrays made off its path (`cas_bank.restore.spares`; a runtime's restore
        holds them until its forward pass is done, `Spares.holding`)."""
        resources = self._resources
        if resources is None or not self._spared:
            return
        prefetch = resources.gpu.prefetcher()
        if prefetch is not None:
            prefetch(self._runs())
        if self._handed is not None:
            resources.spares.refill(self._spare_set, filled=self._ask_ahead(self._handed))
            self._handed = None

    def _runs(self) -> list[tuple[int, int]]:
        """(address, bytes) of every destination that is an MLX array's own memory (not
        a staging buffer), the state ones too."""
        dests = [*self.dests, *self._state_dests]
        return [(d.address, int(d.view.nbytes)) for d in dests if d.direct]

    def _ask_ahead(self, n_blocks: int) -> Filled | None:
        """The copy of this restore's lease to make ahead for the next (`lease_copy`)."""
        lease, resources = self._from_lease, self._resources
        if lease is None or resources is None:
            return None
        attention = self._wanted[: len(self.specs)]
        rows = n_blocks * self.block_size
        return lease_copy.ask_ahead(
            resources.spares,
            lease,
            self._serial,
            rows,
            attention,
            self._attention_bytes,
            self._views,
        )

    def block_files(self) -> BlockFiles:
        """A reader of block payload files into these arrays (`direct` only)."""
        return BlockFiles(
            self._views,
            self.block_shapes,
            self.dtypes,
            self.block_size,
            runs=self._row_runs,
            addresses=self.addresses(),
            layout=self._block_layout,
            scratch=self._scratch(),
        )

    def addresses(self) -> np.ndarray:
        """Each destination view's address (int64), found once (spares found theirs
        ahead): the native reader's and the lease copy's."""
        if self._addresses is None:
            dests = self.dests
            self._addresses = addresses_of(dests)
        return self._addresses

    def state_files(self) -> BlockFiles | None:
        """A reader of a state payload file into this restore's state arrays (block 0 of
        arrays of the state's shapes); None if they were not allocated or are not
        CPU memory a read may fill."""
        dests = self._state_dests
        if not dests or not all(map(_FILLABLE, dests)):
            return None
        addresses = addresses_of(dests)
        return BlockFiles(
            [d.view for d in dests],
            self.state_shapes,
            self.state_dtypes,
            runs=self._state_runs,
            addresses=addresses,
            layout=self._state_layout,
            scratch=self._scratch(),
        )

    def _scratch(self) -> threading.local | None:
        """The bank's reading threads' reused buffers (`restore.file_read`), where it has them."""
        return self._resources.scratch if self._resources is not None else None

    def state_arrays(self) -> list[mx.array]:
        """The state arrays (call once `state_files` read a payload and it verified)."""
        return _finished(self._state_dests)

    def put_tail(self, start: int, arrays: Sequence[np.ndarray]) -> None:
        """Copy an end record's tail (`index.ends`, checked against the spec by its
        decoder) in at token `start`; the capacity must hold it."""
        for src, view in zip(arrays, self._views, strict=True):
            t = src.shape[-2]
            np.copyto(view[..., start : start + t, :], src)

    def layers(
        self, n_blocks: int, *, room: bool = False, tokens: int | None = None
    ) -> list[tuple[Any, ...] | None]:
        """Per-layer arrays holding the first `n_blocks` blocks, aligned with spec.layers:
        exactly that many tokens (or `tokens`, when a tail was put after them), or
        (`room`) the whole capacity, whose first tokens are the blocks and the rest
        undefined."""
        self._copy_later(n_blocks)
        n = n_blocks * self.block_size if tokens is None else tokens
        arrays = _finished(self.dests)
        self._handed = n_blocks
        if arrays and arrays[0].shape[-2] != n and not (room and n):
            arrays = [a[..., :n, :] for a in arrays]
        return group_layers(self.spec, arrays, None)


def _finished(dests: Sequence[Destination]) -> list[mx.array]:
    """Each destination's array to hand out (`Destination.finish`), called only for a
    staged one: a method call an array was ~1 us of a cold restore."""
    return [a if (a := d.array) is not None else d.finish() for d in dests]
