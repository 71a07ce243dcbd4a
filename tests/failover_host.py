"""One host of the failover test, as its own process (`python failover_host.py DIR URL
SEED RUNS`): prints `ready`; then for each of RUNS runs, reads a number of seconds from
stdin and for that long restores the shared prompts (`shared_prompt(k)`, each once,
in its own order) from an empty bank (DIR/run<i>) and stores a prompt of its own after
each. Every restore is checked bit for bit; each run prints a JSON line: tokens asked
and restored, requests that fell back to prefill (restored less than the prompt),
wrong restores, exceptions, reads a replica answered and when the last one was.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import numpy as np
from conftest import attention_spec, kv_prefix_bits, layers_bits, prefix_layers, remote_config

from cas_bank import Bank

BLOCK = 4
PROMPT_BLOCKS = 6
SHARED = 200  # prompts in the cluster before the run
TICK = 0.02  # seconds between a host's restores


def shared_prompt(k: int) -> list[int]:
    rng = np.random.default_rng(1000 + k)
    return [int(t) for t in rng.integers(0, 1000, PROMPT_BLOCKS * BLOCK)]


def main(bank_dir: str, url: str, seconds: float, seed: int) -> dict[str, Any]:
    spec = attention_spec()
    out: dict[str, Any] = dict(asked=0, restored=0, requests=0, fell_back=0, wrong=0, errors=[])
    out.update(took=[], last_replica_read=None)
    order = np.random.default_rng(seed).permutation(SHARED)
    own = np.random.default_rng(10_000 + seed)
    with Bank.open(bank_dir, remote_config(url, block_size=BLOCK)) as bank:
        ns = bank.namespace(spec)
        t0 = time.monotonic()
        for n, k in enumerate(order):
            if time.monotonic() - t0 > seconds:
                break
            toks = shared_prompt(int(k))
            before, started = bank.remote.client.replica_reads, time.monotonic()  # type: ignore[union-attr]
            try:
                hit = ns.restore(toks)
                got = 0 if hit is None else hit.tokens
                if hit is not None and layers_bits(hit.layers, spec) != kv_prefix_bits(
                    prefix_layers(spec, toks), spec, got
                ):
                    out["wrong"] += 1
                mine = [int(t) for t in own.integers(0, 1000, PROMPT_BLOCKS * BLOCK)]
                ns.store(mine, prefix_layers(spec, mine))  # a publish, during the run too
            except Exception:
                out["errors"].append(traceback.format_exc())
                continue
            out["requests"] += 1
            out["asked"] += len(toks)
            out["restored"] += got
            out["fell_back"] += got < len(toks)
            out["took"].append(round(time.monotonic() - started, 4))
            if bank.remote.client.replica_reads > before:  # type: ignore[union-attr]
                out["last_replica_read"] = round(started - t0, 3)
            time.sleep(max(0.0, t0 + (n + 1) * TICK - time.monotonic()))
        bank.flush()
        client = bank.remote.client  # type: ignore[union-attr]
        out["replica_reads"] = client.replica_reads
        out["stats"] = bank.stats().model_dump()
    return out


if __name__ == "__main__":
    directory, url, seed, runs = sys.argv[1:5]
    print("ready", flush=True)
    for run in range(int(runs)):
        seconds = float(sys.stdin.readline())
        result = main(f"{directory}/run{run}", url, seconds, int(seed))
        print(json.dumps(result), flush=True)
