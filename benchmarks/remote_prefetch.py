"""Prefetch in the server's queue: time to first token of cluster-sourced requests
queued behind a busy worker, with the prefetch on and off.

Host a stores `clients - 1` prompts of `tokens` tokens (synthetic KV) into a 3-master
cluster (`rtt` added per round trip by the delaying proxy). Host b runs an `Engine`
(one worker) on an empty bank; `clients` threads submit at once: the first a cold
prompt of `busy_tokens` tokens (the worker prefills it: busy), the others one stored
prompt each (max_tokens=1). The cluster is emptied and seeded again for each mode.
Reported per mode: the worker's time to first token of the
cluster-sourced requests (restore + the last tokens' prefill + sampling; median), the
time from submit to first token, and what the restores took from the cluster.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cas_bank.runtime import PrefixCache, build_model
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest, GenerationResult

from benchmarks.ceilings import median
from benchmarks.remote_setup import bank_config, run_alone
from benchmarks.restore import synthetic_cache
from cas_bank import Bank
from cas_bank.remote.local_cluster import LocalCluster


@dataclass(frozen=True)
class PrefetchSettings:
    clients: int = 4
    tokens: int = 8192
    busy_tokens: int = 2048
    rtt: float = 0.0005
    model: str = "tiny-qwen3"
    block_size: int = 64


def tiny_settings() -> PrefetchSettings:
    return PrefetchSettings(tokens=256, busy_tokens=512, rtt=0.0)


def _prompt(i: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + i).integers(0, 256, n)]


def _serve(workdir: Path, s: PrefetchSettings, lm: Any, url: str, prefetch: bool) -> dict[str, Any]:
    with Bank.open(workdir / f"host-b-{prefetch}", bank_config(s.block_size, url)) as bank:
        engine = Engine(lm, bank, prefetch=prefetch)
        try:
            prompts = [_prompt(-1, s.busy_tokens)] + [
                _prompt(i, s.tokens + 3) for i in range(s.clients - 1)
            ]
            out: list[tuple[float, GenerationResult] | None] = [None] * len(prompts)

            def client(i: int) -> None:
                t = time.perf_counter()
                max_tokens = 8 if i == 0 else 1
                r = engine.generate(GenerationRequest(prompt=prompts[i], max_tokens=max_tokens))
                out[i] = (t, r)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
            for i, th in enumerate(threads):
                th.start()
                if i == 0:
                    while not engine.stats().busy:  # the busy request first
                        time.sleep(0.001)
            for th in threads:
                th.join()
            rows = [x for x in out[1:] if x is not None]
            st = bank.stats()
            prefetched = engine.prefetcher.blocks if engine.prefetcher is not None else 0
        finally:
            engine.close()
    return {
        "ttft_s": median([r.ttft_s for _, r in rows]),
        "submit_to_first_token_s": median([r.queue_s + r.ttft_s for _, r in rows]),
        "cached_tokens": [r.cached_tokens for _, r in rows],
        "remote_hit_blocks": st.remote_hit_blocks,
        "prefetched_blocks": prefetched,
    }


def run(workdir: Path, s: PrefetchSettings) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    lm = build_model(s.model)
    out: dict[str, Any] = {"settings": asdict(s)}
    with LocalCluster(3, rtt=s.rtt) as cluster:
        for prefetch in (False, True):
            cluster.flushall()  # what host b stored in the last mode is gone again
            config = bank_config(s.block_size, cluster.url(0))
            with Bank.open(workdir / f"host-a-{prefetch}", config) as a:
                pc = PrefixCache(a, lm)
                for i in range(s.clients - 1):
                    cache, states = synthetic_cache(pc, s.tokens, np.random.default_rng(i))
                    pc.store(_prompt(i, s.tokens), cache, states, end=False)
                a.flush()
            name = "prefetch_on" if prefetch else "prefetch_off"
            out[name] = _serve(workdir, s, lm, cluster.url(1), prefetch=prefetch)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the prefetch benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.remote_prefetch", description=main.__doc__
    )
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    args = p.parse_args(argv)
    s = tiny_settings() if args.tiny else PrefetchSettings()
    return run_alone(run, s, "cas_bank_prefetch_")


if __name__ == "__main__":
    main()
