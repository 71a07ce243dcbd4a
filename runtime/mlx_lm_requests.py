"""What `cas-bank mlx-lm-server` checks of a request body before mlx-lm sees it.

mlx-lm's handler reads the body's fields loosely and hands the rest to its generation
thread, where a bad value can end that thread (a stop word that is not a string did, in
mlx-lm 0.32) or reach a tokenizer, a salt's hash, a path or a log. So the handler here
reads the body itself first (`check_body`), and answers mlx-lm's own error shape,
`{"error": message}`, with the field named:

- 400: a `Content-Length` that is not a decimal number of bytes (`body_length`:
  mlx-lm's `int()` takes `+50` and `5_0`, and reads a negative one as "to the end of
  the stream"), a body that is not UTF-8 JSON or nests deeper than Python's JSON
  parser goes, a string that is not Unicode text (a lone surrogate, `"\\ud800"`), and
  fields of the wrong type as OpenAI's API refuses them (`"stream": "yes"`, a prompt
  of `[true, false]` or `[1.0, 2.0]`: `openai_types` holds the checks both servers
  share). mlx-lm's server takes no token ids for a prompt, so a list is refused with
  that said (an empty one, `[[]]`, as empty).
- 413: a `Content-Length` over `MAX_BODY_BYTES` (mlx-lm would allocate that much).
- 404: a `model`, `draft_model` or `adapters` other than what the server was started
  with (`ModelPin`), unless it was started with `--allow-model-switching`: mlx-lm
  would load whatever directory or Hub repo a caller names. The answer echoes neither
  the name asked for nor the server's own paths.

Values are left to mlx-lm's own checks (its ranges, its defaults); only types here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import Field, ValidationError, field_validator

from .openai_types import (
    ModelName,
    RequestModel,
    Salt,
    StreamOptions,
    Text,
    described,
    first_bad_text,
    json_text,
    parsed_json,
    prompt_ids_problem,
)

COMPLETION_ROUTES: Final = ("/v1/completions", "/chat/completions", "/v1/chat/completions")
DEFAULT_MODEL: Final = "default_model"  # mlx-lm's name for the model of --model


MAX_BODY_BYTES: Final = 64 << 20  # a prompt of a model's whole context is far less


class BodyError(Exception):
    """A request refused before mlx-lm sees it: `status` and a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Sampling(RequestModel):
    """The fields mlx-lm's server reads, with OpenAI's types (strict)."""

    model: ModelName = DEFAULT_MODEL
    draft_model: ModelName | None = None
    adapters: ModelName | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    num_draft_tokens: int | None = None
    stop: Text | list[Text] | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: Salt | None = None
    n: int | None = None
    echo: bool = False


class _Message(RequestModel):
    role: Text = Field(min_length=1)
    content: Any = None  # text or parts (images too): its strings are checked as text


class _Chat(_Sampling):
    messages: list[_Message] = Field(min_length=1)


class _Completion(_Sampling):
    prompt: Text

    @field_validator("prompt", mode="before")
    @classmethod
    def _a_string(cls, value: Any) -> Any:
        if isinstance(value, list):
            why = prompt_ids_problem(value) or "token ids are not taken by mlx-lm's server"
            raise ValueError(f"must be a string ({why})")
        if value == "":  # in mlx-lm 0.32 one ended its generation thread for good
            raise ValueError("the prompt is empty")
        return value


@dataclass(frozen=True)
class ModelPin:
    """The names a request may give the model the server was started with (mlx-lm's
    `default_model`, `--model` as given, and the id `/v1/models` lists for it), its
    draft model's, and its adapter."""

    models: frozenset[str]
    drafts: frozenset[str]
    adapter: str | None

    @classmethod
    def of(cls, model: str, draft: str | None, adapter: str | None) -> ModelPin:
        return cls(
            frozenset({DEFAULT_MODEL, *_names(model)}),
            frozenset({DEFAULT_MODEL, *_names(draft)}),
            adapter,
        )

    def refusal(self, body: _Sampling) -> str | None:
        """Why the body asks for another model than this server's, or None."""
        if body.model not in self.models:
            field = "model"
        elif body.draft_model is not None and body.draft_model not in self.drafts:
            field = "draft_model"
        elif body.adapters is not None and body.adapters != self.adapter:
            field = "adapters"
        else:
            return None
        return (
            f"{field}: this server serves only the model it was started with; send "
            f'"model": "{DEFAULT_MODEL}" or the id GET /v1/models lists, and no other '
            "draft_model or adapters"
        )


def served_model_id(model: str | None) -> str | None:
    """The id mlx-lm gives the model of `--model`: its resolved path when it is local."""
    if not model:
        return None
    path = Path(model)
    return str(path.resolve()) if path.exists() else model


def _names(model: str | None) -> set[str]:
    return {n for n in (model, served_model_id(model)) if n}


def body_length(header: str) -> int:
    """The body's length from its `Content-Length` header: decimal digits, spaces or
    tabs around them (HTTP's optional whitespace), nothing else (`BodyError`)."""
    digits = header.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
        raise BodyError(
            400, f"Content-Length must be a decimal number of bytes, not {json_text(header)}"
        )
    if (n := int(digits)) > MAX_BODY_BYTES:
        raise BodyError(
            413, f"Content-Length {digits[:30]} is over this server's {MAX_BODY_BYTES} bytes"
        )
    return n


def check_body(raw: bytes, route: str, pin: ModelPin | None) -> None:
    """Refuse (`BodyError`) a body mlx-lm must not see; `pin`: the model names allowed
    (None: any, `--allow-model-switching`)."""
    try:  # mlx-lm's log decodes it; its parser raises RecursionError past ~1000 levels
        body = parsed_json(raw)
    except ValueError as e:
        raise BodyError(400, str(e)) from None
    if not isinstance(body, dict):
        return  # mlx-lm's own 400 says so
    if (bad := first_bad_text(body)) is not None:
        raise BodyError(400, f"{bad[0]}: {bad[1]}")
    kind = _Completion if route == "/v1/completions" else _Chat
    try:
        parsed = kind.model_validate(body)
    except ValidationError as e:
        raise BodyError(400, described(e.errors())[1]) from None
    if pin is not None and (why := pin.refusal(parsed)) is not None:
        raise BodyError(404, why)
