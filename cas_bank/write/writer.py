"""The background writer: stores queued by `Namespace.store_later`, written in order on
one thread, so that encoding, digests, payload files and the RocksDB batch run off the
caller's thread (MTPLX's idle-lane spill).

- The caller pays for checking its input and for a zero-copy snapshot of its arrays
  (new objects over the whole buffers: MLX arrays are values, so the cache's next
  in-place update copies its buffer once instead of writing into the snapshot;
  `index.lease`). The snapshot is
  leased at once: a restore right after sees the blocks from memory.
- The queue is bounded (`BankConfig.write_behind` stores): when it is full the caller
  waits. Nothing is dropped: a store that fails keeps its exception, which its
  `PendingStore.result()` raises, and the first since the last flush `Bank.flush()`
  too (not `close()` once `result()` has raised it). A failed store's exception keeps
  its traceback's lines, not its frames: those held the store's KV snapshot.
- Each store is one transaction, as on the caller's thread: under SIGKILL a store is
  whole or absent; one whose `Bank.flush()` returned is on disk (`durability="wal"`).
  What a SIGKILL loses is at most what was still queued.
- What a queued store will write is visible at once: its submitter registers it in
  `queued` (the overlay `index.view` reads in front of the store, as RocksDB reads its
  memtable before its tables), and the writer retires it once the store's batch has
  committed, or failed: a failed store leaves the view, and `flush()` raises it.
- `stats()`: how many stores are queued now (waiting or being written) and what the
  writer wrote (stores, bytes, failures) since the bank opened; `/metrics` shows them.
- A `when_written` callback (or `submit`'s `measure`) that raises is logged, each on its
  own: the writer goes on, and the store's own result is what its write returned.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger("cas_bank")


class PendingStore(Generic[T]):
    """A store queued for the background writer; `result()` waits for it.

    The report's fields read through it (`pending.blocks_written`): each waits for the
    write, then answers from `result()` (so code written for an inline store's report
    keeps working, and reads what was committed).
    """

    def __init__(self) -> None:
        # Held until the store is settled: a waiter passes once `_set` releases it (two
        # C-level locks, where a threading.Event is a Condition built in Python: this is
        # made on the caller's thread for every queued store).
        self._unsettled = threading.Lock()
        self._unsettled.acquire()
        self._settled = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[T], None]] = []
        self._lock = threading.Lock()
        self._reported = False  # result() raised the error to a caller

    def _set(self, value: T | None, error: BaseException | None) -> None:
        with self._lock:
            self._value, self._error = value, error
            self._settled = True
            self._unsettled.release()
            callbacks, self._callbacks = self._callbacks, []
        if error is None:
            for fn in callbacks:
                _call(fn, value)  # type: ignore[arg-type]

    def when_written(self, fn: Callable[[T], None]) -> None:
        """Call `fn(report)` once the store is written (now, if it is); never if it
        failed. On the writer's thread: keep it short. What `fn` raises is logged, not
        raised (the writer goes on; the store's result is its own)."""
        with self._lock:
            if not self._settled:
                self._callbacks.append(fn)
                return
        if self._error is None:
            _call(fn, self._value)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result(), name)

    def done(self) -> bool:
        return self._settled

    def _wait(self, timeout: float | None) -> bool:
        """Whether the store is settled, waiting up to `timeout` seconds (None: for ever)."""
        if self._settled:
            return True
        if not self._unsettled.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return False
        self._unsettled.release()  # the next waiter passes too
        return True

    def result(self, timeout: float | None = None) -> T:
        """The store's report once written; its exception if it failed."""
        if not self._wait(timeout):
            raise TimeoutError("the store is still queued")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._value is not None
        return self._value


