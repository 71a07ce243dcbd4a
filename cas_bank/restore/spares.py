"""Spare destination arrays: a bank's next restore finds its arrays ready.

A restore's destination arrays are fresh MLX arrays left unfilled (`destinations.unfilled`:
MLX's load of a stream that serves only a header), and making them costs ~50-110 us
an array (the load evaluates each array through its I/O thread): ~2 ms for the 24-48
arrays of a medium model, a fifth of a 1k-token restore (docs/design.md, "Restore
path"); and their pages are fresh, so the restore that fills them faults every 4 KiB
in. A bank restores caches of the same shapes again and again (the same layers, token
counts rounded up to mlx-lm's step of 256), so every restore takes what it can from
a pool of spare arrays of exactly its shapes and dtypes, and a background thread
makes the next set after it, off the restore's path. An array is taken from the pool
whole and never given to two callers: a spare is an array nobody else holds, as a
fresh one is. Each bank has its own pool (`cas_bank.restore.resources.Resources`, made by
`Bank.open`, bounded by `BankConfig.spare_bytes`), its thread started by the first
refill and joined by `close`.

The background thread zero-fills its arrays (`destinations.zeroed`), never MLX's load of a
stream (`destinations.unfilled`): that load calls back into Python from MLX's I/O thread,
and with another thread in `mx.clear_cache()` (mlx-lm calls it during prefill; it
holds the GIL while it waits for every CPU stream) the two deadlock: it hung mlx-lm's
server (tests/test_spares.py). The fill costs the background thread a pass over the
memory; it leaves the pages resident, so the restore that takes them does not fault
them in.

A set may also be asked for filled (`Filled`: a lease restored again, copied ahead by
`restore.lease_copy`): the thread makes it as it makes spares, then writes it (the
lease's rows, by the native copy), and the next restore of that lease takes it whole
by its key (`take_filled`). At most two such sets are kept, each at most half the
bound, and they are dropped before plain spares.

Bounded by `max_bytes`: the pool keeps at most one restore's set per shape and drops
the least recently wanted shapes first. The memory is held (resident once reused)
until `close`, which stops a making under way at its next array.

A bank reopened starts with none, and its first restore would allocate every array and
fault its fresh pages in: 1.7 of 18.6 ms allocating and a fill 8 ms slower than the
same read into pages in memory, at 100 MB of fp32 KV (`benchmarks.library_restore`'s
layout). So the pool remembers the shapes refills asked for (`wanted_recently`: what a
full pool holds, within the bound), the bank keeps them in its meta at `close`, and
its next open has them made (`make_ahead`) in the background from the open on, before
its first restore (`cas_bank.bank`; tools open banks without spares): that restore then
took 9.4 ms (the file 9.1).

A runtime's restore is followed by its forward pass, the time to first token, and a
refill made beside it (a zero fill and a lease's copy of 100-400 MB) slows that pass
(memory bandwidth, the last-level cache) by more than the copy would cost on the
restore's path. So a caller may restore `holding()` its refill and `release` it once
its pass is done (`PrefixCache.restore` and `PrefixCache.prefill` do): the thread
waits before it starts a held refill until released, or `hold_s` at most (a caller
that never says it is done still gets its spares). A refill not held (a restore
made without `holding`) releases those before it, so it never waits behind them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from cas_bank.arrays import DType, dtype_named
from cas_bank.errors import InvalidInputError
from cas_bank.restore.destinations import Destination, zeroed

log = logging.getLogger("cas_bank")

Wanted = tuple[tuple[int, ...], DType]


class Spares:
    """Spare destination arrays by (shape, dtype), at most `max_bytes` of them (0: none,
    and no thread); `copy_ahead`: leases restored again are copied ahead
    (`restore.lease_copy`). `close` stops the thread and drops what the pool holds."""

    def __init__(self, max_bytes: int = 0, *, copy_ahead: bool = True) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.copy_ahead = copy_ahead
        self.bytes = 0
        self.taken = 0  # arrays handed out from the pool
        self.made = 0  # arrays the background thread made
        self._lock = threading.Lock()
        self._pool: OrderedDict[Wanted, list[Destination]] = OrderedDict()
        self._filled: OrderedDict[Hashable, list[Destination]] = OrderedDict()
        self._filled_bytes: dict[Hashable, int] = {}
        self.filled_taken = 0  # sets handed out filled (`take_filled`)
        # One refill pending at most; None (from `close`) ends the thread.
        self._wants: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self.hold_s = HOLD_S  # the longest a held refill waits for `release`
        self.held = 0  # refills that waited for a release (or `hold_s`) to start
        self._released = threading.Event()
        self._released.set()
        self._holding = threading.local()  # a restore in `holding()` on this thread
        self._closed = False
        # The shapes refills asked for and how many of each, least recent first, within
        # the bound: what the pool would hold (`wanted_recently`, `make_ahead`).
        self._recent: OrderedDict[Wanted, int] = OrderedDict()
        self._recent_bytes = 0
        self._restoring = False  # a restore took from the pool: `make_ahead` stops

    def enable(self, max_bytes: int) -> None:
        """Change the bound (0: off; what the pool holds over it is dropped now)."""
        with self._lock:
            self.max_bytes = max_bytes
            self._trim()

    def _start(self) -> None:
        """Start the thread, at the first refill (lock held): a bank that never restores
        has none."""
        self._thread = threading.Thread(target=self._run, name="cas_bank-spares", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    def close(self) -> None:
        """Stop: refills asked for from now on are dropped, the one under way finishes,
        the thread is joined and the pool's arrays released. Idempotent."""
        with self._lock:
            self.max_bytes = 0
            self._closed = True
            thread, self._thread = self._thread, None
        self.release()
        if thread is not None:
            atexit.unregister(self._at_exit)
            self._wants.put(None)  # after what is queued: the thread ends there
            thread.join()
        with self._lock:
            self._trim()

    def take(
        self, wanted: Sequence[Wanted] | SpareSet, from_bytes: int = 0
    ) -> dict[int, Destination]:
        """Spares for the entries of `wanted` of at least `from_bytes` bytes, by index
        (those the pool holds), as destinations made ahead (`Destination`: the array
        and its numpy view; making those took a restore ~13 us an array, 0.75 ms of a
        56-array restore). `refill` with the same set once the restore is done.
        `wanted` may come grouped already (`spare_set`, made once per set of shapes:
        the pool is then asked once per distinct shape, not hashed per array)."""
        if self.max_bytes <= 0:
            return {}
        # A refill still being made (the last restore was a moment ago) is not waited
        # for: what it has not made yet this restore allocates itself, as without
        # spares, beside it (its zero fill runs in MLX without the GIL). Waiting for it
        # made back-to-back restores pay the whole fill: 8.8 against 6.6 ms at 25 MB.
        grouped = wanted if isinstance(wanted, SpareSet) else spare_set(wanted, from_bytes)
        out: dict[int, Destination] = {}
        self._restoring = True
        with self._lock:
            for w, indices, size in grouped.groups:
                free = self._pool.get(w)
                for i in indices:
                    if not free:
                        break
                    out[i] = free.pop()
                    self.bytes -= size
                    self.taken += 1
        return out

    def take_filled(self, key: Hashable) -> list[Destination] | None:
        """The set made ahead and filled under `key` (`refill`'s `filled`), once; None
        if there is none (not asked for, not made yet, or dropped for room)."""
        if self.max_bytes <= 0:
            return None
        self._restoring = True
        with self._lock:
            got = self._filled.pop(key, None)
            if got is not None:
                self.bytes -= self._filled_bytes.pop(key)
                self.filled_taken += 1
        return got

    def refill(
        self,
        wanted: Sequence[Wanted] | SpareSet,
        from_bytes: int = 0,
        *,
        filled: Filled | None = None,
    ) -> None:
        """Have the background thread make spares of `wanted` (its entries of at least
        `from_bytes` bytes) for the next restore: called after a restore handed its
        arrays out, so the making never competes with a restore's own reads. With
        `filled`, also a set of its own that its `fill` writes (`take_filled`)."""
        grouped = wanted if isinstance(wanted, SpareSet) else spare_set(wanted, from_bytes)
        if self.max_bytes <= 0:
            return
        plain = grouped.flat if grouped.flat and grouped.nbytes <= self.max_bytes else ()
        if filled is not None and filled.nbytes > self.max_bytes // 2:
            filled = None  # a set made ahead never takes more than half the bound
        if not plain and filled is None:
            return
        held = getattr(self._holding, "on", False)
        if not held:
            self._released.set()  # a refill held before this one waits no longer
        self._ask(grouped, _Job(plain, filled, held))

    def _ask(self, grouped: SpareSet, job: _Job) -> None:
        """Queue `job` (of `grouped`'s shapes) for the thread, started if need be."""
        with self._lock:
            if self._closed or self.max_bytes <= 0:
                return
            if job.plain:
                self._note(grouped)
            if self._thread is None:
                self._start()
            with contextlib.suppress(queue.Full):  # one pending: it is made first
                self._wants.put_nowait(job)

    def _note(self, grouped: SpareSet) -> None:
        """`grouped`'s shapes and counts, the most recently wanted now (lock held); the
        least recent dropped while they take more than the bound."""
        recent = self._recent
        for w, indices, size in grouped.groups:
            self._recent_bytes += (len(indices) - recent.pop(w, 0)) * size
            recent[w] = len(indices)
        while self._recent_bytes > self.max_bytes and recent:
            w, n = recent.popitem(last=False)
            self._recent_bytes -= n * _size(w)

    def wanted_recently(self) -> list[tuple[Wanted, int]]:
        """The (shape, dtype)s refills asked for and how many of each, least recent
        first, at most the bound in all: what a full pool holds (`encode_wanted`)."""
        with self._lock:
            return list(self._recent.items())

    def make_ahead(self, recorded: Sequence[tuple[Wanted, int]]) -> int:
        """Have the thread make `recorded` (`wanted_recently` of an earlier session:
        `cas_bank.bank` keeps it in the bank's meta), before any restore asks: the most
        recent entries that fit the bound, least recent first. The making stops at its
        next array once a restore takes from the pool (that restore allocates what is
        not made yet: zero-filling beside it slowed a restore made right after the
        open from 33 to 48 ms at 100 MB). Returns the bytes asked for (0: none
        recorded, none fits, spares are off, or a restore began already)."""
        fits: list[tuple[Wanted, int]] = []
        room = self.max_bytes
        for w, n in reversed(recorded):
            if 0 < n * _size(w) <= room:
                fits.append((w, n))
                room -= n * _size(w)
        if not fits or self._restoring:
            return 0
        grouped = spare_set([w for w, n in reversed(fits) for _ in range(n)])
        self._ask(grouped, _Job(grouped.flat, None, held=False, ahead=True))
        return grouped.nbytes

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Around a restore that the caller's forward pass follows: the refill the
        restore asks for (on this thread) waits until `release` (at most `hold_s`)
        before it starts, so it does not run beside that pass. A refill already under
        way goes on. The release is one for the pool (its bank): it suits a runtime that
        restores and prefills one request at a time (`cas-bank serve`); where threads
        restore at once, a refill may wait for another's pass (never past `hold_s`)."""
        self._released.clear()
        self._holding.on = True
        try:
            yield
        finally:
            self._holding.on = False

    def release(self) -> None:
        """The caller's forward pass is done: a held refill starts."""
        self._released.set()

    def settle(self) -> None:
        """Release, and wait until every refill asked for is made (tests, benchmarks)."""
        self.release()
        self._wants.join()

    def _at_exit(self) -> None:
        """Let a refill under way finish before the interpreter goes: a daemon thread
        still inside MLX as the process exits aborts it ("terminate called without an
        active exception")."""
        with self._lock:
            self.max_bytes = 0  # refills asked for from now on are dropped
        self.settle()

    def _run(self) -> None:
        while True:
            job = self._wants.get()
            if job is None:
                self._wants.task_done()
                return
            if job.held and not self._released.is_set():
                self.held += 1
                self._released.wait(self.hold_s)
            try:
                if job.plain:
                    self._make(job.plain, self._stop_ahead if job.ahead else self._stopping)
                if job.filled is not None:
                    self._make_filled(job.filled)
            except Exception:  # the thread lives on: a later take() never waits for ever
                log.exception("cas_bank: making spare arrays failed")
            finally:
                self._wants.task_done()

    def _make_filled(self, filled: Filled) -> None:
        """A set of `filled.wanted`, written by `filled.fill`, kept under its key (the
        most recent `_FILLED_KEPT` such sets, within the bound)."""
        with self._lock:
            if filled.key in self._filled:
                self._filled.move_to_end(filled.key)
                return
        made = _made_ahead(filled.wanted, self._stopping)
        if len(made) < len(filled.wanted):
            return  # closed meanwhile
        filled.fill(made)
        with self._lock:
            self._filled[filled.key] = made
            self._filled_bytes[filled.key] = filled.nbytes
            self.bytes += filled.nbytes
            self.made += len(made)
            while len(self._filled) > _FILLED_KEPT:
                self._drop_filled()
            self._trim()

    def _drop_filled(self) -> None:
        """Drop the oldest filled set (lock held)."""
        key, _ = self._filled.popitem(last=False)
        self.bytes -= self._filled_bytes.pop(key)

    def _make(self, wanted: Sequence[Wanted], stop: Callable[[], bool]) -> None:
        """Top the pool up to `wanted`'s counts of each (shape, dtype), one array at a
        time until `stop()` says otherwise."""
        with self._lock:
            counts: dict[Wanted, int] = {}
            for w in wanted:
                counts[w] = counts.get(w, 0) + 1
            missing = [w for w, n in counts.items() for _ in range(n - len(self._pool.get(w, ())))]
        made = _made_ahead(missing, stop)
        with self._lock:
            for w, dest in zip(missing, made, strict=False):  # fewer: closed meanwhile
                self._pool.setdefault(w, []).append(dest)
                self._pool.move_to_end(w)
                self.bytes += _size(w)
                self.made += 1
            self._trim()

    def _stopping(self) -> bool:
        """Whether `close` began, or the bound went to 0 (`enable(0)`, the interpreter's
        exit): a making under way stops at its next array."""
        return self._closed or self.max_bytes <= 0

    def _stop_ahead(self) -> bool:
        """Whether `make_ahead`'s making stops at its next array: closed, or a restore
        began (it allocates what is not made yet; making more beside it slowed it,
        and its own refill makes the next restore's set)."""
        return self._stopping() or self._restoring

    def _trim(self) -> None:
        """Drop filled sets, oldest first, then the least recently wanted shapes, while
        over the bound (lock held)."""
        while self.bytes > self.max_bytes and self._filled:
            self._drop_filled()
        while self.bytes > self.max_bytes and self._pool:
            w, free = self._pool.popitem(last=False)
            self.bytes -= len(free) * _size(w)


