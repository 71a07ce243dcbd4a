"""The OpenAI-compatible HTTP server: a FastAPI app in front of one `Engine`.

Why FastAPI on uvicorn: both are widely used and actively maintained; FastAPI parses
requests into the pydantic models of `openai_types` (pydantic is already how
cas_bank types its config), and Starlette's `StreamingResponse` gives server-sent
events for `stream: true` without extra code. uvicorn is its standard ASGI server.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streaming and not),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Every request
restores its longest stored prefix before prefill and stores after (see `engine`);
`usage.prompt_tokens_details.cached_tokens` is the number of restored tokens.

Errors are OpenAI-style JSON bodies, `{"error": {"message", "type", "param", "code"}}`:
400 for a malformed body or a request the model cannot serve (empty messages, a
prompt beyond the context, negative max_tokens), 404 for an unknown model or path,
503 when the queue is full or the server is stopping, 500 for a failure inside.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cas_bank.remote.health import TierHealth, TierProbe, degraded_reason

from . import openai_types as oa
from .engine import Engine
from .explain_route import explain_request
from .generation import GenerationRequest, GenerationResult
from .metrics import (
    CONTENT_TYPE,
    Metric,
    RequestCounter,
    bank_metrics,
    engine_metrics,
    render,
    restore_metrics,
    tenant_metrics,
    tier_metrics,
    writer_metrics,
)
from .responses import (
    ApiError,
    EngineRun,
    api_error,
    chat_chunks,
    completion_chunks,
    finish_reason,
    sse,
    start_run,
    usage_of,
)
from .tokenizer import decode_tokens

log = logging.getLogger("cas_bank.server")

LOOPBACK = "127.0.0.1"
# Replies of requests that set no max_tokens stop here (as in mlx-lm's server): on a
# CPU, a model that never emits its end token would otherwise hold the queue for the
# whole context.
DEFAULT_MAX_TOKENS = 512
# Seconds uvicorn waits for open connections after a stop signal (the running
# generation is cancelled at once; queued requests are refused).
GRACEFUL_SHUTDOWN_S = 3
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/explain",
    "/health",
    "/metrics",
)


def create_app(engine: Engine, *, close_engine: bool = False) -> FastAPI:
    """The app serving `engine`. `close_engine`: close it when the app shuts down."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine:
            # Off the event loop: close waits for the running generation to end.
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="cas_bank", lifespan=lifespan)
    requests = RequestCounter()
    _add_error_handling(app, requests)
    _add_status_routes(app, engine, requests)
    _add_generation_routes(app, engine)
    return app


