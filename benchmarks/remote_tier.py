"""The shared tier, side by side: a fleet of hosts on one real Valkey cluster.

1. Cross-host hit rate: `hosts` banks (one per host, one process here, one model)
   serve `agents` agents sharing a system prompt for `turns` turns; each turn every
   agent lands on another host (agent a, turn t -> host (a + t) mod hosts). The same
   traffic is served twice: hosts alone (no shared tier) and hosts sharing the cluster.
2. One prefix of `restore_tokens`, restored three ways, medians of `repeats`: from the
   local bank (RocksDB, hot tier off), from the cluster into an empty bank, and by
   cold prefill (the forward pass a miss costs).
3. Cluster bytes (MEMORY USAGE of every key, after the fleet) against the lower
   bound: every distinct token's KV once (system prompt once, each agent's own
   tokens once, full blocks only) at its raw size.
4. Latency a request gains when the cluster is down (every master paused, SIGSTOP):
   the first request waits for the read time-out, later ones are answered by the
   breakers at once; against the same restore with no shared tier configured.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache, build_model

from benchmarks.ceilings import median
from benchmarks.remote_setup import bank_config, run_alone
from benchmarks.ttft import PREFILL_STEP
from cas_bank import Bank
from cas_bank.remote.local_cluster import LocalCluster


@dataclass(frozen=True)
class RemoteSettings:
    hosts: int = 3
    agents: int = 12
    turns: int = 3
    system_tokens: int = 1024
    distinct_tokens: int = 128
    restore_tokens: int = 2048
    repeats: int = 5
    model: str = "tiny-qwen3"
    block_size: int = 64


def tiny_settings() -> RemoteSettings:
    return RemoteSettings(
        hosts=2, agents=2, turns=2, system_tokens=128, distinct_tokens=64,
        restore_tokens=256, repeats=2,
    )  # fmt: skip


def _fleet(
    workdir: Path, s: RemoteSettings, lm: Any, url: str | None, prompts: list[list[np.ndarray]]
) -> dict[str, Any]:
    config = bank_config(s.block_size, url)
    banks = [Bank.open(workdir / f"host{h}", config) for h in range(s.hosts)]
    try:
        caches = [PrefixCache(b, lm, chunk_size=PREFILL_STEP) for b in banks]
        queried = restored = 0
        for turn in range(s.turns):
            for a in range(s.agents):
                pc = caches[(a + turn) % s.hosts]
                prompt = prompts[a][turn]
                cache, n = pc.restore(prompt)
                pc.prefill(prompt, cache, start=n)
                queried += len(prompt) - 1  # restore looks up all but the last token
                restored += n
            for b in banks:  # between turns: publishes out (a user reads the answer)
                b.flush()
        stats = [b.stats() for b in banks]
    finally:
        for b in banks:
            b.close()
    return {
        "hit_rate": restored / queried,
        "restored_tokens": restored,
        "queried_tokens": queried,
        "remote_hit_tokens": sum(x.remote_hit_tokens for x in stats),
        "published": sum(x.remote_publishes for x in stats),
        "errors": sum(x.remote_errors + x.remote_timeouts for x in stats),
        "rejected": sum(x.remote_rejected for x in stats),
    }


def _restore_ways(workdir: Path, s: RemoteSettings, lm: Any, url: str) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, s.restore_tokens + 1).astype(np.uint32)
    with Bank.open(workdir / "source", bank_config(s.block_size, url)) as src:
        pc = PrefixCache(src, lm, chunk_size=PREFILL_STEP)
        cache, _ = pc.restore(prompt)
        pc.prefill(prompt, cache)
        src.flush()
        local = []
        for _ in range(s.repeats):
            t = time.perf_counter()
            _, n = pc.restore(prompt)
            local.append(time.perf_counter() - t)
        assert n == s.restore_tokens
    cluster = []
    for r in range(s.repeats):
        with Bank.open(workdir / f"empty{r}", bank_config(s.block_size, url)) as empty:
            pc = PrefixCache(empty, lm, chunk_size=PREFILL_STEP)
            pc.restore(np.arange(2 * s.block_size, dtype=np.uint32))  # connects (a miss)
            t = time.perf_counter()
            _, n = pc.restore(prompt)
            cluster.append(time.perf_counter() - t)
            assert n == s.restore_tokens, n
    cold = []
    for _ in range(s.repeats):
        with Bank.open(workdir / "cold", bank_config(s.block_size, None)) as bank:
            pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
            cache, _ = pc.restore(prompt[:1])
            t = time.perf_counter()
            logits = pc.prefill(prompt[:-1], cache, store=False)
            mx.eval(logits)
            cold.append(time.perf_counter() - t)
    return {
        "tokens": s.restore_tokens,
        "local_s": median(local),
        "cluster_s": median(cluster),
        "cold_prefill_s": median(cold),
    }


def _down(workdir: Path, s: RemoteSettings, lm: Any, cluster: LocalCluster) -> dict[str, Any]:
    """Added latency with every master paused, against no shared tier at all."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 256, s.restore_tokens + 1).astype(np.uint32)
    longer = np.concatenate([prompt, rng.integers(0, 256, 4 * s.block_size).astype(np.uint32)])
    out: dict[str, Any] = {}
    for name, url in (("no_remote", None), ("down", cluster.url())):
        with Bank.open(workdir / f"down-{name}", bank_config(s.block_size, url)) as bank:
            pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
            cache, _ = pc.restore(prompt)
            pc.prefill(prompt, cache)
            bank.flush()
            pc.restore(longer)  # connected, the cluster up
            if url:
                for i in range(len(cluster.nodes)):
                    cluster.pause(i)
            times = []
            try:
                for _ in range(max(9, s.repeats)):
                    t = time.perf_counter()
                    _, n = pc.restore(longer)  # its tail is asked of the cluster
                    times.append(time.perf_counter() - t)
                    assert n == len(prompt)  # the blocks and the prompt's end record
            finally:
                for i in range(len(cluster.nodes)):
                    cluster.resume(i)
            out[name] = {"first_s": times[0], "later_median_s": median(times[1:])}
            if url:
                st = bank.stats()
                out["timeouts"], out["skipped"] = st.remote_timeouts, st.remote_skipped
                out["remote_timeout_setting_s"] = bank.config.remote_timeout
    out["added_first_s"] = out["down"]["first_s"] - out["no_remote"]["first_s"]
    out["added_later_s"] = out["down"]["later_median_s"] - out["no_remote"]["later_median_s"]
    return out


