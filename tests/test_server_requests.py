"""The OpenAI-compatible server's requests, as a real process on a loopback port
(`server_kit.start_server`): the `openai` client (chat and completions, streaming,
stop strings, sampling), and bad requests answered with an OpenAI error that names
the problem while the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_kit import (
    ASCII_BIAS,
    MODEL,
    TIMEOUT,
    Server,
    chat,
    conversation,
    running_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory)


# -- the OpenAI client ----------------------------------------------------------------------
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=TIMEOUT)


def test_openai_client_chat_and_completions_with_and_without_streaming(server: Server) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    messages: Any = conversation("hello through the openai client")

    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert whole.object == "chat.completion"
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    assert whole.usage.prompt_tokens_details is not None
    text = whole.choices[0].message.content

    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text  # greedy: the same request gives the same answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    prompt = "A completion prompt that is long enough to fill a few blocks of tokens."
    done = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert done.object == "text_completion"
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt.encode())
    pieces = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_stop_strings_end_the_answer_before_them(server: Server) -> None:
    messages = conversation("count the letters")
    free = chat(server.url, messages, max_tokens=16, logit_bias=ASCII_BIAS)
    text = free["choices"][0]["message"]["content"]
    stop = text[5:7]  # a stop string that occurs in the free answer
    cut = chat(server.url, messages, max_tokens=16, logit_bias=ASCII_BIAS, stop=[stop])
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_sampling_with_a_seed_repeats_and_other_seeds_differ(server: Server) -> None:
    messages = conversation("sample something")

    def sample(seed: int) -> str:
        r = chat(server.url, messages, max_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        return str(r["choices"][0]["message"]["content"])

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9), sample(-1)}) > 1


def test_sampling_without_a_seed_draws_one_per_request(server: Server) -> None:
    # As OpenAI's API does: a regenerate gives another answer (it was one per prompt).
    messages = conversation("regenerate this")
    texts = {
        chat(server.url, messages, max_tokens=12, temperature=1.0)["choices"][0]["message"][
            "content"
        ]
        for _ in range(3)
    }
    assert len(texts) > 1


# -- bad requests ---------------------------------------------------------------------------
BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny-hybrid", "messages": [', 400),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
        404,
    ),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    (
        "unknown role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
    ),
    (
        "negative max_tokens",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        400,
    ),
    (
        "prompt longer than the context",
        "/v1/completions",
        {"model": MODEL, "prompt": "x" * 33_000, "max_tokens": 1},
        400,
    ),
    (
        "token id beyond the vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 99999]},
        400,
    ),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400),
    ("no such endpoint", "/v1/embeddings", {"model": MODEL, "input": "hi"}, 404),
]


@pytest.mark.parametrize(
    ("why", "path", "body", "status"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(
    server: Server, why: str, path: str, body: Any, status: int
) -> None:
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server.url}{path}",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT,
        )
    else:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "still there?", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200, ok.text


def test_error_messages_name_the_problem(server: Server) -> None:
    long = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "x" * 33_000},
        timeout=TIMEOUT,
    ).json()["error"]
    assert long["code"] == "context_length_exceeded" and "33000 tokens" in long["message"]
    unknown = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
        timeout=TIMEOUT,
    ).json()["error"]
    assert unknown["code"] == "model_not_found" and "gpt-17" in unknown["message"]
    negative = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
        timeout=TIMEOUT,
    ).json()["error"]
    assert negative["param"] == "max_tokens"


UNSUPPORTED = [
    ("logprobs", True),
    ("top_logprobs", 3),
    ("tools", [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("presence_penalty", 0.5),
]


def test_fields_the_server_does_not_honour_are_a_400_naming_them(server: Server) -> None:
    for field, value in UNSUPPORTED:
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: "), error
        assert "Value error" not in error["message"]
    # Their neutral values change nothing: accepted.
    neutral = {"logprobs": False, "tools": [], "tool_choice": "none", "presence_penalty": 0}
    assert chat(server.url, conversation("neutral"), **neutral)["choices"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_temperature_or_top_p_that_is_not_finite_says_so(
    server: Server, field: str, value: str
) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "hi", "{field}": {value}}}'  # json.loads reads it
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=body.encode(),
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "finite" in error["message"], error
