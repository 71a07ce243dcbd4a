"""Stores off the request path, measured in the server (`cas-bank serve`'s app).

Three servers of the same model in this process, side by side in one run, each on a
bank of its own: `stores="background"` (the default: the bank's background writer
writes every store), `"inline"` (the prefill's store is written before the first
token is sampled, the answer's before the request ends) and `"off"` (nothing
stored). Each request is a new prompt of `tokens` random ids (nothing to restore),
streamed over HTTP through `/v1/completions`; the client times the first chunk
(TTFT) and the end of the stream (total). Requests run one at a time, the modes
interleaved (background, inline, off, background, ...), and the background writer is
drained (`bank.flush()`, timed as `writer_s`) before the next request, so each request
is measured alone and no mode's request shares the cores with another's store.
`store_on_path_s` is the caller's share of the prefill's store
(`PrefixCache.last_prefill.store_s`): the full write inline, the snapshot and queueing
in the background.

    python -m benchmarks.server_store [--tokens 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from cas_bank.runtime import build_model
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.server import BackgroundServer

from benchmarks.ceilings import median
from cas_bank import Bank

MODES = ("background", "inline", "off")


@dataclass(frozen=True)
class ServerStoreSettings:
    model: str = "tiny-qwen3"
    tokens: int = 4096
    # Requests per mode, the modes taken in a rotated order each round (a 4k prefill of
    # tiny-qwen3: ~4 s here; one request per mode left its TTFT column unreadable, and
    # with 3 one pause in a store's window made the median: 7.3 ms against 1.1 with 7).
    rounds: int = 5
    max_tokens: int = 8


def tiny_settings() -> ServerStoreSettings:
    return ServerStoreSettings(tokens=256, rounds=1, max_tokens=4)


def _request(server: BackgroundServer, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) in seconds of one streamed completion of `prompt`."""
    body = {
        "model": server.engine.model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    first = None
    t0 = time.perf_counter()
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter() - t0
            if line.strip() == "data: [DONE]":
                break
    assert first is not None, "the stream carried no chunk"
    return first, time.perf_counter() - t0


def run(workdir: Path, s: ServerStoreSettings) -> dict[str, Any]:
    lm = build_model(s.model)
    rng = np.random.default_rng(17)
    servers: dict[str, BackgroundServer] = {}
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for mode in MODES:
            bank = Bank.open(workdir / mode)  # default settings: a background writer
            servers[mode] = BackgroundServer(Engine(lm, bank, stores=mode, owns_bank=True)).start()
        for mode in MODES:  # warm-up: first-call costs are no part of any mode
            _request(servers[mode], [int(t) for t in rng.integers(0, 256, 64)], 2)
            servers[mode].engine.bank.flush()
        for r in range(s.rounds):
            for mode in (*MODES[r % len(MODES) :], *MODES[: r % len(MODES)]):
                server = servers[mode]
                prompt = [int(t) for t in rng.integers(0, 256, s.tokens)]
                ttft, total = _request(server, prompt, s.max_tokens)
                report = server.engine.prefix_cache.last_prefill
                t0 = time.perf_counter()
                server.engine.bank.flush()
                samples[mode].append(
                    {
                        "ttft_s": ttft,
                        "total_s": total,
                        "store_on_path_s": report.store_s if report is not None else 0.0,
                        "writer_s": time.perf_counter() - t0,
                    }
                )
        written = {m: servers[m].engine.bank.stats().bytes_written for m in MODES}
    finally:
        for server in servers.values():
            server.stop()
    out: dict[str, Any] = {"settings": asdict(s), "modes": {}}
    for mode in MODES:
        rows = samples[mode]
        out["modes"][mode] = {
            key: median([r[key] for r in rows])
            for key in ("ttft_s", "total_s", "store_on_path_s", "writer_s")
        }
        out["modes"][mode]["bytes_written"] = written[mode]
        out["modes"][mode]["samples"] = rows
    off = out["modes"]["off"]
    for mode in ("background", "inline"):
        m = out["modes"][mode]
        m["ttft_over_off"] = m["ttft_s"] / off["ttft_s"]
        m["total_over_off"] = m["total_s"] / off["total_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=ServerStoreSettings.tokens)
    ap.add_argument("--rounds", type=int, default=ServerStoreSettings.rounds)
    ap.add_argument("--model", default=ServerStoreSettings.model)
    args = ap.parse_args()
    s = ServerStoreSettings(model=args.model, tokens=args.tokens, rounds=args.rounds)
    with tempfile.TemporaryDirectory(prefix="cas_bank_server_store_") as tmp:
        print(json.dumps(run(Path(tmp), s), indent=2))


if __name__ == "__main__":
    main()