def run(workdir: Path, s: RemoteSettings) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    lm = build_model(s.model)
    rng = np.random.default_rng(2026)
    system = rng.integers(0, 256, s.system_tokens).astype(np.uint32)
    prompts: list[list[np.ndarray]] = []
    for _ in range(s.agents):
        turns, history = [], system
        for _ in range(s.turns):
            history = np.concatenate(
                [history, rng.integers(0, 256, s.distinct_tokens).astype(np.uint32)]
            )
            turns.append(history)
        prompts.append(turns)
    with LocalCluster(3) as cluster:
        alone = _fleet(workdir / "alone", s, lm, None, prompts)
        shared = _fleet(workdir / "shared", s, lm, cluster.url(), prompts)
        held = cluster.memory_usage()
        values = cluster.value_bytes()
        with Bank.open(workdir / "probe", bank_config(s.block_size, None)) as probe:
            spec = PrefixCache(probe, lm).spec
        bs = s.block_size
        distinct_blocks = s.system_tokens // bs + s.agents * (
            (s.system_tokens + s.turns * s.distinct_tokens) // bs - s.system_tokens // bs
        )
        lower = distinct_blocks * bs * spec.token_bytes
        cluster.flushall()
        restore = _restore_ways(workdir / "restore", s, lm, cluster.url())
        down = _down(workdir / "down", s, lm, cluster)
    return {
        "settings": asdict(s),
        "fleet": {"hosts_alone": alone, "hosts_sharing_cluster": shared},
        "cluster_bytes": {
            "memory_usage": held,
            "value_bytes": values,
            "lower_bound": lower,
            "ratio_to_lower_bound": held / lower,
        },
        "restore": restore,
        "cluster_down": down,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the shared-tier benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote_tier", description=main.__doc__)
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    args = p.parse_args(argv)
    s = tiny_settings() if args.tiny else RemoteSettings()
    return run_alone(run, s, "cas_bank_remote_")


if __name__ == "__main__":
    main()
