"""A circuit breaker: after `failures` failures in a row the tier is not asked for
`retry_after` seconds; then one call is let through (half-open) and its outcome
closes the breaker again or re-opens it. Thread-safe."""

from __future__ import annotations

import threading
import time


class Breaker:
    def __init__(self, failures: int = 2, retry_after: float = 5.0) -> None:
        self.failures = failures
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._count = 0
        self._open_until = 0.0
        self._trial = False

    def allow(self) -> bool:
        """Whether a call may go out now."""
        with self._lock:
            if self._count < self.failures:
                return True
            now = time.monotonic()
            if now < self._open_until or self._trial:
                return False
            self._trial = True  # half-open: this one call decides
            return True

    def success(self) -> None:
        with self._lock:
            self._count = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._count += 1
            self._trial = False
            if self._count >= self.failures:
                self._open_until = time.monotonic() + self.retry_after

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._count >= self.failures
