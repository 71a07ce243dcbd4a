"""Read-ahead: one background thread calls a function on items in order, a bounded
number of results ahead of the consumer.

A restore reads payloads one by one. rocksdict's `get` holds the GIL, but blake3 and
`np.copyto` release it, so reading block i+1 on another thread while the consumer
verifies and copies block i overlaps the two (measured in benchmarks/bench_capacity.py
and benchmarks/bench_core.py). The depth bound keeps memory at a block or two beyond
what the consumer holds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from typing import Generic, TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")

READ_AHEAD_FROM = 256 * 1024  # bytes per item; below, the thread costs more than it hides


def worth_reading_ahead(sizes: Sequence[int]) -> bool:
    """Whether items of these sizes (bytes) are enough, and large enough, to read ahead."""
    return len(sizes) >= 2 and sum(sizes) >= READ_AHEAD_FROM * len(sizes)


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
