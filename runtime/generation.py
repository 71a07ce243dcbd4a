"""What a generation takes and gives: the request, its events, its errors.

The vocabulary shared by the `Engine` (which produces these) and its callers (the
server, scripts): plain frozen dataclasses and three exception types, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]


class RequestError(ValueError):
    """A request the engine cannot serve as asked; `code` is OpenAI's error code."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class EngineBusyError(RuntimeError):
    """The queue is full: try again later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """Token ids in, sampling settings; `max_tokens=None` means up to the context end."""

    prompt: Sequence[int]
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: Mapping[int, float] | None = None
    branch_hints: tuple[int, ...] = ()  # prompt positions later prompts likely branch at
    cache_salt: str | None = None  # a tenant's salt: the prefix cache it shares


@dataclass(frozen=True, slots=True)
class TextDelta:
    """One generated token and the text it made final."""

    token: int
    text: str


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: list[int] = field(repr=False)
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # restored from the bank, not prefilled
    queue_s: float  # waiting for the worker
    ttft_s: float  # from the worker taking it to the first token (restore + prefill + sample)
    total_s: float  # from the worker taking it to the end (store included)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


Event = TextDelta | GenerationResult | BaseException
Sink = Callable[[Event], None]


@dataclass(frozen=True, slots=True)
class EngineStats:
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_depth: int
    busy: bool
    # The shared tier's prefetch of queued requests' prefixes (zeros without one).
    prefetches: int = 0
    prefetched_blocks: int = 0
    prefetches_dropped: int = 0
    prefetches_failed: int = 0
