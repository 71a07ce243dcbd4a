"""The restoring thread's workers (cas_bank.restore.workers): work shared through a common
source, errors from either side, workers kept off the restoring thread's CPU, and one
`Workers`' threads joined by its `close`."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from forking import holds_in_a_forked_child

from cas_bank.restore import workers
from cas_bank.restore.workers import Workers


@pytest.fixture
def helpers() -> Iterator[Workers]:
    """A `Workers` of its own, closed (its threads joined) after the test."""
    made = Workers()
    try:
        yield made
    finally:
        made.close()


def test_together_runs_on_two_threads_and_does_each_piece_once(helpers: Workers) -> None:
    pieces = itertools.count()
    done: list[tuple[int, int]] = []
    took = {True: threading.Event(), False: threading.Event()}  # by "is the main thread"

    def work() -> None:
        here = threading.current_thread() is threading.main_thread()
        while (j := next(pieces)) < 200:
            done.append((j, threading.get_ident()))
            took[here].set()
            if j < 100:
                took[not here].wait(0.001)  # let the other side take a share too

    helpers.together(work)
    assert sorted(j for j, _ in done) == list(range(200))
    assert len({t for _, t in done}) == 2  # both took pieces


def test_together_raises_what_either_side_raised(helpers: Workers) -> None:
    def fails_here() -> None:
        if threading.current_thread() is threading.main_thread():
            raise ValueError("this thread")

    with pytest.raises(ValueError, match="this thread"):
        helpers.together(fails_here)

    started = threading.Event()

    def fails_there() -> None:
        if threading.current_thread() is not threading.main_thread():
            started.set()
            raise KeyError("helper")
        started.wait(5)  # the helper has begun: its error is waited for, not cancelled

    with pytest.raises(KeyError, match="helper"):
        helpers.together(fails_there)


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
def test_an_interrupt_still_waits_for_the_helper(helpers: Workers) -> None:
    """Ctrl-C while the helper works: `together` raises only once the helper is done
    (it writes into memory the interrupted restore is about to give up)."""
    started = threading.Event()
    returned = threading.Event()
    interrupted = threading.Event()
    finished = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    def work() -> None:
        if threading.current_thread() is threading.main_thread():
            assert started.wait(5)  # then nothing left to do here: wait for the helper
            returned.set()
            return
        started.set()
        assert returned.wait(5)
        time.sleep(0.05)  # the main thread is waiting for this one by now
        os.kill(os.getpid(), signal.SIGINT)  # lands on the main thread
        assert interrupted.wait(5)
        time.sleep(0.2)  # still writing, well after the interrupt
        finished.set()

    before = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            helpers.together(work)
        assert finished.is_set()
    finally:
        signal.signal(signal.SIGINT, before)


def test_together_runs_alone_once_threads_can_no_longer_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At interpreter shutdown no thread starts (nor does the pool take work): `fn`
    runs on the caller, and `map` maps there."""

    def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(workers, "ThreadPoolExecutor", closed)
    unstarted = Workers()
    assert _pieces_done(unstarted, 20) == list(range(20))
    assert unstarted.map(lambda k: k * threading.get_ident(), range(3)) == [
        k * threading.get_ident() for k in range(3)
    ]
    assert not unstarted.tids


def test_close_joins_the_threads_and_later_calls_run_alone() -> None:
    """`close` ends and joins the pool's threads and the partner; a call after it runs
    on its caller (no thread starts again); a second close does nothing."""
    own = Workers()
    before = set(threading.enumerate())
    assert _pieces_done(own, 50) == list(range(50))
    assert own.map(lambda k: threading.get_ident(), range(8))  # the pool's threads
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("cas_bank-")]
    assert len(started) == workers.THREADS + 1  # the pool's and the partner
    own.close()
    assert not any(t.is_alive() for t in started)  # joined
    here = threading.get_ident()
    assert own.map(lambda k: threading.get_ident(), range(4)) == [here] * 4
    assert _pieces_done(own, 50) == list(range(50))
    assert not set(threading.enumerate()) - before
    own.close()


def test_no_threads_means_every_call_runs_on_its_caller() -> None:
    none = Workers(0)
    before = set(threading.enumerate())
    assert _pieces_done(none, 30) == list(range(30))
    assert none.map(lambda k: threading.get_ident(), range(3)) == [threading.get_ident()] * 3
    assert set(threading.enumerate()) == before and none.partner_tid() is None
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        Workers(-1)


def _pieces_done(helpers: Workers, n: int) -> list[int]:
    """`together` over `n` pieces taken from one shared counter: the pieces done."""
    pieces = itertools.count()
    done: list[int] = []

    def work() -> None:
        while (j := next(pieces)) < n:
            done.append(j)

    helpers.together(work)
    return sorted(done)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a system that pins threads to CPUs, and two CPUs",
)
def test_helpers_are_kept_off_the_restoring_threads_cpu(helpers: Workers) -> None:
    allowed = os.sched_getaffinity(0)
    first, second = sorted(allowed)[:2]
    helpers.together(lambda: None)  # the helper threads start with this thread's CPUs
    try:
        for cpu in (first, second):  # the restoring thread moves: so do the workers
            os.sched_setaffinity(0, {cpu})
            helpers.together(lambda: None)  # keeps its partner off this CPU
            partner = helpers.partner_tid()
            assert partner is not None and os.sched_getaffinity(partner) == allowed - {cpu}
            helpers.keep_off_this_cpu()  # the pool's too (its map callers)
            tids = helpers.tids
            assert len(tids) == workers.THREADS + 1  # the pool's threads and the partner
            for tid in tids:
                mask = os.sched_getaffinity(tid)
                assert cpu not in mask and mask == allowed - {cpu}
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_helpers(helpers: Workers) -> None:
    """The parent's helper ids are not the child's threads: the child never pins them."""
    helpers.together(lambda: None)
    parent_tids = helpers.tids
    assert parent_tids

    def in_the_child() -> bool:
        ok = not helpers.tids and helpers._pool is None and helpers._partner is None
        ok = ok and _pieces_done(helpers, 50) == list(range(50))
        return ok and bool(helpers.tids) and not set(helpers.tids) & set(parent_tids)

    assert holds_in_a_forked_child(in_the_child)


def test_two_callers_at_once_each_get_all_their_pieces_done(helpers: Workers) -> None:
    """Two threads in `together` at once share one partner: each call's pieces are
    all done, once, whichever thread took them (a call whose half the partner had not
    begun by the time its caller ran out of pieces is given up, not waited for)."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            for round_ in range(200):
                results[k * 1000 + round_] = _pieces_done(helpers, 37)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 400 and all(v == list(range(37)) for v in results.values())