def _add_error_handling(app: FastAPI, requests: RequestCounter) -> None:
    """Every request counted by route and status; every error an OpenAI-style body."""

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Any) -> Any:
        path = request.url.path
        route = path if path in ROUTES else "other"
        try:
            response = await call_next(request)
        except Exception:  # answered as a 500 by `internal_error`, outside this middleware
            requests.add(route, 500)
            raise
        requests.add(route, response.status_code)
        return response

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(e).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # FastAPI's "There was an error parsing the body" (400) names no problem.
        too_deep = isinstance(e.__cause__, RecursionError)
        err = ApiError(e.status_code, oa.TOO_DEEP if too_deep else str(e.detail), type=kind)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("cas_bank: unexpected error")
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def _add_status_routes(app: FastAPI, engine: Engine, requests: RequestCounter) -> None:
    """`/health`, `/v1/models` and `/metrics`."""
    started = int(time.time())
    tier = TierProbe(engine.bank.remote) if engine.bank.remote is not None else None

    async def tier_health() -> TierHealth | None:
        return None if tier is None else await asyncio.to_thread(tier.check)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = engine.stats()
        remote = await tier_health()
        degraded = degraded_reason(engine.bank.degraded, remote)
        return {
            # degraded: the bank refuses stores (a full disk), or the shared tier does
            # not serve (its blocks are misses); answers still go out.
            "status": "ok" if degraded is None else "degraded",
            "degraded": degraded,
            "remote": None if remote is None else remote.as_dict(),
            "model": engine.model_id,
            "bank": str(engine.bank.path),
            "block_size": engine.bank.config.block_size,
            "queue_depth": stats.queue_depth,
            "busy": stats.busy,
        }

    @app.get("/v1/models")
    async def models() -> oa.ModelList:
        return oa.ModelList(data=[oa.ModelCard(id=engine.model_id, created=started)])

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await asyncio.to_thread(engine.bank.stats)
        tenants = await asyncio.to_thread(engine.bank.tenant_stats)
        degraded = Metric.single(
            "bank_degraded",
            "1 while the bank refuses stores (a full disk); answers still go out.",
            "gauge",
            0 if engine.bank.degraded is None else 1,
        )
        remote = await tier_health()
        body = render(
            [
                *bank_metrics(stats),
                *restore_metrics(engine.bank.restore_times()),
                *tenant_metrics(tenants),
                *writer_metrics(writer.stats() if (writer := engine.bank.writer) else None),
                *engine_metrics(engine.stats()),
                degraded,
                *([] if tier is None or remote is None else tier_metrics(remote, tier)),
                requests.metric(),
            ]
        )
        return PlainTextResponse(body, media_type=CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, engine: Engine) -> None:
    """`/v1/chat/completions`, `/v1/completions` and `/v1/explain`."""
    _add_chat_route(app, engine)
    _add_completions_route(app, engine)
    _add_explain_route(app, engine)


def _check_model(engine: Engine, name: str) -> None:
    """A 404 unless `name` is the model `engine` serves."""
    if name != engine.model_id:
        # A name that may be a path is not echoed: error bodies name no paths.
        asked = "the model asked for" if "/" in name or "\\" in name else f"model {name!r}"
        raise ApiError(
            404,
            f"{asked} is not served here; this server serves {engine.model_id!r}",
            type="invalid_request_error",
            code="model_not_found",
            param="model",
        )


def _add_chat_route(app: FastAPI, engine: Engine) -> None:
    """`/v1/chat/completions`: the messages through the chat template, with branch hints."""

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        body: oa.ChatCompletionRequest, request: Request
    ) -> oa.ChatCompletion | StreamingResponse:
        _check_model(engine, body.model)
        messages = body.message_dicts()
        prompt = _call(engine.chat_prompt, messages)
        hints = engine.branch_hints(messages, prompt)
        run = start_run(engine, _generation(prompt, body, body.token_limit(), hints))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return sse(chat_chunks(run, rid, created, engine.model_id, body.include_usage()))
        result = await _result_unless_gone(run, request)
        return oa.ChatCompletion(
            id=rid,
            created=created,
            model=engine.model_id,
            choices=[
                oa.ChatChoice(
                    message=oa.AssistantMessage(content=result.text),
                    finish_reason=finish_reason(result),
                )
            ],
            usage=usage_of(result),
        )


def _add_completions_route(app: FastAPI, engine: Engine) -> None:
    """`/v1/completions`: a text or token-id prompt, with `echo`."""

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: oa.CompletionRequest, request: Request
    ) -> oa.Completion | StreamingResponse:
        _check_model(engine, body.model)
        prompt = _call(engine.text_prompt, body.prompt)
        run = start_run(engine, _generation(prompt, body, body.token_limit()))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = _echo(engine, body, prompt) if body.echo else ""
        if body.stream:
            return sse(
                completion_chunks(run, rid, created, engine.model_id, body.include_usage(), echo)
            )
        result = await _result_unless_gone(run, request)
        choice = oa.CompletionChoice(text=echo + result.text, finish_reason=finish_reason(result))
        return oa.Completion(
            id=rid, created=created, model=engine.model_id, choices=[choice], usage=usage_of(result)
        )