_FILLED_KEPT = 2  # filled sets kept at once: the leases restored most recently
# The longest a held refill waits for its caller's `release`: past a forward pass's
# first token on these machines (a medium model's first token after a 16k-token
# prefix, 0.4-0.9 s on this CPU).
HOLD_S = 2.0


def _made_ahead(wanted: Sequence[Wanted], stop: Callable[[], bool]) -> list[Destination]:
    """Destinations of `wanted`, zero-filled (`destinations.zeroed`: the spares' thread
    never uses MLX's load of a stream), made ahead of the restore that takes them; those
    made before `stop()` said True (a close: it waits for the array under way only).

    One at a time, the GIL offered between them (`time.sleep(0)`): a refill not held
    starts as a restore hands its arrays out, beside the caller's next steps (a held
    one once released, beside what follows the pass), and the caller waits
    for the GIL whenever it gave it up (an `mx.eval`) while this thread held it. Made
    all at once, that wait was the whole batch's Python: a reopened medium-hybrid 4k
    restore's first evaluation of its cache took 220 us against 55 with the refill done
    first (benchmark rounds, medians); one array's making is a few microseconds."""
    made = []
    for shape, dtype in wanted:
        if stop():
            break
        (array,) = zeroed([(shape, dtype)])
        made.append(Destination.made_ahead(shape, dtype, array))
        time.sleep(0)
    return made


