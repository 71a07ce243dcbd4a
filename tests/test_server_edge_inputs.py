"""Both servers at their edge: texts that are not Unicode text (a lone surrogate), NUL,
over-long names, lenient types, other models, and errors inside mlx-lm's generation loop.

Each test runs the real server process (`cas-bank serve`, `cas-bank mlx-lm-server`) on a
tiny model and sends raw JSON (`"\\ud800"` is valid JSON; httpx's `json=` cannot send it).
A poisonous request is always followed by a normal one that must get its answer: in
issue 41, one `cache_salt` of `"\\ud800"` ended mlx-lm's generation thread for good.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import server_kit as srv
import test_mlx_lm_server as mlx
from cas_bank.runtime.mlx_lm_salts import salting_generator
from cas_bank.runtime.mlx_lm_server import READY
from hf_models import model_dir
from mlx_lm_faults import BREAK, FAULT
from runtime_helpers import stop_process

from cas_bank import InvalidInputError
from cas_bank.blocks.hashing import salt_bytes

HERE = Path(__file__).parent
MESSAGES = [{"role": "user", "content": "what is the weather in city 3?"}]
SURROGATE = "\ud800"


def post(url: str, route: str, body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # \ud800 escaped
    headers = {"Content-Type": "application/json"}
    return httpx.post(url + route, content=raw, headers=headers, timeout=srv.TIMEOUT)


def error_text(r: httpx.Response) -> str:
    err = r.json()["error"]
    return err if isinstance(err, str) else str(err["message"])


def raw_post(url: str, route: str, length: str, body: bytes) -> tuple[int, str]:
    """POST `body` with the `Content-Length` header given as is (httpx writes its own);
    (status, body text), status 0 when the server closed without an answer."""
    u = httpx.URL(url)
    head = f"POST {route} HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length:{length}\r\nConnection: close\r\n\r\n"
    with socket.create_connection((u.host, u.port), timeout=20) as s:
        s.sendall(head.encode() + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n\r\n")
    return (int(status_line.split()[1]) if status_line else 0), rest.decode(errors="replace")


# JSON nested past what Python's parser takes (it raises RecursionError)
TOO_DEEP = [b"[" * 100_000, b'{"a":' * 100_000, b'{"model": "m", "messages": ' + b"[" * 50_000]


# -- cas-bank serve ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[srv.Server]:
    yield from srv.running_server(tmp_path_factory, "edge_serve")


def _serve_body(route: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": srv.MODEL, "max_tokens": 2}
    if route == "/v1/completions":
        base["prompt"] = "hello there"
    else:
        base["messages"] = MESSAGES
    return {**base, **extra}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/explain"])
def test_serve_refuses_texts_that_cannot_reach_a_salt_by_name(
    serve: srv.Server, route: str
) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"cache_salt": SURROGATE}, "cache_salt"),
        ({"cache_salt": "a\x00b"}, "cache_salt"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
    ]
    if route != "/v1/explain":
        bad += [({"model": "a\x00b"}, "model"), ({"model": "m" * 2000}, "model")]
        bad += [({"stop": ["ok", "x" + SURROGATE]}, "stop")]
    if route == "/v1/completions":
        bad += [({"prompt": SURROGATE}, "prompt")]
    else:
        bad += [({"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content")]
    for extra, field in bad:
        r = post(serve.url, route, _serve_body(route, **extra))
        assert r.status_code == 400, (extra, r.text)
        assert str(r.json()["error"]["param"]).startswith(field), (extra, r.text)
    ok = post(serve.url, route, _serve_body(route, cache_salt="tenant-\u00e9"))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("route", "extra", "field"),
    [
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ("/v1/chat/completions", {"seed": 1.0}, "seed"),
        ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ],
)
def test_serve_takes_openais_types_strictly(
    serve: srv.Server, route: str, extra: dict[str, Any], field: str
) -> None:
    r = post(serve.url, route, _serve_body(route, **extra))
    assert r.status_code == 400, r.text
    assert field in str(r.json()["error"]["param"]), r.text


def test_serve_names_no_path_in_an_unknown_models_404(serve: srv.Server) -> None:
    r = post(serve.url, "/v1/chat/completions", _serve_body("", model="/etc/passwd"))
    assert r.status_code == 404 and "/etc" not in r.text, r.text
    ids = post(serve.url, "/v1/completions", _serve_body("/v1/completions", prompt=[5, 6, 7]))
    assert ids.status_code == 200, ids.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/explain"])
def test_serve_refuses_json_nested_too_deeply_by_name(serve: srv.Server, route: str) -> None:
    for raw in TOO_DEEP:
        r = post(serve.url, route, raw)
        assert r.status_code == 400 and "too deeply" in error_text(r), (raw[:30], r.text)
    ok = post(serve.url, route, _serve_body(route))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("prompt", [[], [[]]])
def test_serve_refuses_an_empty_list_of_token_ids_as_such(
    serve: srv.Server, prompt: list[Any]
) -> None:
    route = "/v1/completions"  # refused by the request's model, not later by the engine
    r = post(serve.url, route, _serve_body(route, prompt=prompt))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"{json.dumps(prompt)} holds no token ids" in error_text(r), r.text
    ok = post(serve.url, route, _serve_body(route, prompt=[5, 6, 7]))
    assert ok.status_code == 200, ok.text


# -- cas-bank mlx-lm-server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edge_models")
    return {
        "model": model_dir(root / "served", "tiny-qwen3"),
        "other": model_dir(root / "other", "tiny-hybrid"),
        "root": root,
    }


@pytest.fixture(scope="module")
def mlx_server(dirs: dict[str, Path]) -> Iterator[mlx.MlxServer]:
    log = dirs["root"] / "server.log"
    s = mlx.start(dirs["root"] / "bank", dirs["model"], log)
    try:
        yield s
    finally:
        assert s.stop() == 0, log.read_text()


def _mlx_body(route: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "default_model", "max_tokens": 3}
    if route == "/v1/completions":
        base["prompt"] = "hello there"
    else:
        base["messages"] = MESSAGES
    return {**base, **extra}


def _answered(url: str) -> None:
    """A normal request is still served, and the server says it is healthy."""
    r = post(url, "/v1/chat/completions", _mlx_body(""))
    assert r.status_code == 200, r.text
    health = httpx.get(f"{url}/health", timeout=srv.TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_mlx_lm_server_refuses_poison_by_name_and_serves_the_next(
    mlx_server: mlx.MlxServer, route: str
) -> None:
    bad: list[tuple[Any, str]] = [
        (_mlx_body(route, cache_salt=SURROGATE), "cache_salt"),  # ended the thread
        (_mlx_body(route, cache_salt="a\x00b"), "cache_salt"),
        (_mlx_body(route, cache_salt="s" * 1025), "cache_salt"),
        (_mlx_body(route, stop=[1]), "stop"),  # ended the thread too (mlx-lm 0.32)
        (_mlx_body(route, model="m\x00"), "model"),
        (_mlx_body(route, chat_template_kwargs={"x": SURROGATE}), "chat_template_kwargs.x"),
        (b'{"model": "default_model", "prompt": "\xff"}', "UTF-8"),
    ]
    if route == "/v1/completions":
        bad += [(_mlx_body(route, prompt=SURROGATE), "prompt")]
    else:
        bad += [(_mlx_body(route, messages=[{"role": "user", "content": SURROGATE}]), "messages")]
    for body, field in bad:
        r = post(mlx_server.url, route, body)
        assert r.status_code == 400 and field in error_text(r), (body, r.text)
        _answered(mlx_server.url)


@pytest.mark.parametrize(
    ("route", "extra", "field"),
    [
        # (mlx-lm itself refuses "stream": "yes", "logprobs": 1 and "seed": 2.0)
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
    ],
)
def test_mlx_lm_server_takes_openais_types_strictly(
    mlx_server: mlx.MlxServer, route: str, extra: dict[str, Any], field: str
) -> None:
    r = post(mlx_server.url, route, _mlx_body(route, **extra))
    assert r.status_code == 400 and error_text(r).startswith(field), r.text


def test_mlx_lm_server_checks_every_body_whatever_its_content_length(
    mlx_server: mlx.MlxServer,
) -> None:
    """mlx-lm reads `Content-Length` with `int()`, which takes `+N`, `N_M` and spaces: a
    body under such a header went to mlx-lm unchecked (here a lenient type and another
    model, which it served). A negative length read to the end of the stream, a huge
    one failed to allocate its size: no answer either way."""
    raw = json.dumps(_mlx_body("/v1/completions", echo="yes", model="/etc/passwd")).encode()
    n = str(len(raw))
    for length in (f"+{n}", f"{n[0]}_{n[1:]}", "-1", f"-{n}", f"{n}.0"):
        status, text = raw_post(mlx_server.url, "/v1/completions", length, raw)
        assert status == 400 and "Content-Length" in text, (length, status, text)
        _answered(mlx_server.url)
    for length in (f" {n} ", f"\t{n}\t", f"00{n}"):  # spaces and zeros: still N, checked
        status, text = raw_post(mlx_server.url, "/v1/completions", length, raw)
        assert status == 400 and "echo" in text, (length, status, text)
    for length in ("9" * 30, str(1 << 40)):
        status, text = raw_post(mlx_server.url, "/v1/completions", length, raw)
        assert status == 413 and "Content-Length" in text, (length, status, text)
        _answered(mlx_server.url)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_mlx_lm_server_refuses_json_nested_too_deeply_by_name(
    mlx_server: mlx.MlxServer, route: str
) -> None:
    for raw in TOO_DEEP:
        r = post(mlx_server.url, route, raw)
        assert r.status_code == 400 and "too deeply" in error_text(r), (raw[:30], r.text)
        _answered(mlx_server.url)


def test_mlx_lm_server_names_an_empty_list_of_token_ids(mlx_server: mlx.MlxServer) -> None:
    empties: list[list[Any]] = [[], [[]]]
    for prompt in empties:
        r = post(mlx_server.url, "/v1/completions", _mlx_body("/v1/completions", prompt=prompt))
        assert r.status_code == 400 and error_text(r).startswith("prompt"), r.text
        assert f"the prompt is empty: {json.dumps(prompt)} holds no" in error_text(r), r.text


def test_mlx_lm_server_serves_only_its_own_model(
    mlx_server: mlx.MlxServer, dirs: dict[str, Path]
) -> None:
    other = str(dirs["other"])
    for extra in (
        {"model": "/etc/passwd"},
        {"model": other},
        {"model": "mlx-community/some-other-model"},
        {"draft_model": other},
        {"adapters": "/etc"},
    ):
        r = post(mlx_server.url, "/v1/chat/completions", _mlx_body("", **extra))
        assert r.status_code == 404, (extra, r.text)
        assert "/etc" not in r.text and str(dirs["root"]) not in r.text, r.text
        assert error_text(r).startswith(next(iter(extra))), r.text
    listed = httpx.get(f"{mlx_server.url}/v1/models", timeout=srv.TIMEOUT).json()["data"]
    served = str(dirs["model"].resolve())
    assert [m["id"] for m in listed] == [served]
    for name in ("default_model", served, str(dirs["model"])):
        r = post(mlx_server.url, "/v1/chat/completions", _mlx_body("", model=name))
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    repeat = post(mlx_server.url, "/v1/chat/completions", _mlx_body("", model=served))
    assert mlx.cached(repeat.json()) > 0  # still the model the bank keeps, never reloaded


def test_model_switching_is_an_explicit_option(dirs: dict[str, Path], tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    s = mlx.start(tmp_path / "bank", dirs["model"], log, "--allow-model-switching")
    try:
        other = post(s.url, "/v1/chat/completions", _mlx_body("", model=str(dirs["other"])))
        assert other.status_code == 200, other.text
        r = post(s.url, "/v1/chat/completions", _mlx_body("", model="/etc/passwd"))
        assert r.status_code == 404 and "/etc" not in r.text, r.text
        _answered(s.url)
    finally:
        assert s.stop() == 0, log.read_text()
    help_text = subprocess.run(
        [sys.executable, "-m", "cas_bank.tools.cli", "mlx-lm-server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--allow-model-switching" in help_text


def test_health_and_metrics_say_the_bank_is_in_use(mlx_server: mlx.MlxServer) -> None:
    """The bank is the prompt cache, with a draft model too (test_draft_model.py)."""
    health = httpx.get(f"{mlx_server.url}/health", timeout=srv.TIMEOUT).json()
    assert health["bank_in_use"] is True and health["status"] == "ok"
    assert health["draft_model"] is False
    metrics = httpx.get(f"{mlx_server.url}/metrics", timeout=srv.TIMEOUT).text
    assert "cas_bank_bank_in_use 1" in metrics.splitlines()


# -- errors inside mlx-lm's generation loop (a planted fault: tests/mlx_lm_faults.py) -------
def _start_faulty(dirs: dict[str, Path], tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, str(HERE / "mlx_lm_faults.py"), "mlx-lm-server"]
    cmd += ["--bank", str(tmp_path / "bank"), "--model", str(dirs["model"]), "--port", "0"]
    cmd += ["--log-level", "WARNING"]
    with open(tmp_path / "server.log", "a") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(READY), (tmp_path / "server.log").read_text()
    return proc, line.split()[-1]


def test_an_error_in_the_generation_loop_ends_its_request_and_not_the_server(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    proc, url = _start_faulty(dirs, tmp_path)
    try:
        _answered(url)  # the batched path is running
        for _ in range(2):
            r = post(url, "/v1/chat/completions", _mlx_body("", stop=[FAULT]))
            assert r.status_code == 404 and "planted fault" in error_text(r), r.text
            _answered(url)
    finally:
        assert stop_process(proc) == 0, (tmp_path / "server.log").read_text()


def test_a_generation_loop_that_cannot_go_on_ends_the_process_non_zero(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    proc, url = _start_faulty(dirs, tmp_path)
    try:
        r = post(url, "/v1/chat/completions", _mlx_body("", stop=[BREAK]))
        assert r.status_code == 404, r.text
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        log = (tmp_path / "server.log").read_text()
        assert proc.returncode not in (None, 0), log
        assert "generation thread could not go on" in log, log
    finally:
        stop_process(proc)


# -- the library and the generator, without a server ----------------------------------------
def test_a_salt_that_is_not_unicode_text_is_an_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="lone surrogate"):
        salt_bytes("tenant-" + SURROGATE)
    assert salt_bytes("tenant-\u00e9") == "tenant-\u00e9".encode()


def test_generate_none_none_raises_runtime_error_as_mlx_lms(dirs: dict[str, Path]) -> None:
    """mlx-lm's own test harness sends `generate(None, None)`: mlx-lm answers it with a
    RuntimeError; the salting generator did with an AttributeError. On the bank's
    generator the thread also goes on."""
    mls = importlib.import_module("mlx_lm.server")
    args = argparse.Namespace(
        model=str(dirs["model"]),
        adapter_path=None,
        draft_model=None,
        pipeline=False,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        kv_bits=None,
    )
    for worker in (False, True):
        base = mls.ResponseGenerator
        if worker:
            from cas_bank.runtime.mlx_lm_worker import worker_generator

            base = worker_generator(base)
        generator = salting_generator(base)(mls.ModelProvider(args), mls.LRUPromptCache())
        try:
            with pytest.raises(RuntimeError):
                generator.generate(None, None)
            assert generator.generation_available() == worker
        finally:
            generator.stop_and_join()
