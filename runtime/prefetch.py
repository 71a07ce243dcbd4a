"""`Prefetcher`: while the engine's worker serves one request, the prefixes of the
requests queued behind it are fetched from the shared tier into the local bank, so
that by their turn the restore is local (as SGLang's HiCache and LMCache prefetch a
queued request's prefix while the GPU is busy).

One background thread, a bounded queue (a request that finds it full is not
prefetched: its restore asks the cluster itself, as without a prefetcher). Nothing
here touches the model or MLX's streams: the fetched payloads are verified and
written into the bank (`RemoteTier.prefetch`); the restore on the worker reads them
like any local block. A prefetch still under way when the request's turn comes costs
nothing but the bytes: the restore fetches what is not local yet.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from .prefix_cache import PrefixCache

log = logging.getLogger("cas_bank.runtime")

MAX_QUEUED = 16


class Prefetcher:
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self._jobs: queue.Queue[tuple[PrefixCache, Sequence[int]] | None] = queue.Queue(max_queued)
        self.requests = 0  # prefetches run
        self.blocks = 0  # blocks they wrote into the local bank
        self.dropped = 0  # requests not prefetched: the queue was full
        self.failed = 0  # prefetches that raised (logged)
        self._thread = threading.Thread(target=self._run, name="cas-bank-prefetch", daemon=True)
        self._thread.start()

    def submit(self, pc: PrefixCache, prompt: Sequence[int]) -> bool:
        """Queue a prefetch of `prompt`'s prefix (for `pc`'s namespace); False if full."""
        try:
            self._jobs.put_nowait((pc, prompt))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self.blocks += prefetch_prompt(*job)
                self.requests += 1
            except Exception:  # a prefetch is an optimisation: it never fails a request
                self.failed += 1
                log.exception("cas_bank: a prefetch failed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the prefetch under way (queued ones are dropped)."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(timeout)


def prefetch_prompt(pc: PrefixCache, prompt: Sequence[int]) -> int:
    """Fetch what the shared tier holds of `prompt`'s chain beyond the local bank into
    the local bank; the blocks written (0 without a shared tier)."""
    remote = pc.bank.remote
    if remote is None or pc.bank.read_only:
        return 0
    toks = pc.tokens(prompt)
    return remote.prefetch(pc.namespace, toks, pc.namespace.chain(toks))
