"""`WorkQueue`: a bounded background queue with one worker thread.

`submit` never blocks: when the queued bytes would pass the bound the job is dropped
(the caller counts it). `wait` returns when every job submitted before it is done,
so `Bank.flush` can promise that queued publishes went out (or failed, counted).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("cas_bank.remote")


class WorkQueue(Generic[T]):
    def __init__(self, name: str, work: Callable[[T], object], max_bytes: int) -> None:
        self.name = name
        self._work = work
        self.max_bytes = max_bytes
        self._jobs: collections.deque[tuple[T, int]] = collections.deque()
        self._bytes = 0
        self._submitted = 0
        self._done = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, job: T, nbytes: int) -> bool:
        """Queue `job` (about `nbytes`); False, and nothing queued, when full or closed."""
        with self._cond:
            if self._closed or (self._jobs and self._bytes + nbytes > self.max_bytes):
                return False
            self._jobs.append((job, nbytes))
            self._bytes += nbytes
            self._submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs[0]
            try:
                self._work(job)
            except Exception:  # the worker must survive anything one job does
                log.exception("cas_bank: %s job failed", self.name)
            with self._cond:
                self._jobs.popleft()
                self._bytes -= nbytes
                self._done += 1
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the jobs submitted so far are done; False on `timeout`."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._submitted - self._done

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs (up to `timeout`), then stop the worker."""
        self.wait(timeout)
        with self._cond:
            self._closed = True  # the worker still drains what is queued, then stops
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
