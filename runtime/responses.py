"""OpenAI answers from engine events: whole, streamed as server-sent events, or errors.

An `EngineRun` is a submitted job seen from the event loop: the engine's worker
thread hands each event to the loop (`call_soon_threadsafe`), and the handler awaits
them. A run whose reader goes away (a client that disconnects, a cancelled handler)
cancels its job, so the model stops generating for nobody.

Streams send one chunk as soon as the first token is sampled (clients measure time
to first token by it), then a chunk whenever text becomes final, then the finish
reason, the usage when asked (`stream_options.include_usage`) and `[DONE]`. An error
after the response started is sent as an `{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from . import openai_types as oa
from .engine import Engine
from .generation import (
    EngineBusyError,
    EngineClosedError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TextDelta,
)

log = logging.getLogger("cas_bank.server")


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param

    def body(self) -> dict[str, Any]:
        detail = oa.ErrorDetail(message=str(self), type=self.type, param=self.param, code=self.code)
        return oa.ErrorBody(error=detail).model_dump()


class EngineRun:
    """A submitted job whose events arrive on this event loop's queue."""

    def __init__(self, engine: Engine, request: GenerationRequest) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Any] = asyncio.Queue()

        def sink(event: Any) -> None:
            # RuntimeError: the loop is gone (server stopped) and nobody listens.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._events.put_nowait, event)

        self.job = engine.submit(request, sink)

    async def events(self) -> AsyncIterator[TextDelta | GenerationResult]:
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    raise api_error(event)
                if isinstance(event, GenerationResult) and event.finish_reason == "cancelled":
                    # Stopped by the server's shutdown: never passed off as a whole answer.
                    raise ApiError(
                        503,
                        f"the server is stopping: the reply was cut off after "
                        f"{event.completion_tokens} tokens",
                        type="server_unavailable",
                        code="shutting_down",
                    )
                yield event
                if isinstance(event, GenerationResult):
                    return
        finally:
            self.job.cancel()  # a client that went away stops its generation

    async def result(self) -> GenerationResult:
        async for event in self.events():
            if isinstance(event, GenerationResult):
                return event
        raise AssertionError("the engine ended a job without a result")


def start_run(engine: Engine, request: GenerationRequest) -> EngineRun:
    try:
        return EngineRun(engine, request)
    except Exception as e:
        raise api_error(e) from e


def api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return ApiError(400, str(e), type="invalid_request_error", code=e.code, param=e.param)
    if isinstance(e, EngineBusyError):
        return ApiError(503, str(e), type="server_overloaded", code="queue_full")
    if isinstance(e, EngineClosedError):
        return ApiError(503, str(e), type="server_unavailable", code="shutting_down")
    log.error("cas_bank: generation failed: %s: %s", type(e).__name__, e)
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


def finish_reason(result: GenerationResult) -> oa.FinishReason:
    return "length" if result.finish_reason == "length" else "stop"


def usage_of(result: GenerationResult) -> oa.Usage:
    return oa.usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _data(model: Any) -> str:
    payload = model if isinstance(model, dict) else model.model_dump(exclude_none=False)
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends every stream with `[DONE]`; an error after the headers went out is an event."""
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as e:
        yield _data(e.body())
    yield "data: [DONE]\n\n"


def chat_chunks(
    run: EngineRun, rid: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[str]:
    async def chunks() -> AsyncIterator[str]:
        first = True
        async for event in run.events():
            if isinstance(event, TextDelta):
                # The first token is sent at once (with the role), even with no text
                # yet: clients measure time to first token by it.
                if event.text or first:
                    delta = oa.ChatDelta(role="assistant" if first else None, content=event.text)
                    choice = oa.ChatChunkChoice(delta=delta)
                    yield _data(_chat_chunk(rid, created, model, [choice]))
                    first = False
                continue
            choice = oa.ChatChunkChoice(delta=oa.ChatDelta(), finish_reason=finish_reason(event))
            yield _data(_chat_chunk(rid, created, model, [choice]))
            if include_usage:
                yield _data(_chat_chunk(rid, created, model, [], usage=usage_of(event)))

    return _guarded(chunks())


def _chat_chunk(
    rid: str,
    created: int,
    model: str,
    choices: list[oa.ChatChunkChoice],
    usage: oa.Usage | None = None,
) -> oa.ChatCompletionChunk:
    return oa.ChatCompletionChunk(
        id=rid, created=created, model=model, choices=choices, usage=usage
    )


def completion_chunks(
    run: EngineRun, rid: str, created: int, model: str, include_usage: bool, echo: str
) -> AsyncIterator[str]:
    def chunk(text: str, finish: oa.FinishReason | None) -> oa.Completion:
        choice = oa.CompletionChoice(text=text, finish_reason=finish)
        return oa.Completion(id=rid, created=created, model=model, choices=[choice])

    async def chunks() -> AsyncIterator[str]:
        first = True
        async for event in run.events():
            if isinstance(event, TextDelta):
                if event.text or first:
                    yield _data(chunk((echo if first else "") + event.text, None))
                    first = False
                continue
            if first and echo:  # no token came (max_tokens 0): the echo goes out alone
                yield _data(chunk(echo, None))
            yield _data(chunk("", finish_reason(event)))
            if include_usage:
                done = oa.Completion(
                    id=rid, created=created, model=model, choices=[], usage=usage_of(event)
                )
                yield _data(done)

    return _guarded(chunks())
