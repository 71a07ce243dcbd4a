"""A check run in a forked child: what a process's native and Python helper threads do
after a fork (they are not there; the child must start its own)."""

from __future__ import annotations

import os
from collections.abc import Callable


def holds_in_a_forked_child(check: Callable[[], bool]) -> bool:
    """Whether `check()` is true in a child forked from this process (False if it
    raised). The child reports through a pipe and leaves without running the parent's
    exit code."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = check()
        except BaseException:  # any failure is the answer "no"
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    try:
        return os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
