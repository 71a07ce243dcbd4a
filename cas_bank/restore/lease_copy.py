"""A lease copied into a restore's arrays with room: planned once, and copied ahead.

A hot restore with room (`restore.assemble.Assembler`) copies the leased prefix into arrays
its cache owns: mlx-lm writes the next tokens in place after it, so two caches never
share a buffer. The copy is most of such a restore (a 1k-token medium-qwen3 prefix,
25 MB: ~1.4 ms of ~2.2). Two things keep the rest of it small:

- The native copy's plan (`restore.row_runs.plan_copy`: one run per leading index, the
  lease's addresses placed) depends only on the lease and the destinations' shapes,
  so the lease keeps it (`HeldArrays.memo`), one per destination shapes and rows.
- A lease restored with room a second time is likely restored again (a system prompt
  many agents share): after such a restore, the thread of the bank's spares
  (`cas_bank.restore.spares`, in its `Resources`) makes the next restore's arrays and copies
  the prefix into them, off the path, as it makes plain spares. The next restore of
  the same lease, shapes and rows takes them whole (`take_ahead`) and copies
  nothing. The arrays are the spares' (within their bound; the two most recent
  leases only), a copy of arrays nobody updates in place, so they hold exactly what
  the lease holds; taken once, never shared. A lease restored once (a
  conversation's history, restored for its next turn) is never copied ahead: that
  copy would be bandwidth spent for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cas_bank.arrays import HeldArrays
from cas_bank.restore import row_runs
from cas_bank.restore.destinations import Destination, addresses_of
from cas_bank.restore.spares import Filled, Spares, Wanted

_PLANS_KEPT = 8  # plans a lease keeps (one per destination shapes it is restored into)
_AHEAD_FROM_USE = 2  # the restore with room of a lease from which its copy is made ahead


def plan(
    arrays: HeldArrays, serial: int, views: Sequence[np.ndarray], rows: int
) -> tuple[row_runs.CopyPlan | None, int]:
    """The native copy's plan of `arrays`' first `rows` rows into destinations like
    `views` (their shapes and strides fixed by the `_Shapes` whose `serial` this is),
    and the bytes it copies; kept by the lease (a 24-array plan cost a restore ~0.1 ms).
    No plan (None) where the native copy cannot address the views."""
    key = ("plan", serial, rows)
    found: tuple[row_runs.CopyPlan | None, int] | None = arrays.memo.get(key)
    if found is None:
        sources = arrays.numpy_views()
        nbytes = sum(v.nbytes // v.shape[-2] * rows for v in sources)  # no slice each
        made = row_runs.plan_copy(views, sources, arrays.addresses(), rows)
        if len(arrays.memo) >= 2 * _PLANS_KEPT:
            arrays.memo.clear()
        found = arrays.memo[key] = (made, nbytes)
    return found


def take_ahead(
    spares: Spares, arrays: HeldArrays, serial: int, rows: int
) -> list[Destination] | None:
    """Destinations holding `arrays`' first `rows` rows, copied ahead into `spares`
    after an earlier restore (`ask_ahead`); None if there are none (or copies ahead are
    off: `Spares.copy_ahead`)."""
    if not spares.copy_ahead:
        return None
    return spares.take_filled(("lease", arrays.serial, serial, rows))


def ask_ahead(
    spares: Spares,
    arrays: HeldArrays,
    serial: int,
    rows: int,
    wanted: Sequence[Wanted],
    nbytes: int,
    views: Sequence[np.ndarray],
) -> Filled | None:
    """What to have the thread of `spares` make after this restore of `arrays` into
    destinations of `wanted` (shapes, dtypes; `nbytes` in all: `views` are this
    restore's own): from the lease's second restore with room into these shapes, its
    copy made ahead. None before then, or where the native copy is not there."""
    uses_key = ("uses", serial, rows)
    uses = arrays.memo.get(uses_key, 0) + 1
    arrays.memo[uses_key] = uses
    if uses < _AHEAD_FROM_USE or not spares.copy_ahead:
        return None
    copy, _ = plan(arrays, serial, views, rows)
    if copy is None:
        return None

    def fill(dests: list[Destination]) -> None:
        assert arrays  # held until copied: the plan holds their addresses, not them
        addresses = addresses_of(dests)
        row_runs.copy_planned(copy, addresses, two_threads=False)

    return Filled(("lease", arrays.serial, serial, rows), tuple(wanted), fill, nbytes)
