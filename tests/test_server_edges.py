"""The server's answers at the edges of its inputs, in process (FastAPI's TestClient on
a real `Engine` over a real bank and the embedded tiny model): nulls as defaults,
ids and text it must refuse with a 400, sampling settings float32 cannot tell from 0,
`echo` in every form, a reply cut off by shutdown, `/v1/explain` as the server
restores, and a 500 that `/metrics` counts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest, RequestError
from cas_bank.runtime.server import create_app
from fastapi.testclient import TestClient
from runtime_helpers import tiny

from cas_bank import Bank, BankConfig

BLOCK = 16
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, TestClient]]:
    bank = Bank.open(tmp_path_factory.mktemp("edges") / "bank", BankConfig(block_size=BLOCK))
    with Engine(tiny(MODEL), bank, owns_bank=True) as engine:
        yield engine, TestClient(create_app(engine), raise_server_exceptions=False)


def complete(client: TestClient, engine: Engine, **fields: Any) -> Any:
    # As JSON text with escapes (a lone surrogate travels as "\ud800", as clients send it).
    body = json.dumps({"model": engine.model_id, **fields})
    return client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )


def test_explicit_nulls_mean_the_defaults(served: tuple[Engine, TestClient]) -> None:
    engine, client = served
    nulls = {"n": None, "stream": None, "echo": None, "temperature": None, "top_p": None}
    r = complete(client, engine, prompt="hello", max_tokens=2, **nulls)
    assert r.status_code == 200, r.text
    r = complete(
        client, engine, prompt="hello", max_tokens=2, stream_options={"include_usage": None}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "x", "logit_bias": {"²": 5}}, "logit_bias"),  # "²".isdigit() is True
        ({"prompt": "x", "logit_bias": {"１": 5}}, "logit_bias"),  # a full-width digit
        ({"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: no text to tokenize
    ],
    ids=["superscript digit", "full-width digit", "lone surrogate"],
)
def test_ids_and_text_that_are_not_what_they_seem_are_a_400(
    served: tuple[Engine, TestClient], fields: dict[str, Any], param: str
) -> None:
    engine, client = served
    r = complete(client, engine, max_tokens=2, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_temperature_or_top_p_float32_cannot_tell_from_0_is_greedy(
    served: tuple[Engine, TestClient],
) -> None:
    engine, client = served
    greedy = complete(client, engine, prompt="the same prompt", max_tokens=6, temperature=0)
    assert greedy.status_code == 200, greedy.text
    text = greedy.json()["choices"][0]["text"]
    for fields in ({"temperature": 1e-39}, {"temperature": 1e-46}, {"top_p": 1e-46}):
        settings = {"temperature": 1.0, **fields}
        r = complete(client, engine, prompt="the same prompt", max_tokens=6, **settings)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text, fields  # never token 0 from NaNs


def _streamed_text(response: Any) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
    return text


def test_echo_with_text_or_ids_streamed_or_not(served: tuple[Engine, TestClient]) -> None:
    engine, client = served
    ids = engine.text_prompt("echo me")
    for prompt in ("echo me", ids):
        for stream in (False, True):
            r = complete(client, engine, prompt=prompt, max_tokens=0, echo=True, stream=stream)
            assert r.status_code == 200, r.text
            got = _streamed_text(r) if stream else r.json()["choices"][0]["text"]
            assert got == "echo me", (prompt, stream)


def test_a_reply_cut_off_by_shutdown_is_not_passed_off_as_whole(tmp_path: Path) -> None:
    bank = Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK))
    with Engine(tiny(MODEL), bank, owns_bank=True) as engine:
        client = TestClient(create_app(engine), raise_server_exceptions=False)
        answers: dict[bool, Any] = {}

        def ask(stream: bool) -> None:
            answers[stream] = complete(
                client, engine, prompt="go on", max_tokens=100_000, stream=stream
            )

        asker = threading.Thread(target=ask, args=(False,))
        asker.start()
        deadline = time.monotonic() + 30
        while not engine.stats().busy and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a few tokens in
        engine.stop()
        asker.join(30)
    r = answers[False]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "shutting_down" and "cut off" in r.text


def test_a_streamed_reply_cut_off_by_shutdown_ends_with_an_error(tmp_path: Path) -> None:
    bank = Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK))
    with Engine(tiny(MODEL), bank, owns_bank=True) as engine:
        client = TestClient(create_app(engine), raise_server_exceptions=False)
        lines: list[str] = []
        body = {"model": engine.model_id, "prompt": "go on", "max_tokens": 100_000, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:  # tokens are coming: stop the server
                    engine.stop()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "shutting_down"
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
    assert [x for x in lines if x][-1] == "data: [DONE]"


def test_explain_follows_the_restore_the_server_makes(tmp_path: Path) -> None:
    """An exact repeat is served whole from its end record: explain says so; a salted
    request is explained in its own namespace."""
    bank = Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK))
    with Engine(tiny(MODEL), bank, owns_bank=True) as engine:
        client = TestClient(create_app(engine))
        prompt = engine.text_prompt("a prompt of a few blocks, " * 4)
        assert len(prompt) % BLOCK  # a tail: the end record covers it
        first = complete(client, engine, prompt=prompt, max_tokens=2)
        again = complete(client, engine, prompt=prompt, max_tokens=2)
        served = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first.status_code == again.status_code == 200
        assert served == len(prompt)
        said = client.post("/v1/explain", json={"prompt": prompt}).json()
        assert said["restorable_tokens"] == served and said["end_record_logits"]
        assert any("exact repeat" in line for line in said["summary"])

        salted = client.post("/v1/explain", json={"prompt": prompt, "cache_salt": "t"}).json()
        r = complete(client, engine, prompt=prompt, max_tokens=2, cache_salt="t")
        assert salted["restorable_tokens"] == 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        bad = client.post("/v1/explain", json={"prompt": prompt, "cache_salt": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_an_unexpected_error_is_a_500_that_metrics_count(
    served: tuple[Engine, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, client = served

    def broken() -> Any:
        raise RuntimeError("broken on purpose")

    with monkeypatch.context() as m:
        m.setattr(engine, "stats", broken)
        r = client.get("/health")
    assert r.status_code == 500 and "broken on purpose" in r.json()["error"]["message"]
    text = client.get("/metrics").text
    assert 'cas_bank_http_requests_total{endpoint="/health",status="500"} 1' in text


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_the_engine_refuses_a_temperature_that_is_not_finite(
    served: tuple[Engine, TestClient], temperature: float
) -> None:
    # The server's request models refuse it first; scripts call the engine directly.
    engine, _ = served
    with pytest.raises(RequestError, match="finite"):
        engine.check(GenerationRequest(prompt=[1, 2, 3], temperature=temperature))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_served_connections_have_nagles_algorithm_off(host: str) -> None:
    """The server's listening socket (`bind`, as `cas-bank serve` and `BackgroundServer`
    make it) names TCP, so asyncio sets `TCP_NODELAY` on every connection it accepts,
    as uvicorn's own sockets get: with Nagle's algorithm on, each request after the
    first on a kept-alive connection stalled ~40 ms for a delayed ACK."""
    import asyncio
    import socket

    from cas_bank.runtime.server import bind

    try:
        sock = bind(host, 0)
    except OSError:
        pytest.skip(f"no {host} here")
    seen: list[int] = []

    async def accept_one() -> None:
        accepted = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                raw = transport.get_extra_info("socket")
                seen.append(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()
                accepted.set_result(None)

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0
