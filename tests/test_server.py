"""The OpenAI-compatible server, as a real process on a loopback port
(`server_kit.start_server`): prefix reuse across requests, agents and restarts;
concurrency; health, models and metrics. Its OpenAI client and bad requests are in
test_server_requests.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from cas_bank.runtime import build_model, save_model
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import (
    EngineBusyError,
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
)
from runtime_helpers import metric
from server_kit import (
    ASCII_BIAS,
    BLOCK,
    MODEL,
    TIMEOUT,
    Server,
    cached,
    chat,
    conversation,
    running_server,
    start_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory)


# -- prefix reuse -------------------------------------------------------------------------
def test_the_same_prompt_again_restores_all_of_it(server: Server) -> None:
    first = chat(server.url, conversation("same prompt twice, please"))
    second = chat(server.url, conversation("same prompt twice, please"))
    n = first["usage"]["prompt_tokens"]
    assert cached(first) == 0
    # The prompt's end record, with its last token's logits: no prefill at all.
    assert cached(second) == n
    assert second["choices"][0]["message"] == first["choices"][0]["message"]


def test_the_next_turn_restores_through_the_previous_answer(server: Server) -> None:
    messages = conversation("turn one of a conversation")
    first = chat(server.url, messages, max_tokens=24, logit_bias=ASCII_BIAS)
    assert first["choices"][0]["finish_reason"] == "length"
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and turn two"},
    ]
    second = chat(server.url, messages)
    # 24 decoded tokens cross at least one block boundary past the first prompt; its
    # blocks and the state there were stored after the answer.
    assert cached(second) > first["usage"]["prompt_tokens"]


def test_agents_sharing_a_system_prompt_restore_it(server: Server) -> None:
    """The first agent's prefill captures the state at the end of the system message's
    full blocks (a branch hint from the chat structure), so from the second agent on
    every agent restores the whole shared system prompt."""
    # A system prompt of its own: the module's server already holds SYSTEM's blocks.
    system = "You review pull requests for a storage engine, briefly. " * 6

    def agent(i: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": f"agent {i}"}]

    answers = [chat(server.url, agent(i)) for i in range(3)]
    system_blocks = len(system) // BLOCK * BLOCK  # the shared bytes' full blocks, at least
    assert cached(answers[0]) == 0
    assert cached(answers[1]) >= system_blocks
    assert cached(answers[2]) >= system_blocks
    assert all(a["usage"]["prompt_tokens"] > system_blocks for a in answers)


def test_a_restarted_server_restores_what_the_last_one_stored(tmp_path: Path) -> None:
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    messages = conversation("remember me across a restart")
    first_server = start_server(bank, log)
    try:
        before = chat(first_server.url, messages)
    finally:
        first_server.stop()
    assert first_server.proc.returncode == 0, log.read_text()
    second_server = start_server(bank, log)
    try:
        after = chat(second_server.url, messages)
        metrics = httpx.get(f"{second_server.url}/metrics", timeout=TIMEOUT).text
    finally:
        second_server.stop()
    n = before["usage"]["prompt_tokens"]
    assert cached(before) == 0
    assert cached(after) == n  # its end record: a retry after a restart prefills nothing
    assert after["choices"][0]["message"] == before["choices"][0]["message"]
    # The bank's counters persist: the hit is in the new process's metrics.
    assert metric(metrics, "cas_bank_prefix_hit_tokens_total") == cached(after)
    assert metric(metrics, "cas_bank_blocks") > 0


def test_serving_a_local_model_directory(tmp_path: Path) -> None:
    model_dir = save_model(build_model("tiny-qwen3", seed=3), tmp_path / "my-model")
    s = start_server(tmp_path / "bank", tmp_path / "server.log", "--model", str(model_dir))
    try:
        models = httpx.get(f"{s.url}/v1/models", timeout=TIMEOUT).json()
        body = {"model": "my-model", "prompt": "a local model " * 4, "max_tokens": 4}
        first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT).json()
        second = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT).json()
    finally:
        s.stop()
    assert [m["id"] for m in models["data"]] == ["my-model"]
    assert cached(first) == 0 and cached(second) > 0
    assert second["choices"] == first["choices"]


def test_a_prompt_branching_inside_a_block_counts_its_partial_block(tmp_path: Path) -> None:
    """An attention-only model (embedded tiny-qwen3, byte tokenizer: one token per
    ASCII character): a prompt that leaves a stored one inside a block restores every
    shared token, and `cached_tokens` counts them (so does /metrics)."""
    s = start_server(tmp_path / "bank", tmp_path / "server.log", "--model", "tiny-qwen3")
    shared = "the same preamble for every agent, then a branch: " * 2
    try:
        answers = []
        for tail in ("left and on", "right, then"):
            body = {"model": "tiny-qwen3", "prompt": shared + tail, "max_tokens": 2}
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            answers.append(r.json())
        metrics = httpx.get(f"{s.url}/metrics", timeout=TIMEOUT).text
    finally:
        s.stop()
    second = answers[1]
    new = len("right, then")  # its tokens after the shared ones: all the prefill left
    assert cached(second) == second["usage"]["prompt_tokens"] - new
    assert cached(second) % BLOCK != 0
    assert metric(metrics, "cas_bank_prefix_partial_tokens_total") == cached(second) % BLOCK


# -- concurrency ----------------------------------------------------------------------------
def test_concurrent_clients_get_the_answers_they_would_get_alone(server: Server) -> None:
    # Distinct from their first byte on: no request shares a block with another, so
    # each one's answer cannot depend on which of the others ran before it.
    prompts = [f"{chr(65 + i)}: concurrent request number {i}, please answer" for i in range(6)]

    def complete(prompt: str) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]

    serial = [complete(p) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    assert together == serial
    assert len({text for text, _ in serial}) > 1  # the prompts really differ in output


def test_a_client_that_goes_away_stops_its_generation(server: Server) -> None:
    before = metric(
        httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text, "cas_bank_completion_tokens_total"
    )
    body = {"model": MODEL, "prompt": "a very long answer", "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 3:
                break
    # 5000 tokens would take minutes: the next request is served at once instead.
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "next", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200
    after = metric(
        httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text, "cas_bank_completion_tokens_total"
    )
    assert after - before < 1000


def test_a_full_queue_refuses_at_once_and_close_refuses_what_waits(tmp_path: Path) -> None:
    """The engine in this process: one slot in the queue, a long generation running."""
    engine = Engine.open(tmp_path / "bank", block_size=BLOCK, max_queue=1)
    events: list[list[object]] = [[], [], []]
    long = GenerationRequest(prompt=[1, 2, 3, 4, 5], max_tokens=2000)
    jobs, refused = [], 0
    try:
        for i in range(3):
            try:
                jobs.append(engine.submit(long, events[i].append))
            except EngineBusyError as e:
                assert "already waiting" in str(e)
                refused += 1
    finally:
        for job in jobs[:1]:
            job.cancel()  # the running one stops at its next token
        engine.close()
    assert refused >= 1  # the worker holds one job and the queue one more
    results = [e for ev in events for e in ev if isinstance(e, GenerationResult)]
    closed = [e for ev in events for e in ev if isinstance(e, EngineClosedError)]
    assert len(results) + len(closed) == len(jobs)
    assert all(r.finish_reason == "cancelled" for r in results)
    with pytest.raises(EngineClosedError):
        engine.submit(long, lambda _e: None)


# -- health, models, metrics ----------------------------------------------------------------
def test_sigusr1_prints_every_threads_stack_and_the_server_serves_on(server: Server) -> None:
    """What a server that seems hung is asked (tests' `stop_process` asks it too)."""
    before = server.log.stat().st_size
    server.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while "engine.py" not in server.log.read_text()[before:]:
        assert time.monotonic() < deadline, server.log.read_text()[before:]
        time.sleep(0.1)
    dump = server.log.read_text()[before:]
    assert "Thread 0x" in dump and "queue.py" in dump  # the worker waits for a request
    assert chat(server.url, conversation("still there?"))["choices"]


def test_health_models_and_metrics(server: Server) -> None:
    health = httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["block_size"] == BLOCK
    chat(server.url, conversation("metrics please"))
    written(server.url)  # the first answer's stores committed (the background writer)
    chat(server.url, conversation("metrics please"))
    r = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "cas_bank_prefix_queried_tokens_total",
        "cas_bank_prefix_hit_tokens_total",
        "cas_bank_blocks_written_total",
        "cas_bank_stored_bytes",
        "cas_bank_corrupt_reads_total",
        "cas_bank_requests_total",
        "cas_bank_prefetches_total",  # zero here: no shared tier
        "cas_bank_prefetches_dropped_total",
    ):
        assert f"# TYPE {name} " in text, name
    assert metric(text, "cas_bank_prefix_hit_tokens_total") > 0
    assert metric(text, "cas_bank_blocks_written_total") > 0
    assert metric(text, "cas_bank_corrupt_reads_total") == 0
    assert metric(text, "cas_bank_requests_total") >= 2
    # The same prompt twice: the second restored its end record, logits and all.
    assert metric(text, "cas_bank_prefix_exact_hits_total") >= 1
    assert metric(text, "cas_bank_ends") >= 1 and metric(text, "cas_bank_end_bytes") > 0
    assert 'cas_bank_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    # Which native helpers this server runs with (0: the slower Python path).
    assert 'cas_bank_native_helper{helper="chain"} ' in text
    assert 'cas_bank_native_helper{helper="fill"} ' in text
    # The objects it started with are out of the garbage collector's passes.
    assert metric(text, "cas_bank_gc_frozen_objects") > 10_000
    # The background writer wrote the stores; nothing failed.
    assert metric(text, "cas_bank_writer_stores_total") >= 2
    assert metric(text, "cas_bank_writer_bytes_total") > 0
    assert metric(text, "cas_bank_writer_failures_total") == 0
    assert metric(text, "cas_bank_writer_queue_capacity") >= 1
    # Where the restores' time went: each request restored once (or more) in this process.
    assert metric(text, "cas_bank_restores_timed_total") >= 2
    total = metric(text, "cas_bank_restore_seconds_total")
    parts = [
        metric(text, f'cas_bank_restore_part_seconds_total{{part="{p}"}}')
        for p in ("lookup", "allocate", "fill")
    ]
    assert total > 0 and all(p >= 0 for p in parts) and sum(parts) <= total


def written(url: str, timeout: float = 60.0) -> None:
    """Wait until the server's background writer has written every queued store (its
    queue depth on /metrics is 0)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        if metric(text, "cas_bank_writer_queue_depth") == 0:
            return
        assert time.monotonic() < deadline, "the background writer never drained"
        time.sleep(0.05)
