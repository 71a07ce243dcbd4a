"""Prefetch: a request queued while the engine's worker is busy has its prefix fetched
from the shared tier into the local bank meanwhile, so its restore on its turn is
local (no remote hit), and its answer is the same as without a prefetch."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest, GenerationResult
from conftest import remote_config
from runtime_helpers import random_tokens, tiny

from cas_bank import Bank

BLOCK = 16


def _serve_behind_a_busy_worker(
    cluster: Any, tmp_path: Path, prompt: list[int], prefetch: bool
) -> tuple[GenerationResult, Bank, Engine]:
    lm = tiny("tiny-qwen3")
    bank = Bank.open(tmp_path / f"b{prefetch}", remote_config(cluster.url(1), block_size=BLOCK))
    engine = Engine(lm, bank, prefetch=prefetch)
    release = threading.Event()

    def busy(event: Any) -> None:  # runs on the worker: keeps it busy until released
        release.wait(30)

    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    engine.submit(GenerationRequest(prompt=[1, 2, 3], max_tokens=1), busy)
    while not engine.stats().busy:
        time.sleep(0.01)
    engine.submit(GenerationRequest(prompt=prompt, max_tokens=2), results.put)
    deadline = time.monotonic() + 30
    while prefetch and engine.prefetcher.requests < 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    release.set()
    while not isinstance(got := results.get(timeout=60), GenerationResult):
        pass
    return got, bank, engine


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_queued_request_finds_its_prefix_local(
    cluster: Any, tmp_path: Path, prefetch: bool
) -> None:
    prompt = random_tokens(np.random.default_rng(9), 6 * BLOCK + 5)
    with Bank.open(tmp_path / "a", remote_config(cluster.url(0), block_size=BLOCK)) as a:
        pc = PrefixCache(a, tiny("tiny-qwen3"), chunk_size=BLOCK)
        cache, n = pc.restore(prompt)
        pc.prefill(prompt, cache, n, end=True)
        a.flush()
        got, bank, engine = _serve_behind_a_busy_worker(cluster, tmp_path, prompt, prefetch)
        try:
            s = bank.stats()
            assert got.cached_tokens == len(prompt)  # every token, end record included
            es = engine.stats()  # what /metrics shows (cas_bank_prefetch*_total)
            if prefetch:
                assert engine.prefetcher is not None and engine.prefetcher.blocks == 6
                assert (es.prefetches, es.prefetched_blocks, es.prefetches_failed) == (1, 6, 0)
                assert s.remote_hits == 0  # the restore on its turn was local
            else:
                assert (es.prefetches, es.prefetched_blocks) == (0, 0)
                assert s.remote_hits == 1 and s.remote_hit_blocks == 6
        finally:
            engine.close()
            bank.close()