@dataclass(frozen=True, slots=True)
class Filled:
    """A set of destinations to make ahead and fill (`Spares.refill`): `wanted`, made
    on the spares' thread, then written there by `fill` (it must not call into MLX's
    loads of Python streams: see the module docstring); taken by `key`."""

    key: Hashable
    wanted: tuple[Wanted, ...]
    fill: Callable[[list[Destination]], None]
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Job:
    """What one refill asks the spares' thread for."""

    plain: Sequence[Wanted]
    filled: Filled | None
    held: bool  # asked for in `holding()`: starts once released
    ahead: bool = False  # `make_ahead`'s: stops once a restore began


@dataclass(frozen=True, slots=True)
class SpareSet:
    """A restore's wanted arrays grouped by (shape, dtype), made once per set of shapes
    (`spare_set`): `groups` of (shape and dtype, the indices wanting it, its bytes),
    in order of first index; `flat`, the entries in index order, and `nbytes`, what
    they take."""

    groups: tuple[tuple[Wanted, tuple[int, ...], int], ...]
    flat: tuple[Wanted, ...]
    nbytes: int


def spare_set(wanted: Sequence[Wanted], from_bytes: int = 0) -> SpareSet:
    """`wanted`'s entries of at least `from_bytes` bytes, grouped (`SpareSet`)."""
    indices: dict[Wanted, list[int]] = {}
    for i, w in enumerate(wanted):
        if from_bytes <= 0 or _size(w) >= from_bytes:
            indices.setdefault(w, []).append(i)
    groups = tuple((w, tuple(ix), _size(w)) for w, ix in indices.items())
    flat = tuple(w for w in wanted if from_bytes <= 0 or _size(w) >= from_bytes)
    return SpareSet(groups, flat, sum(map(_size, flat)))


