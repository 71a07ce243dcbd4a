"""The threads that work beside a restoring thread, and how they share its work: one
bank's `Workers` (made by its `restore.resources.Resources`, joined by `close`).

A restore splits its heavy loops (reading and verifying payload files in
`restore.file_read`, copying decoded blocks in `restore.assemble`) between the
restoring thread and one helper: `Workers.together(fn)` runs `fn` on both at once,
each taking work from a shared source until none is left, so neither waits long for
the other; `Workers.map` hands the files of the reader without the native helper to a
pool of two. Where the native helper is built, its reads and copies have a partner
thread of their own instead (cas_bank/_native/pair.h: no Python on its side, so no GIL
to hand over); these Python threads then serve the paths without it (numpy copies, the
Python reader). No thread starts before the first call that wants one; a closed
`Workers` (or one of no threads) runs every call on its caller.

Where the OS lets a process say which CPUs a thread may use (Linux), the helpers are
kept off the CPU the restoring thread is on while they work beside it. Without that,
Linux often wakes the helper onto the waker's own CPU (it expects the waker to sleep,
but the waker goes on working) and both share one CPU until the load balancer moves
one, a scheduler tick later: on a 2-vCPU VM, about half of all restores read as
slowly as on one thread, each thread showing 4.0 ms of run-queue delay in
`/proc/self/task/*/schedstat`; kept apart, a 1k-token reopened restore's read went
from 12.6 to 8.4 ms (medians; docs/design.md, "Restore path"). Elsewhere (macOS)
nothing is pinned. The helpers follow the thread that called last: with two restoring
threads at once, they are kept off the CPU of the later one.

In a child forked from a process with helpers, none of them exist (their ids are the
parent's threads): every `Workers` of the child starts afresh (`_forget`, through a
weak set of the live ones: bookkeeping, no threads nor buffers of its own).

`ReadAhead`: one background thread calls a function on items in order, a bounded
number of results ahead of the consumer.

A restore reads payloads one by one. rocksdict's `get` holds the GIL, but blake3 and
`np.copyto` release it, so reading block i+1 on another thread while the consumer
verifies and copies block i overlaps the two (measured in benchmarks/bench_capacity.py
and benchmarks/bench_core.py). The depth bound keeps memory at a block or two beyond
what the consumer holds.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from typing import Generic, TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")

THREADS = 2  # the pool's; `together`'s partner is one more

_live: weakref.WeakSet[Workers] = weakref.WeakSet()  # every Workers, for `_at_fork`


class Workers:
    """One bank's helper threads: a pool of `threads` (`map`) and one partner
    (`together`), started together by the first call that wants them and joined by
    `close`. `threads=0`: none, ever (every call runs on its caller)."""

    def __init__(self, threads: int = THREADS) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
            raise ValueError(f"threads must be an int >= 0, got {threads!r}")
        self.threads = threads
        self._forget()
        self.closed = False
        _live.add(self)

    def _forget(self) -> None:
        """No threads (yet, or any more in a forked child): start afresh."""
        self._pool: ThreadPoolExecutor | None = None
        self._partner: _Partner | None = None
        self._starting = threading.Lock()  # held while the threads start
        self._lock = threading.Lock()  # `closed`, and `map`'s hand-over to the pool
        self._pins = _Pins()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:  # the parent's threads, not this process's
            finalizer.detach()
        self._finalizer: weakref.finalize[[ThreadPoolExecutor, _Partner], Workers] | None = None

    @property
    def tids(self) -> list[int]:
        """The native thread ids of the helpers started so far (the pool's, the partner)."""
        with self._pins.lock:
            return list(self._pins.tids)

    def _start(self) -> tuple[ThreadPoolExecutor, _Partner] | None:
        """The pool and the partner: started once, not per restore, and all at once: a
        thread started later, inside some call, would take the CPUs of the thread that
        called then (perhaps pinned to one) as its own. None once closed, with no
        threads, or at interpreter shutdown (no thread starts then)."""
        pool, partner = self._pool, self._partner
        if pool is not None and partner is not None:
            return pool, partner
        if self.closed or not self.threads:
            return None
        with self._starting:
            if self._pool is None and not self.closed:
                try:
                    self._start_now()
                except RuntimeError:  # the interpreter is shutting down
                    return None
        pool, partner = self._pool, self._partner
        return None if pool is None or partner is None else (pool, partner)

    def _start_now(self) -> None:
        register = self._pins.register  # the threads hold it, not this object
        pool = ThreadPoolExecutor(
            self.threads, thread_name_prefix="cas_bank-helper", initializer=register
        )
        # Each task holds its thread until all have started: one thread each.
        started = threading.Barrier(self.threads)
        wait([pool.submit(started.wait, 5.0) for _ in range(self.threads)])
        partner = _Partner(register)
        # Dropped unclosed (a bank never closed): its threads end, unjoined.
        self._finalizer = weakref.finalize(self, _abandon, pool, partner)
        self._partner, self._pool = partner, pool

    def partner_tid(self) -> int | None:
        """The native id of the thread `together` runs beside its caller (started
        with the pool by this call); None where there is none."""
        started = self._start()
        return None if started is None else started[1].tid

    def keep_off_this_cpu(self, tids: Sequence[int] | None = None) -> None:
        """Let the helpers (`tids`, else all of them) run on the CPUs they started with,
        except the one this thread is on now (a system call per helper, only when that
        CPU changed since the last call). `together` keeps only its partner off: one
        call, not one per thread of the pool it does not use (medium-qwen3 1k, 15
        benchmark rounds: 165 calls -> 57, a cold restore's share 37 -> 30 us)."""
        if _current_cpu is None:
            return
        cpu = _current_cpu()
        if cpu >= 0:
            self._pins.keep_off(cpu, tids)

    def together(self, fn: Callable[[], object]) -> None:
        """Run `fn` on this thread and on the partner at once; return when both are done.

        `fn` must take its work from a source both share (a counter, an iterator) until
        none is left: this thread never waits for work the partner has not begun (a
        half it has not started by then is given up), only for the piece it is on.
        Re-raises what either raised, this thread's first; on an error or an interrupt
        here it still waits for the partner, which works on the same memory. Closed,
        or with no threads: `fn` runs here alone.
        """
        started = self._start()
        if started is None:
            fn()
            return
        partner = started[1]
        self.keep_off_this_cpu((partner.tid,))
        ticket = partner.submit(fn)
        try:
            fn()
        except BaseException:
            _settle(ticket)
            raise
        _settle(ticket)
        if ticket.error is not None:
            raise ticket.error

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`fn` of each item, on the pool (kept off this thread's CPU); in order. Closed,
        or with no threads: one by one here."""
        started = self._start()
        if started is None:
            return [fn(item) for item in items]
        self.keep_off_this_cpu()
        with self._lock:  # `close` marks it closed under it: all submitted, or none
            futures = None if self.closed else [started[0].submit(fn, i) for i in items]
        if futures is None:
            return [fn(item) for item in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the threads and join them (work already handed to them is done first);
        later calls run on their caller. Idempotent."""
        with self._starting:  # none starting meanwhile
            with self._lock:
                self.closed = True
            pool, partner, finalizer = self._pool, self._partner, self._finalizer
            self._pool = self._partner = self._finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if pool is not None:
            pool.shutdown(wait=True)
        if partner is not None:
            partner.stop(join=True)


class _Pins:
    """The helpers' native thread ids and the CPUs each started with and was last kept
    off; shared with the threads (which register here), never their `Workers`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tids: list[int] = []
        self._cpus: dict[int, set[int]] = {}  # helper tid -> the CPUs it started with
        self._kept_off: dict[int, int] = {}  # helper tid -> the CPU it was last kept off

    def register(self) -> int:
        """Run by each helper as it starts: its id and CPUs."""
        tid = threading.get_native_id()
        try:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        except OSError:
            cpus = set()
        with self.lock:
            self.tids.append(tid)
            self._cpus[tid] = cpus
        return tid

    def keep_off(self, cpu: int, tids: Sequence[int] | None) -> None:
        """`Workers.keep_off_this_cpu` on CPU `cpu`."""
        with self.lock:
            for tid in self.tids if tids is None else tids:
                mask = self._cpus.get(tid, set()) - {cpu}  # only ever narrowed
                if self._kept_off.get(tid) == cpu or not mask:  # done, or nowhere else
                    continue
                try:
                    os.sched_setaffinity(tid, mask)
                except OSError:  # a helper gone, or a mask the system refuses: no harm
                    continue
                self._kept_off[tid] = cpu


def _abandon(pool: ThreadPoolExecutor, partner: _Partner) -> None:
    """End the threads of a `Workers` dropped without `close` (not joined: this may
    run on one of them)."""
    pool.shutdown(wait=False)
    partner.stop(join=False)


def _at_fork() -> None:
    for workers in list(_live):
        workers._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_at_fork)


class _Ticket:
    """One `together` call's half for the partner: `claim`, taken by whichever comes
    first (the partner to run it, or its caller to give it up as never begun); `done`,
    released once the partner ran it; what it raised."""

    __slots__ = ("claim", "done", "error", "fn")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.claim = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None


class _Partner:
    """One daemon thread that runs the other half of each `together` call: a ticket a
    call, handed over through a queue and plain locks. An executor's future, its
    condition variables and `wait` cost a call ~83 us with the caches cold, as a
    forward pass leaves them (~18 us warm), against ~49 (~4 warm) this way: a fixed
    cost of every restore that reads files or copies a lease."""

    def __init__(self, register: Callable[[], int]) -> None:
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._go = threading.Lock()  # released when tickets are queued
        self._go.acquire()
        self._stopping = False
        self.tid = 0  # its native thread id, once it runs
        registered = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(register, registered),
            name="cas_bank-partner",
            daemon=True,
        )
        self._thread.start()
        registered.wait(5.0)

    def submit(self, fn: Callable[[], object]) -> _Ticket:
        ticket = _Ticket(fn)
        self._queue.append(ticket)
        self._wake()
        return ticket

    def _wake(self) -> None:
        # Released already (RuntimeError): the partner drains the queue when it wakes.
        with contextlib.suppress(RuntimeError):
            self._go.release()

    def stop(self, *, join: bool) -> None:
        """Run what is queued, then end the thread (`join`: and wait for it). A ticket
        queued after that is never claimed here: its caller gives it up (`_settle`)."""
        self._stopping = True
        self._wake()
        if join:
            self._thread.join()

    def _run(self, register: Callable[[], int], registered: threading.Event) -> None:
        self.tid = register()
        registered.set()
        while not self._stopping:
            self._go.acquire()
            while self._queue:
                ticket = self._queue.popleft()
                if not ticket.claim.acquire(blocking=False):
                    continue  # its caller finished the work alone and gave it up
                try:
                    ticket.fn()
                except BaseException as e:  # the caller re-raises it
                    ticket.error = e
                finally:
                    ticket.done.release()


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's `sched_getcpu` where it and `os.sched_setaffinity` exist."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:  # the process's own symbols, the C library's among them
        fn = getattr(ctypes.CDLL(None), "sched_getcpu", None)
    except OSError:
        return None
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn  # type: ignore[no-any-return]


_current_cpu = _cpu_reader()


def _settle(ticket: _Ticket) -> None:
    """Return once `ticket` is given up (the partner never began it) or done, even
    through a KeyboardInterrupt (raised after it): its caller is about to give up the
    memory the partner writes into."""
    if ticket.claim.acquire(blocking=False):
        return
    interrupted: BaseException | None = None
    while True:
        try:
            ticket.done.acquire()
            break
        except BaseException as e:  # re-raised below, once it is safe
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


class ReadAhead(Generic[T, R]):
    """`fn(item)` for every item, in order, computed on one background thread.

    Iterating yields the results in order; an exception `fn` raised is re-raised at
    its item's place, and nothing after it is read. `close` (or leaving the `with`
    block) stops the reader early and waits for it: the consumer may stop at any item.
    """

    def __init__(self, fn: Callable[[T], R], items: Sequence[T], depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._fn = fn
        self._items = items
        # (True, result) or (False, the exception fn raised); None once every item is read.
        self._results: queue.Queue[tuple[bool, object] | None] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cas_bank-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for item in self._items:
            if self._stop.is_set():
                return
            try:
                result = self._fn(item)
            except BaseException as e:  # handed to the consumer, which re-raises it
                self._results.put((False, e))
                return
            self._results.put((True, result))
        self._results.put(None)

    def __iter__(self) -> Iterator[R]:
        while True:
            message = self._results.get()
            if message is None:
                return
            ok, value = message
            if not ok:
                raise cast(BaseException, value)
            yield cast(R, value)

    def close(self) -> None:
        """Stop reading and wait for the thread (it finishes at most the item in hand)."""
        self._stop.set()
        while self._thread.is_alive():
            with suppress(queue.Empty):  # make room: a reader blocked on a full queue
                self._results.get(timeout=0.01)
        self._thread.join()

    def __enter__(self) -> ReadAhead[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
