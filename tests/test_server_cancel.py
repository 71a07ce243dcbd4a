"""A long prefill stops when nobody waits for it: a client that goes away, a SIGTERM;
and the next attempt at the prompt restores everything the stopped one computed.

Through the real `cas-bank serve` process with `--prefill-step-size 32` (one chunk of
the embedded tiny hybrid takes tens of milliseconds), and real httpx clients that
disconnect. The long prompt is sized from a measured chunk time so that its whole
prefill would take about 8 s, while each test waits about one second into it. A chunk
is two of the server's 16-token blocks, so a prefill stopped after k chunks stored
exactly 2k blocks: the blocks `/v1/explain` finds say how far it got, and all of them
must restore (the hybrid's recurrent state where it stopped is stored with them).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from server_kit import BLOCK, MODEL, TIMEOUT, Server, cached, start_server

STEP = 32  # --prefill-step-size: tokens per forward pass
WHOLE_PREFILL_S = 8.0  # what the long prompt's prefill would take if nothing stopped it
MAX_PROMPT = 30_000  # under the tiny models' 32k context


def _completion(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)


def _chunk_seconds(url: str) -> float:
    """Seconds one prefill chunk takes here: a 512-token prompt's request over its 16
    chunks (HTTP and store included, so an overestimate), the faster of two."""
    times = []
    for tag in "ab":
        t0 = time.perf_counter()
        r = _completion(url, f"{tag} calibrates " + "abcdefgh" * 63)
        assert r.status_code == 200, r.text
        times.append(time.perf_counter() - t0)
    return min(times) / (512 / STEP)


@dataclass
class Served:
    server: Server
    chunk_s: float


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module; the SIGTERM test (the last one) stops it."""
    root = tmp_path_factory.mktemp("cancel")
    server = start_server(root / "bank", root / "server.log", "--prefill-step-size", str(STEP))
    try:
        yield Served(server, _chunk_seconds(server.url))
    finally:
        server.stop()


def _long_prompt(tag: str, chunk_s: float) -> str:
    n = min(MAX_PROMPT, int(WHOLE_PREFILL_S / chunk_s) * STEP)
    return (f"{tag}: " + "the quick brown fox jumps over the lazy dog. " * (n // 45 + 1))[:n]


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=TIMEOUT).json())


def _wait_for(url: str, what: Any, timeout: float = 30.0) -> float:
    """Polls /health until `what(health)`; the time it first held."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if what(_health(url)):
            return time.perf_counter()
        time.sleep(0.01)
    raise AssertionError(f"/health never got there: {_health(url)}")


def _explain(url: str, prompt: str) -> dict[str, Any]:
    """`/v1/explain` of `prompt` once the stopped prefill's store is written (the
    background writer commits its blocks and state in one transaction)."""
    deadline = time.perf_counter() + 10.0
    while True:
        r = httpx.post(f"{url}/v1/explain", json={"prompt": prompt}, timeout=TIMEOUT)
        found = dict(r.json())
        if found["matched_blocks"] > 0 or time.perf_counter() > deadline:
            return found
        time.sleep(0.05)


def _all_restorable(found: dict[str, Any]) -> int:
    """The tokens a stopped prefill finished (its whole chunks: whole blocks here), all
    of which a restore must cover: no `no_state` stop."""
    done = found["matched_blocks"] * BLOCK
    assert done % STEP == 0 and 0 < done < found["prompt_tokens"] // 2, found["summary"]
    assert found["restorable_tokens"] == done, found["summary"]
    return int(done)


def _freed_after_disconnect(server: Server, prompt: str, stream: bool) -> float:
    """Sends `prompt`, goes away one second into its prefill; seconds from the
    disconnect until the worker is free."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": stream}
    url = f"{server.url}/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            _wait_for(server.url, lambda h: h["busy"])
            time.sleep(1.0)
    else:
        try:
            httpx.post(url, json=body, timeout=httpx.Timeout(TIMEOUT, read=1.0))
            raise AssertionError("the long prefill answered within a second")
        except httpx.ReadTimeout:
            pass  # httpx closes the connection: the client is gone
    gone = time.perf_counter()
    return _wait_for(server.url, lambda h: not h["busy"]) - gone


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_goes_away_during_the_prefill_frees_the_worker_within_a_chunk(
    served: Served, stream: bool
) -> None:
    server, chunk_s = served.server, served.chunk_s
    bound = 2 * chunk_s + 0.5  # one chunk, the store of what it did, polling
    prompt = _long_prompt(f"stream={stream}", chunk_s)
    freed = _freed_after_disconnect(server, prompt, stream)
    print(
        f"stream={stream}: worker free {freed:.3f} s after the disconnect; one chunk "
        f"({STEP} tokens) takes {chunk_s:.3f} s; the whole {len(prompt)}-token "
        f"prefill ~{len(prompt) / STEP * chunk_s:.1f} s"
    )
    assert freed < bound, f"freed {freed:.2f} s after the disconnect (bound {bound:.2f})"
    # What the prefill finished is stored, all of it restorable; the rest never ran.
    _all_restorable(_explain(server.url, prompt))
    assert _completion(server.url, "still serving").status_code == 200


def test_a_retry_after_a_client_timeout_restores_all_the_cancelled_prefill_finished(
    served: Served,
) -> None:
    """The client times out, then sends the same request again: its cached_tokens are
    every token the first attempt prefilled."""
    server, chunk_s = served.server, served.chunk_s
    prompt = _long_prompt("retried", chunk_s)
    _freed_after_disconnect(server, prompt, stream=False)
    done = _all_restorable(_explain(server.url, prompt))
    retry = _completion(server.url, prompt)
    assert retry.status_code == 200, retry.text
    usage = retry.json()["usage"]
    print(f"the timed-out attempt finished {done} of {usage['prompt_tokens']} tokens")
    assert cached(retry.json()) == done


def _stream_events(url: str, prompt: str) -> list[Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_sigterm_during_a_long_prefill_answers_503_and_exits_within_5_s(served: Served) -> None:
    server, chunk_s = served.server, served.chunk_s
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            running = pool.submit(_completion, server.url, _long_prompt("running", chunk_s))
            _wait_for(server.url, lambda h: h["busy"])
            queued: Future[Any] = pool.submit(_completion, server.url, "queued, not streamed")
            streamed = pool.submit(_stream_events, server.url, "queued and streamed")
            _wait_for(server.url, lambda h: h["queue_depth"] == 2)
            time.sleep(0.5)
            signalled = time.perf_counter()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=60)
            exit_s = time.perf_counter() - signalled
            print(f"exited {exit_s:.2f} s after SIGTERM (one chunk takes {chunk_s:.3f} s)")
            answers = [running.result(TIMEOUT), queued.result(TIMEOUT)]
            events = streamed.result(TIMEOUT)
    finally:
        server.stop()
    assert exit_s < 5.0 and code == 0
    for r in answers:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
    assert "Traceback" not in server.log.read_text(), server.log.read_text()
    # The stopped prefill's work survives the exit, all of it restorable.
    again = start_server(server.bank, server.log, "--prefill-step-size", str(STEP))
    try:
        _all_restorable(_explain(again.url, _long_prompt("running", chunk_s)))
    finally:
        again.stop()
