"""The shared tier at a network's latency: a delaying proxy in front of every Valkey
node (`LocalCluster(rtt=...)`, `cas_bank.remote.delay`, 127.0.0.1 only).

At each added round-trip time (`rtts`): the round trip a client measures (median GET),
then for each prompt length (`tokens`) a restore from the local bank (hot tier off),
from the cluster into an empty bank (the round trips it took, counted by the client),
and cold prefill (no network: measured once, for `cold_tokens`; the KV restored is
synthetic, stored without a prefill); then one master paused (SIGSTOP: it
stops answering) and the first restore after it (it waits for the read time-out) and
the next one (the node's breaker skips it).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache, build_model

from benchmarks.ceilings import median
from benchmarks.remote_setup import bank_config, run_alone
from benchmarks.restore import synthetic_cache
from benchmarks.ttft import PREFILL_STEP
from cas_bank import Bank
from cas_bank.remote.local_cluster import LocalCluster


@dataclass(frozen=True)
class RttSettings:
    rtts: tuple[float, ...] = (0.0, 0.0005, 0.002)  # seconds the proxy adds per round trip
    tokens: tuple[int, ...] = (2048, 16384)
    cold_tokens: tuple[int, ...] = (2048,)  # cold prefill of 16k takes minutes on 2 cores
    repeats: int = 3
    model: str = "tiny-qwen3"
    block_size: int = 64


def tiny_settings() -> RttSettings:
    return RttSettings(rtts=(0.0, 0.002), tokens=(256,), cold_tokens=(256,), repeats=1)


def _prompt(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n + 1).astype(np.uint32)


def _measured_rtt(cluster: LocalCluster) -> float:
    import valkey

    with valkey.ValkeyCluster.from_url(cluster.url()) as c:
        c.set("rtt-probe", b"x")
        times = []
        for _ in range(30):
            t = time.perf_counter()
            c.get("rtt-probe")
            times.append(time.perf_counter() - t)
        c.delete("rtt-probe")
    return median(times)


def _cold(workdir: Path, s: RttSettings, lm: Any, n: int) -> float:
    prompt = _prompt(n)
    times = []
    for _ in range(s.repeats):
        with Bank.open(workdir / f"cold{n}", bank_config(s.block_size, None)) as bank:
            pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
            cache, _ = pc.restore(prompt[:1])
            t = time.perf_counter()
            mx.eval(pc.prefill(prompt[:-1], cache, store=False))
            times.append(time.perf_counter() - t)
    return median(times)


def _restores(workdir: Path, s: RttSettings, lm: Any, url: str, n: int) -> dict[str, Any]:
    prompt = _prompt(n)
    with Bank.open(workdir / f"source{n}", bank_config(s.block_size, url)) as src:
        pc = PrefixCache(src, lm, chunk_size=PREFILL_STEP)
        cache, states = synthetic_cache(pc, n, np.random.default_rng(n))  # no prefill
        pc.store(prompt[:-1], cache, states, end=False)
        src.flush()
        local = []
        for _ in range(s.repeats):
            t = time.perf_counter()
            _, got = pc.restore(prompt)
            local.append(time.perf_counter() - t)
        assert got == n, got
    cluster, trips, fetched = [], [], 0
    for r in range(s.repeats):
        with Bank.open(workdir / f"empty{n}-{r}", bank_config(s.block_size, url)) as empty:
            pc = PrefixCache(empty, lm, chunk_size=PREFILL_STEP)
            pc.restore(np.arange(2 * s.block_size, dtype=np.uint32))  # connects (a miss)
            client = empty.remote.client  # type: ignore[union-attr]
            before = client.round_trips
            t = time.perf_counter()
            _, got = pc.restore(prompt)
            cluster.append(time.perf_counter() - t)
            trips.append(client.round_trips - before)
            assert got == n, got
            st = empty.stats()
            assert st.remote_rejected == 0
            fetched = st.remote_bytes_fetched
    return {
        "local_s": median(local),
        "cluster_s": median(cluster),
        "round_trips": max(trips),
        "fetched_bytes": fetched,
    }


def _breaker(workdir: Path, s: RttSettings, lm: Any, cluster: LocalCluster) -> dict[str, Any]:
    """One master stops answering: the first restore waits for the read time-out, the
    next is answered at once (its breaker skips the node; the chain stops before it)."""
    n = s.tokens[0]
    prompt = _prompt(n)
    with Bank.open(workdir / "breaker", bank_config(s.block_size, cluster.url(1))) as bank:
        pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
        pc.restore(np.arange(2 * s.block_size, dtype=np.uint32))  # connects
        cluster.pause(0)
        try:
            times = []
            for _ in range(2):
                t = time.perf_counter()
                pc.restore(prompt)
                times.append(time.perf_counter() - t)
        finally:
            cluster.resume(0)
        return {
            "first_s": times[0],
            "next_s": times[1],
            "remote_timeout_setting_s": bank.config.remote_timeout,
        }


def run(workdir: Path, s: RttSettings) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    lm = build_model(s.model)
    cold = {n: _cold(workdir, s, lm, n) for n in s.cold_tokens}
    out: list[dict[str, Any]] = []
    for rtt in s.rtts:
        with LocalCluster(3, rtt=rtt) as cluster:
            row: dict[str, Any] = {"added_rtt_s": rtt, "measured_rtt_s": _measured_rtt(cluster)}
            sub = workdir / f"rtt{rtt}"
            for n in s.tokens:
                row[str(n)] = {
                    **_restores(sub, s, lm, cluster.url(), n),
                    "cold_prefill_s": cold.get(n),
                }
            row["breaker"] = _breaker(sub, s, lm, cluster)
        out.append(row)
    return {"settings": asdict(s), "by_rtt": out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the latency benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote_rtt", description=main.__doc__)
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    args = p.parse_args(argv)
    s = tiny_settings() if args.tiny else RttSettings()
    return run_alone(run, s, "cas_bank_rtt_")


if __name__ == "__main__":
    main()
