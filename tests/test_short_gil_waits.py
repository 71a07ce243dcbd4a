"""`destinations.unfilled` shortens Python's switch interval while MLX loads: MLX's I/O
thread calls back into the stream for the GIL a few times a load, and beside a busy
Python thread each call waited the default 5 ms (a 0.3 ms load took 21-25 ms here).
The interval is process-wide, so what matters is that it is put back: after every
load, with loads on two threads at once, after an error, in a child forked during a
load on another thread (which has not the thread that would put it back:
`destinations._short_waits_after_fork`), and never over a setting someone made
meanwhile."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cas_bank.arrays import dtype_named
from cas_bank.restore import destinations
from cas_bank.restore.destinations import LOAD_SWITCH_INTERVAL, short_gil_waits, unfilled

DEFAULT = 5e-3


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT)
    yield
    sys.setswitchinterval(before)


def _short() -> bool:
    return sys.getswitchinterval() <= LOAD_SWITCH_INTERVAL * 1.001


def test_a_load_runs_with_short_waits_and_puts_the_interval_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[float] = []
    real = destinations._Unfilled.readinto

    def readinto(self: Any, buffer: Any) -> int:
        seen.append(sys.getswitchinterval())
        return int(real(self, buffer))

    monkeypatch.setattr(destinations._Unfilled, "readinto", readinto)
    f32 = dtype_named("float32")
    out = unfilled([((2, 3, 64, 8), f32), ((1, 2, 128, 16), f32)])
    assert out is not None and [a.shape for a in out] == [(2, 3, 64, 8), (1, 2, 128, 16)]
    assert seen and all(s <= LOAD_SWITCH_INTERVAL * 1.001 for s in seen)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT)


def test_two_threads_inside_at_once_put_it_back_once_both_leave() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with short_gil_waits():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with short_gil_waits():
        assert _short()
    assert _short()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT)


def test_an_error_inside_puts_it_back() -> None:
    with pytest.raises(RuntimeError), short_gil_waits():
        assert _short()
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(DEFAULT)


def test_a_setting_made_meanwhile_is_kept_and_a_short_one_is_left_alone() -> None:
    with short_gil_waits():
        sys.setswitchinterval(0.02)  # a runtime's own choice, made while a load ran
    assert sys.getswitchinterval() == pytest.approx(0.02)
    sys.setswitchinterval(1e-5)  # already shorter: nothing to change, nothing to put back
    with short_gil_waits():
        assert sys.getswitchinterval() == pytest.approx(1e-5)
    assert sys.getswitchinterval() == pytest.approx(1e-5)


def _child_interval() -> float:
    """Fork while another thread is inside `short_gil_waits`; the child runs a load's
    `short_gil_waits` of its own and says what its switch interval is then."""
    inside, leave = threading.Event(), threading.Event()

    def load() -> None:
        with short_gil_waits():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert inside.wait(10)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the loading thread is not here
            code = 1
            try:
                with short_gil_waits():
                    pass
                os.write(write, repr(sys.getswitchinterval()).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        got = os.read(read, 64)
        os.close(read)
    finally:
        leave.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert sys.getswitchinterval() == pytest.approx(DEFAULT)  # the parent's is back
    return float(got)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_during_a_load_gets_its_switch_interval_back() -> None:
    assert _child_interval() == pytest.approx(DEFAULT)