def _keep_lines_only(error: BaseException) -> None:
    """Let go of the frames of `error`'s traceback, and of the exceptions it chains,
    keeping their lines (as a note, from Python 3.11). A frame keeps its locals, and
    from Python 3.11 its function: a job's closure, which holds the store's KV snapshot,
    past `frame.clear()`. Kept whole, a failed store's exception (in its `PendingStore`,
    for `flush()`, wherever its caller keeps it) kept the cache's whole buffers."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        if tb is not None:
            if hasattr(e, "add_note"):  # Python 3.11 on
                e.add_note("in the background writer:\n" + "".join(traceback.format_tb(tb)))
                e.__traceback__ = None
            traceback.clear_frames(tb)
        e = e.__cause__ or e.__context__


def _call(fn: Callable[[T], None], value: T) -> None:
    """`fn(value)`; what it raises is logged: a callback's bug must not stop the writer
    (every later store would wait for ever, and `flush()` with them)."""
    try:
        fn(value)
    except Exception:
        log.exception("cas_bank: a when_written callback raised; the store was written")


class Queued:
    """The records of the stores the writer has not finished, as their submitters
    registered them (`index.view` says what they are), oldest first. Read without a
    lock: `entries` is an immutable tuple, replaced whole by `add` and `retire`, so
    a reader holds one state of the overlay however long it reads."""

    def __init__(self) -> None:
        self.entries: tuple[object, ...] = ()  # replaced whole, never changed in place
        self._lock = threading.Lock()

    def add(self, entry: object) -> None:
        with self._lock:
            self.entries = (*self.entries, entry)

    def retire(self, entry: object) -> None:
        with self._lock:
            self.entries = tuple(e for e in self.entries if e is not entry)


@dataclass(frozen=True, slots=True)
class WriterStats:
    """The background writer now (`BackgroundWriter.stats`)."""

    queued: int  # stores waiting or being written
    capacity: int  # BankConfig.write_behind: a caller waits at this many
    written: int  # stores written since the bank opened
    bytes_written: int  # payload, state and end bytes they wrote
    failed: int  # stores that raised (flush() raises the first)


class BackgroundWriter:
    """One thread writing queued stores in order; at most `depth` wait."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._written = self._bytes = self._failed = 0
        self._queue: queue.Queue[tuple[Callable[[], Any], PendingStore[Any]] | None] = queue.Queue(
            maxsize=depth
        )
        # The first store that failed since the last flush, and its PendingStore.
        self._first_error: tuple[BaseException, PendingStore[Any]] | None = None
        self._lock = threading.Lock()
        self.queued = Queued()  # what the queued stores will write (`index.view`)
        # Held while a store is queued and while close begins: no store can land
        # behind the stop marker (it would wait forever).
        self._gate = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cas_bank-writer", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(
        self,
        write: Callable[[], T],
        measure: Callable[[T], int] | None = None,
        records: object | None = None,
    ) -> PendingStore[T]:
        """Queue `write`; blocks while the queue is full. `RuntimeError` once closed:
        nobody would ever write it. `measure(result)`: the bytes it wrote (`stats`).
        `records`: what it will write, in `queued` from now until its batch has
        committed or failed (retired before its `PendingStore` says so), or until the
        wait for room raises (a `KeyboardInterrupt`): nothing was queued then.

        On the writer's own thread (a store made in a `when_written` callback or a
        queued job) `write` runs at once, before the stores queued ahead of it: waiting
        for room there would wait for the thread that makes room."""
        here = threading.current_thread() is self._thread
        with self._gate:
            if self._closed:
                raise RuntimeError("the background writer is closed: the bank was closed")
            pending: PendingStore[T] = PendingStore()
            if measure is not None:
                pending.when_written(lambda r: self._count(bytes_written=measure(r)))
            if records is not None:
                self.queued.add(records)
                write = self._retiring(write, records)
            if not here:
                try:
                    self._queue.put((write, pending))  # the writer drains: never waits for ever
                except BaseException:
                    if records is not None:  # never written: out of the view
                        self.queued.retire(records)
                    raise
                return pending
        self._write(write, pending)  # outside the gate: its callbacks may submit again
        return pending

    def _retiring(self, write: Callable[[], T], records: object) -> Callable[[], T]:
        """`write`, then `records` out of `queued`, whatever `write` did."""

        def written() -> T:
            try:
                return write()
            finally:
                self.queued.retire(records)

        return written

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(
                queued=self._queue.unfinished_tasks,
                capacity=self.depth,
                written=self._written,
                bytes_written=self._bytes,
                failed=self._failed,
            )

    def _count(self, *, bytes_written: int) -> None:
        with self._lock:
            self._bytes += bytes_written

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                # Let go of the job now, not when the next one comes: its closure holds
                # the store's snapshot, views of a cache's buffers, and a cache whose
                # buffers something else holds copies them before it writes.
                item = None
                self._queue.task_done()

    def _write(self, write: Callable[[], Any], pending: PendingStore[Any]) -> None:
        """Run one store and settle its `PendingStore`; a failure is kept for `flush()`."""
        try:
            value = write()
        except BaseException as e:  # kept for flush(): never dropped silently
            del write  # this frame's job (it is in the traceback, and still running)
            _keep_lines_only(e)  # the KV snapshot goes with the frames
            with self._lock:
                if self._first_error is None:
                    self._first_error = (e, pending)
                self._failed += 1
            pending._set(None, e)
        else:
            with self._lock:
                self._written += 1
            pending._set(value, None)

    def flush(self) -> None:
        """Wait until every queued store is written; raise the first that failed since
        the last flush. From the writer's own thread (a store that flushes), or once
        closed (nothing is queued then): no wait."""
        error = self._take_error(wait=True)
        if error is not None:
            raise error[0]

    def _take_error(self, *, wait: bool) -> tuple[BaseException, PendingStore[Any]] | None:
        if wait and threading.current_thread() is not self._thread and not self._closed:
            self._queue.join()
        with self._lock:
            error, self._first_error = self._first_error, None
        return error

    def refuse_own_thread(self, what: str) -> None:
        """`RuntimeError` on the writer's own thread (in a `when_written` callback or a
        queued job): `what` would wait for that thread to stop, which never comes."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"{what} on the background writer's own thread (a when_written callback"
                " or a queued job) would wait for that thread itself: call it from"
                " another thread"
            )

    def close(self) -> None:
        """Flush, then stop the thread; a second close does nothing. The failure it
        raises is the first since the last flush, unless its `result()` already raised
        it to its caller (a close does not report it twice).

        On the writer's own thread (a `when_written` callback): `RuntimeError` before
        anything is done (`refuse_own_thread`): it would wait for itself."""
        self.refuse_own_thread("close()")
        with self._gate:  # a submit racing with this one lands before the flush, or fails
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.join()  # what was queued before the gate closed
            error = self._take_error(wait=False)
            if error is not None and not error[1]._reported:
                raise error[0]
        finally:
            self._queue.put(None)
            self._thread.join()
