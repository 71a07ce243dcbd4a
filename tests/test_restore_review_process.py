"""Review of 15ec346 (`destinations.short_gil_waits`): docs/design.md, "Process settings",
says the library "sets nothing process-wide for longer than a call": an unfilled
destination's load shortens Python's switch interval for its ~0.3 ms and puts it back.

A process forked while a load is under way on another thread (`multiprocessing`'s
default start on Linux, a server's worker) inherits the short interval and the count
of threads inside, but not the thread that would put it back: without a fork handler
(`destinations._short_waits_after_fork`) the child kept 0.1 ms for good, whatever
loads came and went there.

Real threads and a real fork; the child only reads the interval, runs one more
`short_gil_waits` and reports through a pipe.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest

from cas_bank.restore import destinations

DEFAULT = 5e-3


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT)
    yield
    sys.setswitchinterval(before)


def _child_interval() -> float:
    """Fork while another thread is inside `short_gil_waits`; the child runs a load's
    `short_gil_waits` of its own and says what its switch interval is then."""
    inside, leave = threading.Event(), threading.Event()

    def load() -> None:
        with destinations.short_gil_waits():
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
                with destinations.short_gil_waits():
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