def _add_explain_route(app: FastAPI, engine: Engine) -> None:
    """`/v1/explain`: why a prompt would (not) hit, without generating."""

    @app.post("/v1/explain")
    async def explain_prompt(request: Request) -> JSONResponse:
        """Why this prompt would (not) hit: see `explain_route`."""
        try:
            body = oa.parsed_json(await request.body())
        except ValueError as e:
            raise ApiError(400, str(e), type="invalid_request_error") from e
        try:
            return JSONResponse(await asyncio.to_thread(explain_request, engine, body))
        except Exception as e:
            raise api_error(e) from e


async def _result_unless_gone(run: EngineRun, request: Request) -> GenerationResult:
    """The run's result; a client that disconnects first cancels its generation (a
    non-streaming reply has no write to fail, so the connection is watched)."""
    result = asyncio.ensure_future(run.result())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        run.job.cancel()
        raise ApiError(499, "the client disconnected", type="invalid_request_error")
    finally:
        for task in (result, gone):
            if not task.done():
                task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. (Starlette's `is_disconnected` only peeks,
    and uvicorn notices a closed connection only while someone waits to receive.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _echo(engine: Engine, body: oa.CompletionRequest, prompt: list[int]) -> str:
    """The prompt as `echo` returns it: its text, or for token ids their decoding."""
    if isinstance(body.prompt, str):
        return body.prompt
    return decode_tokens(engine.loaded.tokenizer, prompt)


def _call(fn: Callable[[Any], list[int]], arg: Any) -> list[int]:
    try:
        return fn(arg)
    except Exception as e:
        raise api_error(e) from e


def _generation(
    prompt: list[int], body: oa.SamplingFields, limit: int | None, hints: tuple[int, ...] = ()
) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        max_tokens=DEFAULT_MAX_TOKENS if limit is None else limit,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        logit_bias=body.bias_by_id() or None,
        branch_hints=hints,
        cache_salt=body.cache_salt,
    )


def _validation_error(e: RequestValidationError) -> ApiError:
    errors = e.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        why = ctx.get("error", first["msg"]) if isinstance(ctx, dict) else first["msg"]
        return ApiError(
            400,
            f"the request body is not valid JSON: {why}",
            type="invalid_request_error",
            code="invalid_json",
        )
    param, message = oa.described(errors)
    return ApiError(400, message, type="invalid_request_error", param=param)


# -- running the server -------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read it from `getsockname`).

    Made with its protocol named (`IPPROTO_TCP`, not 0): asyncio turns Nagle's algorithm
    off (`TCP_NODELAY`) only on connections whose socket says TCP, and with it on, every
    request after the first on a kept-alive connection waited ~40 ms for a delayed ACK
    (a response's head and body are two writes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def run_server(
    engine: Engine,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    access_log: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM (in the main thread); closes `engine` on the way out."""
    app = create_app(engine, close_engine=True)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (the engine and bank are closed
    # by then), then re-raises the signal to the handler it found. Found handlers that
    # only note it make a stop by signal a clean exit rather than a kill or a
    # KeyboardInterrupt traceback.
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: received.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        _StoppingServer(config, engine).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not engine.closed:  # uvicorn failed before its lifespan shutdown ran
            engine.close()


class _StoppingServer(uvicorn.Server):
    """uvicorn, but a stop signal also stops the engine at once: queued requests are
    refused (503) and the running generation ends at its next token, so the server
    exits within seconds instead of serving its queue first."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._engine.stop()
        super().handle_exit(sig, frame)


class BackgroundServer:
    """The server on a thread of this process (the demo's runtime); a context manager.

    `url` is known once `start()` returns. `stop()` shuts the server down and closes
    the engine (and so the bank it owns).
    """

    def __init__(self, engine: Engine, host: str = LOOPBACK, port: int = 0) -> None:
        self.engine = engine
        self._sock = bind(host, port)
        self.url = url_of(self._sock)
        app = create_app(engine, close_engine=True)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
