"""The threads that work beside a restoring thread, and how they share its work.

A restore splits its heavy loops (reading and verifying payload files in
`index.fastread`, copying a lease in `index.layout`) between the restoring thread and
one helper: `together(fn)` runs `fn` on both at once, each taking work from a shared
source until none is left, so neither waits long for the other.

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

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

_THREADS = 2

_pool: ThreadPoolExecutor | None = None
_starting = threading.Lock()  # held while the pool starts (its threads take `_lock`)
_lock = threading.Lock()
_tids: list[int] = []  # the helpers' native thread ids, as they start
_cpus: dict[int, set[int]] = {}  # helper tid -> the CPUs it started with
_kept_off: dict[int, int] = {}  # helper tid -> the CPU it was last kept off


def _forget() -> None:
    """In a child forked from a process with helpers: none of them exist here (their
    ids are the parent's threads), so start afresh."""
    global _pool, _starting, _lock
    _pool = None
    _starting = threading.Lock()
    _lock = threading.Lock()
    _tids.clear()
    _cpus.clear()
    _kept_off.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _register() -> None:
    tid = threading.get_native_id()
    try:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    except OSError:
        cpus = set()
    with _lock:
        _tids.append(tid)
        _cpus[tid] = cpus


def helper_pool() -> ThreadPoolExecutor:
    """The threads that work beside a restoring thread: started once, not per restore,
    and all at once: a thread the pool started later, inside some call, would take the
    CPUs of the thread that called then (perhaps pinned to one) as its own."""
    global _pool
    if _pool is None:
        with _starting:
            if _pool is None:
                pool = ThreadPoolExecutor(
                    _THREADS, thread_name_prefix="cas_bank-helper", initializer=_register
                )
                # Each task holds its thread until all have started: one thread each.
                started = threading.Barrier(_THREADS)
                wait([pool.submit(started.wait, 5.0) for _ in range(_THREADS)])
                _pool = pool
    return _pool


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


def keep_helpers_off_this_cpu() -> None:
    """Let the helpers run on the CPUs they started with, except the one this thread is
    on now (a system call per helper, only when that CPU changed since the last call)."""
    if _current_cpu is None:
        return
    cpu = _current_cpu()
    if cpu < 0:
        return
    with _lock:
        for tid in _tids:
            mask = _cpus[tid] - {cpu}  # only ever narrowed from what it started with
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
    none is left: this thread never waits for work the helper has not begun (a helper
    that has not started by then is cancelled), only for the piece it is on.
    Re-raises what either raised, this thread's first; on an error or an interrupt
    here it still waits for the helper, which works on the same memory.
    """
    keep_helpers_off_this_cpu()
    try:
        helper = helper_pool().submit(fn)
    except RuntimeError:  # the interpreter is shutting down: no new work for threads
        fn()
        return
    try:
        fn()
    except BaseException:
        _settle(helper)
        raise
    _settle(helper)
    if not helper.cancelled():
        helper.result()  # done by now: raises what the helper raised


def _settle(helper: Future[object]) -> None:
    """Return once `helper` is cancelled or done, even through a KeyboardInterrupt
    (raised after it): its caller is about to give up the memory it writes into."""
    if helper.cancel():
        return
    interrupted: BaseException | None = None
    while not helper.done():
        try:
            wait([helper])
        except BaseException as e:  # re-raised below, once it is safe
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
