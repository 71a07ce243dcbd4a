"""Hostile or careless callers: another model's cache, tenants that must not share,
clients that go away, a stop signal with a queue, and the small ones (bools taken as
ints, an empty bank path, a flag the hint names, an unknown model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from cas_bank.runtime import PrefixCache
from cas_bank.runtime.tokenizer import END_OF_MESSAGE_ID, EOS_TOKEN_ID
from mlx_lm.models.cache import make_prompt_cache
from runtime_helpers import temp_bank, tiny
from server_kit import MODEL, TIMEOUT, Server, cached, running_server, start_server
from tool_banks import cas_bank

from cas_bank import Bank, BankConfig, InvalidInputError

TOKENS = list(range(1, 70))


def test_a_cache_the_bank_cannot_vouch_for_is_refused() -> None:
    other = tiny("tiny-qwen3", seed=1)  # same layout, other weights
    cache = make_prompt_cache(other.model)
    other.model(mx.array(TOKENS)[None], cache=cache)
    with temp_bank() as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        with pytest.raises(InvalidInputError, match="cannot vouch"):
            pc.store(TOKENS, cache)
        with pytest.raises(InvalidInputError, match="cannot vouch"):
            pc.prefill([*TOKENS, 5], cache, start=len(TOKENS))
        with pytest.raises(InvalidInputError, match="cannot vouch"):
            pc.store_later(TOKENS, cache)  # the background path checks the same
        assert bank.stats().blocks == 0
        mine = pc.new_cache()
        pc.prefill(TOKENS, mine, store=False)
        assert pc.store(TOKENS, mine).blocks_written > 0  # this model's, through the bank
        raw = make_prompt_cache(pc.model)
        pc.model(mx.array(TOKENS)[None], cache=raw)
        assert pc.store(TOKENS, raw, this_model=True).blocks == len(TOKENS) // 16


def test_salts_share_within_and_never_across() -> None:
    model = tiny("tiny-qwen3")
    with temp_bank() as bank:
        a = PrefixCache(bank, model, salt="tenant-a")
        cache, _ = a.restore(TOKENS)
        a.prefill(TOKENS, cache)
        # All but the last token: 4 blocks and the first tokens of the end record.
        assert PrefixCache(bank, model, salt="tenant-a").restore(TOKENS)[1] == len(TOKENS) - 1
        assert PrefixCache(bank, model, salt=b"tenant-b").restore(TOKENS)[1] == 0
        assert PrefixCache(bank, model).restore(TOKENS)[1] == 0
        assert a.salted(None).restore(TOKENS)[1] == 0
        assert a.salted("tenant-a").restore(TOKENS)[1] == len(TOKENS) - 1


def test_small_inputs_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BankConfig(block_size=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="empty"):
        Bank.open("")
    with temp_bank() as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        with pytest.raises(InvalidInputError):
            pc.restore(None)
    proc = cas_bank("serve", "--bank", tmp_path / "b", "--model", "tiny-nope")
    assert proc.returncode != 0 and "tiny-qwen3" in proc.stderr, proc.stderr
    # the hint says `--debug`: it is accepted after the command too
    proc = cas_bank("stats", tmp_path / "nowhere", "--debug")
    assert "unrecognized" not in proc.stderr and "no bank" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, "hostile")


def _chat(url: str, text: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=TIMEOUT)


def test_cache_salt_on_requests(server: Server) -> None:
    text = "the same long question about caches and tenants, " * 3
    assert cached(_chat(server.url, text, cache_salt="a").json()) == 0
    assert cached(_chat(server.url, text, cache_salt="a").json()) > 0
    assert cached(_chat(server.url, text, cache_salt="b").json()) == 0
    assert cached(_chat(server.url, text).json()) == 0
    bad = _chat(server.url, text, max_tokens=True)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def _health(url: str) -> dict[str, object]:
    return dict(httpx.get(f"{url}/health", timeout=TIMEOUT).json())


def test_a_non_streaming_client_that_disconnects_cancels_its_generation(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 5000}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 90  # a busy machine starts slowly
    while not _health(server.url)["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()
    t0 = time.monotonic()
    while _health(server.url)["busy"]:
        assert time.monotonic() - t0 < 5, "the generation went on for nobody"
        time.sleep(0.05)


NO_END = (EOS_TOKEN_ID, END_OF_MESSAGE_ID)


def test_sigterm_refuses_the_queue_and_exits_within_seconds(tmp_path: Path) -> None:
    s = start_server(tmp_path / "bank", tmp_path / "server.log")
    statuses: list[int] = []
    codes: list[str] = []

    def ask(n: int) -> None:
        try:
            r = httpx.post(
                f"{s.url}/v1/completions",
                # No end-of-text: each generation runs its 5000 tokens, so on a quiet
                # machine too the first is still running while the others queue.
                json={
                    "model": MODEL,
                    "prompt": f"go {n}",
                    "max_tokens": 5000,
                    "logit_bias": {str(i): -100 for i in NO_END},
                },
                timeout=TIMEOUT,
            )
            statuses.append(r.status_code)
            codes.append(r.json()["error"]["code"] if r.status_code != 200 else "")
        except httpx.HTTPError:
            statuses.append(-1)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.2)
        deadline = time.monotonic() + 90  # a busy machine starts slowly
        while _health(s.url)["queue_depth"] < 2:  # type: ignore[operator]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=30)
    finally:
        s.stop()
    assert took < 8, took
    # The queued ones were refused, and the running one, cut off, is not passed off as a
    # whole answer: all three are 503s, "shutting_down".
    assert statuses == [503, 503, 503] and set(codes) == {"shutting_down"}, (statuses, codes)
    assert os.path.exists(tmp_path / "bank" / "CURRENT") and sys.executable


def test_an_empty_end_record_and_no_hints_are_told_apart_from_bugs() -> None:
    with temp_bank() as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        cache = pc.new_cache()
        with pytest.raises(InvalidInputError, match="at least one token"):
            pc.store_end([], cache)
        pc.prefill(TOKENS, cache, hints=None)  # None: no hints, as ()
        bank.flush()  # committed by the background writer
        assert pc.namespace.match(TOKENS) > 0
