"""The threads that work beside a restoring thread, and how they share its work.

A restore splits its heavy loops (reading and verifying payload files in
`restore.file_read`, copying a lease in `restore.assemble`) between the restoring thread and
one helper: `together(fn)` runs `fn` on both at once, each taking work from a shared
source until none is left, so neither waits long for the other. Where the native
helper is built, its reads and copies have a partner thread of their own instead
(cas_bank/_native/pair.h: no Python on its side, so no GIL to hand over); these Python
threads then serve the paths without it (numpy copies, the Python reader).

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
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

_THREADS = 2

_pool: ThreadPoolExecutor | None = None
_partner: _Partner | None = None  # the helper `together` runs its second half on
_starting = threading.Lock()  # held while the pool starts (its threads take `_lock`)
_lock = threading.Lock()
_tids: list[int] = []  # the helpers' native thread ids, as they start
_cpus: dict[int, set[int]] = {}  # helper tid -> the CPUs it started with
_kept_off: dict[int, int] = {}  # helper tid -> the CPU it was last kept off


def _forget() -> None:
    """In a child forked from a process with helpers: none of them exist here (their
    ids are the parent's threads), so start afresh."""
    global _pool, _partner, _starting, _lock
    _pool = None
    _partner = None
    _starting = threading.Lock()
    _lock = threading.Lock()
    _tids.clear()
    _cpus.clear()
    _kept_off.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _register() -> int:
    tid = threading.get_native_id()
    try:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    except OSError:
        cpus = set()
    with _lock:
        _tids.append(tid)
        _cpus[tid] = cpus
    return tid


def helper_pool() -> ThreadPoolExecutor:
    """The threads that work beside a restoring thread: started once, not per restore,
    and all at once (the pool's and `together`'s partner): a thread started later,
    inside some call, would take the CPUs of the thread that called then (perhaps
    pinned to one) as its own."""
    global _pool, _partner
    if _pool is None:
        with _starting:
            if _pool is None:
                pool = ThreadPoolExecutor(
                    _THREADS, thread_name_prefix="cas_bank-helper", initializer=_register
                )
                # Each task holds its thread until all have started: one thread each.
                started = threading.Barrier(_THREADS)
                wait([pool.submit(started.wait, 5.0) for _ in range(_THREADS)])
                _partner = _Partner()
                _pool = pool
    return _pool


def partner() -> _Partner:
    """The helper thread `together` runs beside its caller (started with the pool)."""
    helper_pool()
    assert _partner is not None
    return _partner


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

    def __init__(self) -> None:
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._go = threading.Lock()  # released when tickets are queued
        self._go.acquire()
        self.tid = 0  # its native thread id, once it runs
        registered = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(registered,), name="cas_bank-partner", daemon=True
        )
        thread.start()
        registered.wait(5.0)

    def submit(self, fn: Callable[[], object]) -> _Ticket:
        ticket = _Ticket(fn)
        self._queue.append(ticket)
        # Released already (RuntimeError): the partner drains the queue when it wakes.
        with contextlib.suppress(RuntimeError):
            self._go.release()
        return ticket

    def _run(self, registered: threading.Event) -> None:
        self.tid = _register()
        registered.set()
        while True:
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


def keep_helpers_off_this_cpu(tids: Sequence[int] | None = None) -> None:
    """Let the helpers (`tids`, else all of them) run on the CPUs they started with,
    except the one this thread is on now (a system call per helper, only when that CPU
    changed since the last call). `together` keeps only its partner off: one call,
    not one per thread of the pool it does not use (medium-qwen3 1k, 15 benchmark
    rounds: 165 calls -> 57, a cold restore's share 37 -> 30 us)."""
    if _current_cpu is None:
        return
    cpu = _current_cpu()
    if cpu < 0:
        return
    with _lock:
        for tid in _tids if tids is None else tids:
            mask = _cpus.get(tid, set()) - {cpu}  # only ever narrowed from what it started with
            if _kept_off.get(tid) == cpu or not mask:  # done, or nowhere else to go
                continue
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:  # a helper gone, or a mask the system refuses: no harm
                continue
            _kept_off[tid] = cpu


def together(fn: Callable[[], object]) -> None:
    """Run `fn` on this thread and on a helper at once; return when both are done.

    `fn` must take its work from a source both share (a counter, an iterator) until
    none is left: this thread never waits for work the helper has not begun (a half
    the partner has not started by then is given up), only for the piece it is on.
    Re-raises what either raised, this thread's first; on an error or an interrupt
    here it still waits for the helper, which works on the same memory.
    """
    try:
        helper = partner()
    except RuntimeError:  # the interpreter is shutting down: no new threads start
        fn()
        return
    keep_helpers_off_this_cpu((helper.tid,))
    ticket = helper.submit(fn)
    try:
        fn()
    except BaseException:
        _settle(ticket)
        raise
    _settle(ticket)
    if ticket.error is not None:
        raise ticket.error


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
