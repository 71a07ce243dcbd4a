"""The first token through `cas-bank serve` (`benchmarks.first_token`'s serve ways).

The server's app runs in this process (`BackgroundServer` around an `Engine` of the
very LoadedModel the layout's prefix was stored with, so its namespace is the same and
it restores that prefix), and each request is a token-id prompt streamed through
`/v1/completions`, greedy; the client times the first chunk (TTFT: the HTTP request,
the engine's queue, its restore, the prefill of the rest with its store queued for
the background writer, the sampling, the chunk back). `usage` (`include_usage`) says
how many prompt tokens the server restored (`cached_tokens`); the engine's own result
(its queue wait and its time to the first token, restore and prefill) is read off
its sink, so `http_s`, the TTFT but for the engine's, is the HTTP and event-loop
share. The client (`httpx.Client`) is made before the clock starts, as an agent's is,
and each request opens its own connection. (Runs before the server's listening socket
named TCP, so that asyncio turned Nagle's algorithm off on its connections, saw every
request after the first on a kept-alive connection stall ~40 ms for a delayed ACK.)

- (a) another agent: the server on the bank the prefix was stored into by the
  library (`PrefixCache.store`, before the server started); the request is the
  prefix and one new token, `max_tokens=1`.
- (b) the next turn: turn 1 (the prefix and one new token) goes through the same
  engine untimed (`Engine.generate`, greedy, end tokens banned so the answer is
  `answer_tokens` long); the engine stores prompt + answer with its end record, as it
  does after every request, and the writer is drained (the user reads the answer);
  the request is turn 1's prompt, the server's answer and `new_tokens` new tokens.
  The server restores all that went through the model (prompt + answer but its last
  token, which was sampled and never passed), so it prefills `new_tokens + 1`.
- (c) after a restart: a fresh server (a new `Engine` on `Bank.open` of the same
  directory; its start and stop untimed, and idle until the bank's open-time work is
  done) for each request, the prefix and one token.

What it costs at default sizes (2 cores): (a) and (c) a single-token pass per request
(0.1-0.5 s on the medium models at 4k); (b) per round, turn 1's 16 tokens (one pass
each) and one pass of 65 tokens (5-26 s on the medium models), so (b) runs
`serve_turn_rounds` (1) rounds only; a server start is ~0.1 s, untimed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from cas_bank.runtime import LoadedModel
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import Event, GenerationRequest, GenerationResult, Sink
from cas_bank.runtime.server import BackgroundServer

from cas_bank import Bank


@dataclass
class Served:
    """A running server, and the engine's results of its requests (read off their sinks)."""

    server: BackgroundServer
    results: list[GenerationResult] = field(default_factory=list)

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def stop(self) -> None:
        self.server.stop()  # closes the engine (and the bank if it owns it)


def start_server(lm: LoadedModel, bank: Bank, *, owns_bank: bool = False) -> Served:
    """`cas-bank serve`'s app on `bank` (the defaults: background stores, end records)."""
    engine = Engine(lm, bank, owns_bank=owns_bank)
    served = Served(BackgroundServer(engine))
    submit = engine.submit

    def watched(request: GenerationRequest, sink: Sink) -> Any:
        def tee(event: Event) -> None:
            if isinstance(event, GenerationResult):
                served.results.append(event)
            sink(event)

        return submit(request, tee)

    engine.submit = watched  # type: ignore[method-assign]
    served.server.start()
    return served


def _post(served: Served, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: TTFT (first chunk), total, and the usage."""
    server = served.server
    body = {
        "model": server.engine.model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, usage = None, None
    with httpx.Client(timeout=600) as client:  # made before the clock starts
        t0 = time.perf_counter()
        with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                usage = json.loads(data).get("usage") or usage
        total = time.perf_counter() - t0
    if first is None or usage is None:
        raise RuntimeError("the stream carried no chunk or no usage")
    return {"ttft_s": first, "total_s": total, "usage": usage}


def serve_way(served: Served, request: np.ndarray) -> dict[str, Any]:
    """A request through the server: its first token (`max_tokens=1`). `own_s`: the
    TTFT but for the prefill's forward pass (HTTP, queue, restore, store's snapshot,
    sampling); `engine_s`: the engine's queue wait and time to the first token, in
    parts (`queue_s`, `restore_s`: the bank's restore clock over the request,
    `forward_s`, `store_s`, `engine_rest_s`); `http_s`: the TTFT but for the engine's."""
    engine = served.engine
    hits = engine.bank.stats().hot_hits
    restoring = engine.bank.restore_times().total_s
    before = len(served.results)
    got = _post(served, [int(t) for t in request], 1)
    restore = engine.bank.restore_times().total_s - restoring
    rep = engine.prefix_cache.last_prefill
    cached = int(got["usage"]["prompt_tokens_details"]["cached_tokens"])
    forward = rep.forward_s if rep is not None else 0.0
    result = served.results[-1] if len(served.results) > before else None
    queue = result.queue_s if result is not None else float("nan")
    engine_s = queue + result.ttft_s if result is not None else float("nan")
    store = rep.store_s if rep is not None else 0.0
    return {
        "ttft_s": got["ttft_s"],
        "total_s": got["total_s"],
        "own_s": got["ttft_s"] - forward,
        "engine_s": engine_s,
        "http_s": got["ttft_s"] - engine_s,
        "queue_s": queue,
        "restore_s": restore,
        "forward_s": forward,
        "store_s": store,
        # the engine's time but for its queue, restore, forward pass and store's share:
        # the end-record lookup, the sampler, the first token's text, the thread hops
        "engine_rest_s": engine_s - queue - restore - forward - store,
        "hot_hits": engine.bank.stats().hot_hits - hits,
        "restored": cached,
        "prefilled": len(request) - cached,
    }


def restarted_way(lm: LoadedModel, path: Path, request: np.ndarray) -> dict[str, Any]:
    """(c): a fresh server on the bank at `path` (start and stop untimed), one request.
    The server is idle when the request comes, as a restarted one would be: what the
    bank's open sets off (its spare restore destinations) is done first; without that
    the restore of 100 MB here took 2-4x longer (the destinations were still being made
    on the other core). The first request of a new engine still pays its first-call
    costs (its worker thread's first pass and sampler, uvicorn's first request)."""
    served = start_server(lm, Bank.open(path), owns_bank=True)
    served.engine.bank.resources.settle()
    try:
        return serve_way(served, request)
    finally:
        served.engine.bank.resources.settle()
        served.stop()  # closes the engine and its bank (the writer drained)


def server_answer(served: Served, prompt: np.ndarray, tokens: int) -> np.ndarray:
    """(b)'s turn 1 through the server's engine, untimed: its greedy answer of `tokens`
    tokens (end tokens banned), stored by the engine with its end record; the writer
    drained before the next turn, as a user's reading time would."""
    engine = served.engine
    ban = {int(t): -100.0 for t in engine.eos_ids if 0 <= int(t) < engine.prefix_cache.vocab_size}
    result = engine.generate(
        GenerationRequest(
            prompt=[int(t) for t in prompt],
            max_tokens=tokens,
            temperature=0.0,
            logit_bias=ban or None,
        )
    )
    engine.bank.flush()
    return np.asarray(result.token_ids, dtype=prompt.dtype)