@functools.lru_cache(maxsize=1024)
def _size(w: Wanted) -> int:
    """Bytes of an array of `w` (a restore asks for each of its 24-48 arrays)."""
    return math.prod(w[0]) * w[1].itemsize


def capacities_of(
    spec_arrays: Sequence[tuple[tuple[int, ...], DType]], recorded: Sequence[tuple[Wanted, int]]
) -> list[int]:
    """The token capacities of the restores whose first attention array (`spec_arrays`'
    first: its shape holding one token, and dtype) `recorded` holds a spare of, in its
    order (least recent first), each once."""
    if not spec_arrays:
        return []
    (one, dtype) = spec_arrays[0]
    out: list[int] = []
    for (shape, d), _ in recorded:
        fits = d == dtype and len(shape) == len(one) >= 2
        if fits and (*shape[:-2], shape[-1]) == (*one[:-2], one[-1]) and shape[-2] not in out:
            out.append(shape[-2])
    return out


def encode_wanted(recent: Sequence[tuple[Wanted, int]]) -> bytes:
    """`Spares.wanted_recently` as a record: JSON `[[shape, dtype name, count], ...]`,
    least recent first."""
    rows = [[list(shape), dtype.name, n] for (shape, dtype), n in recent]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_wanted(raw: bytes | None) -> list[tuple[Wanted, int]]:
    """`encode_wanted`'s record read back; empty where there is none, or where it does
    not read as one (logged: spares are only ever a speed-up)."""
    if not raw:
        return []
    out: list[tuple[Wanted, int]] = []
    try:
        for shape, name, n in json.loads(raw):
            dims = tuple(shape)
            if not dims or not all(type(x) is int and x > 0 for x in (*dims, n)):
                raise ValueError(f"not a shape and count: {shape!r}, {n!r}")
            out.append(((dims, dtype_named(name)), n))
    except (ValueError, TypeError, InvalidInputError) as e:
        log.warning("cas_bank: the spares' record does not read (%s); none made ahead", e)
        return []
    return out


def keep_spare_destinations(max_bytes: int = 1 << 30, *, copy_ahead: bool = True) -> None:
    """Deprecated, and does nothing: every bank keeps its own spares now, on by default
    (`BankConfig.spare_bytes`, 0 for none; copies ahead:
    `bank.resources.spares.copy_ahead`). Checks its input as it did."""
    import warnings

    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    warnings.warn(
        "keep_spare_destinations is deprecated and does nothing: each Bank keeps its own "
        "spares (BankConfig.spare_bytes)",
        DeprecationWarning,
        stacklevel=2,
    )
