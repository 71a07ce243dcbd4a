"""Sustained load on one shared tier: `clients` processes restore and publish against
one Valkey cluster for `seconds`.

The cluster is seeded with `prompts` prompts of `prompt_blocks` blocks each (distinct,
their KV a function of the prompt's number). Each client process then loops: restore
a random seeded prompt through a read-only bank (so every restore comes from the
cluster: nothing is written locally), check it bit for bit against the KV it must be
(a blake3 digest of the expected arrays), and every `publish_every` restores store a
new prompt of its own in a writable bank (published through the bounded queue).
Reported: restores/s, p50/p99 restore latency, GB/s out of the cluster (payload bytes
fetched), publishes made and dropped by the bounded queue, cluster memory and the
nodes' CPU seconds over the run, restores that were wrong (must be 0) or short.

`python -m benchmarks.remote_load [--clients N] [--seconds S]` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import numpy as np

from benchmarks.remote_setup import bank_config, run_alone
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.remote.local_cluster import LocalCluster

SECRET = "bench fleet secret"
REPO = Path(__file__).resolve().parents[1]  # `python -m benchmarks...` runs from here


@dataclass(frozen=True)
class LoadSettings:
    clients: int = 8
    seconds: float = 60.0
    prompts: int = 64
    prompt_blocks: int = 8
    block_size: int = 64
    publish_every: int = 4  # a store after this many restores
    queue_bytes: int = 16 << 20  # each client's publish queue (remote_queue_bytes)


def short_settings() -> LoadSettings:
    """The `make bench` form: a few seconds."""
    return LoadSettings(clients=4, seconds=4.0, prompts=16)


def tiny_settings() -> LoadSettings:
    return LoadSettings(clients=2, seconds=1.0, prompts=4, prompt_blocks=2)


def spec() -> ModelSpec:
    att = LayerSpec.attention(kv_heads=8, head_dim=64, dtype="float16")  # 8 KiB per token
    return ModelSpec(name="load-attn", layers=(att,) * 4, weights_digest="w-load")


def prompt(k: int, s: LoadSettings) -> list[int]:
    rng = np.random.default_rng(k)
    return [int(t) for t in rng.integers(0, 32000, s.prompt_blocks * s.block_size)]


def layers(k: int, n: int) -> list[Any]:
    """The KV of prompt `k` (any function of `k` will do: prompts share no prefix):
    finite float16 values from random bits (cheap to make)."""
    rng = np.random.default_rng(1_000_000 + k)
    out = []
    for ls in spec().layers:
        arrays = [
            rng.integers(0, 0x7C00, s.with_tokens(n), dtype=np.uint16).view(np.float16)
            for s in ls.arrays
        ]
        out.append(tuple(mx.array(a) for a in arrays))
    return out


def digest(kv: list[Any]) -> str:
    h = blake3.blake3()
    for layer in kv:
        for a in layer:
            h.update(bytes(np.array(a, copy=True).tobytes()))
    return h.hexdigest()


def _config(s: LoadSettings, url: str) -> BankConfig:
    return bank_config(s.block_size, url, remote_queue_bytes=s.queue_bytes)


def client(workdir: Path, url: str, s: LoadSettings, seed: int) -> dict[str, Any]:
    """One client process: prints `ready`, waits for a line, runs, returns its figures."""
    expected = {k: digest(layers(k, s.prompt_blocks * s.block_size)) for k in range(s.prompts)}
    with Bank.open(workdir / "reader", BankConfig(block_size=s.block_size)):
        pass  # an empty bank, reopened read-only: every restore asks the cluster
    reader = Bank.open(workdir / "reader", _config(s, url), mode="read_only")
    writer = Bank.open(workdir / "writer", _config(s, url))
    rng = np.random.default_rng(seed)
    lat: list[float] = []
    wrong = short = stored = 0
    try:
        ns, own = reader.namespace(spec()), writer.namespace(spec())
        ns.restore(prompt(0, s))  # connected, MLX warmed up: the run measures restores
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        while time.monotonic() - t0 < s.seconds:
            k = int(rng.integers(s.prompts))
            t = time.perf_counter()
            hit = ns.restore(prompt(k, s))
            lat.append(time.perf_counter() - t)
            if hit is None or hit.tokens < s.prompt_blocks * s.block_size:
                short += 1
            elif digest(hit.layers) != expected[k]:
                wrong += 1
            if len(lat) % s.publish_every == 0:
                mine = 10_000_000 + seed * 100_000 + stored
                own.store(prompt(mine, s), layers(mine, s.prompt_blocks * s.block_size))
                stored += 1
        elapsed = time.monotonic() - t0
        writer.flush()
        r, w = reader.stats(), writer.stats()
    finally:
        reader.close()
        writer.close()
    return {
        "elapsed_s": elapsed,
        "latencies_s": lat,
        "wrong": wrong,
        "short": short,
        "stores": stored,
        "fetched_bytes": r.remote_bytes_fetched,
        "rejected": r.remote_rejected,
        "errors": r.remote_errors + r.remote_timeouts + w.remote_errors + w.remote_timeouts,
        "published": w.remote_publishes,
        "dropped": w.remote_dropped,
    }


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else 0.0


def _node_cpu(cluster: LocalCluster) -> float:
    total = 0.0
    for node in cluster.nodes:
        with cluster._client(node) as c:
            info = c.info("cpu")
            total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


def _seed(workdir: Path, s: LoadSettings, url: str) -> None:
    with Bank.open(workdir / "seed", _config(s, url)) as bank:
        ns = bank.namespace(spec())
        for k in range(s.prompts):
            ns.store(prompt(k, s), layers(k, s.prompt_blocks * s.block_size))
            bank.flush()


def run(workdir: Path, s: LoadSettings) -> dict[str, Any]:
    """`s.clients` client processes restoring from a 3-node cluster at once: throughput,
    latency, and what the cluster spent."""
    workdir.mkdir(parents=True, exist_ok=True)
    with LocalCluster(3) as cluster:
        _seed(workdir, s, cluster.url())
        procs = [_client(workdir, s, cluster.url(i % 3), i) for i in range(s.clients)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        cpu0 = _node_cpu(cluster)
        t0 = time.monotonic()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            stdout, _ = p.communicate(timeout=s.seconds + 120)
            assert p.returncode == 0, f"a load client failed (exit {p.returncode})"
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
        wall = time.monotonic() - t0
        cpu = _node_cpu(cluster) - cpu0
        cluster_figures = {
            "cluster_used_memory": cluster.used_memory(),
            "cluster_keys": len(cluster.all_keys()),
            "cluster_cpu_s": cpu,
            "cluster_cpu_share": cpu / wall,
        }
    return {**_client_figures(s, outs), **cluster_figures}


def _client(workdir: Path, s: LoadSettings, url: str, i: int) -> subprocess.Popen[str]:
    """Load client `i` (this module's `--client`), waiting for "go" on its stdin."""
    argv = [sys.executable, "-m", "benchmarks.remote_load", "--client", str(workdir / f"c{i}")]
    return subprocess.Popen(
        [*argv, url, json.dumps(asdict(s)), str(i)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _client_figures(s: LoadSettings, outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The clients' reports summed: restores, their latency, what was stored and lost."""
    lat = [x for o in outs for x in o["latencies_s"]]
    elapsed = max(o["elapsed_s"] for o in outs)
    fetched = sum(o["fetched_bytes"] for o in outs)
    counted = ("stores", "published", "wrong", "short", "rejected", "errors")
    return {
        "settings": asdict(s),
        "restores": len(lat),
        "restores_per_s": len(lat) / elapsed,
        "p50_s": _percentile(lat, 50),
        "p99_s": _percentile(lat, 99),
        "gb_per_s_out": fetched / elapsed / 1e9,
        **{k: sum(o[k] for o in outs) for k in counted},
        "publishes_dropped": sum(o["dropped"] for o in outs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sustained-load benchmark alone and print its figures as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--client":
        workdir, url, settings, seed = argv[1:5]
        s = LoadSettings(**json.loads(settings))
        res = client(Path(workdir), url, s, int(seed))
        print(json.dumps(res))
        return res
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote_load", description=main.__doc__)
    p.add_argument("--clients", type=int, default=LoadSettings.clients)
    p.add_argument("--seconds", type=float, default=LoadSettings.seconds)
    p.add_argument("--short", action="store_true", help="the make bench form (a few seconds)")
    args = p.parse_args(argv)
    s = short_settings() if args.short else LoadSettings(clients=args.clients, seconds=args.seconds)
    return run_alone(run, s, "cas_bank_load_")


if __name__ == "__main__":
    main()
