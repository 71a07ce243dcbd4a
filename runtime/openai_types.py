"""The OpenAI wire format the server speaks: request and response models (pydantic).

Only what the server implements is modelled. Requests ignore fields they do not know
and that cannot change the answer (agent frameworks send many: `user`, `metadata`,
`parallel_tool_calls`, ...) but reject values the server cannot honour (`n > 1`, a
negative `max_tokens`, a NaN temperature, `logprobs: true`, a list of `tools`: see
`UNSUPPORTED`) with a 400 naming the field, so a client never gets a silently
different answer than it asked for. A field of `UNSUPPORTED` at its neutral value
(`logprobs: false`, `tools: []`, `tool_choice: "none"`, a penalty of 0) is accepted.

Types are strict, as OpenAI's API checks them: a boolean is `true` or `false` (not
`"yes"`, not 1), a token id is an integer (not `true`, not `1.0`), a number is not a
string. Every text is Unicode text (`text_problem`: JSON can carry a lone UTF-16
surrogate, `"\\ud800"`, which no tokenizer, hash or log can take), and the names that
reach a namespace or a log (`model`, `cache_salt`) are also bounded and free of NUL
(`name_problem`). These checks are shared with `cas-bank mlx-lm-server`
(`mlx_lm_requests`) and `/v1/explain`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticUndefined

FinishReason = Literal["stop", "length"]

MAX_SALT_CHARS: Final = 1024
MAX_NAME_CHARS: Final = 1024  # a model's name: a Hugging Face repo id or a local path


# -- edge checks (shared by both servers) -----------------------------------------------
def text_problem(text: str) -> str | None:
    """Why `text` is not Unicode text, or None. JSON's `"\\ud800"` decodes to a lone
    UTF-16 surrogate, which has no UTF-8 form: a tokenizer, a salt's hash and a log
    line all fail on it."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return (
            f"holds a lone UTF-16 surrogate ({text[e.start]!a}) at character "
            f"{e.start}, which is not Unicode text"
        )
    return None


def name_problem(value: object, max_chars: int = MAX_NAME_CHARS) -> str | None:
    """Why `value` cannot be a name that reaches a namespace, a path or a log (a salt,
    a model): not a string of 1 to `max_chars` characters, a NUL, not Unicode text."""
    if not isinstance(value, str) or not 1 <= len(value) <= max_chars:
        return f"must be a string of 1 to {max_chars} characters"
    if "\x00" in value:
        return "must not hold a NUL character"
    return text_problem(value)


def first_bad_text(body: Any) -> tuple[str, str] | None:
    """The first string of a JSON value (object keys too) that is not Unicode text, as
    (where, why) with `where` like `messages.0.content`; None when every one is."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # a loop, not recursion: JSON may nest deeper than Python's stack
        where, value = stack.pop()
        items: Iterable[tuple[Any, Any]]
        if isinstance(value, str):
            if (why := text_problem(value)) is not None:
                return where or "body", why
            continue
        if isinstance(value, dict):
            for key in value:
                if (why := text_problem(key)) is not None:
                    return _joined(where, ascii(key)), f"a key {why}"
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        stack.extend((_joined(where, k), v) for k, v in reversed(list(items)))
    return None


def _joined(where: str, key: object) -> str:
    return f"{where}.{key}" if where else str(key)


def token_ids_problem(ids: Sequence[Any]) -> str | None:
    """Why `ids` are not token ids (integers >= 0; not booleans, not 1.0), or None."""
    for t in ids:
        if type(t) is not int or t < 0:
            return f"token ids are integers >= 0, not {json_text(t)}"
    return None


def prompt_ids_problem(prompt: list[Any]) -> str | None:
    """Why a `prompt` sent as a list is not token ids (`[1, 2]`) or one list of them
    (`[[1, 2]]`): empty (`[]`, `[[]]`) or an id that is not one; None otherwise (a
    list of strings, or of several lists, is for the caller's own checks)."""
    nested = len(prompt) == 1 and isinstance(prompt[0], list)
    ids = prompt[0] if nested else prompt
    if not ids:
        return f"the prompt is empty: {'[[]]' if nested else '[]'} holds no token ids"
    if any(isinstance(t, (str, list)) for t in ids):
        return None
    return token_ids_problem(ids)


TOO_DEEP: Final = "the request body nests JSON arrays or objects too deeply to be read"


def parsed_json(raw: bytes) -> Any:
    """`raw` read as UTF-8 JSON; a `ValueError` naming the problem (not UTF-8, not
    JSON, nested deeper than Python's parser goes: it raises `RecursionError`)."""
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the request body is not UTF-8 JSON: {e}") from None
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def described(errors: Sequence[Any]) -> tuple[str | None, str]:
    """pydantic's errors as (the field of the first, one message naming it)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _type_tag(p)]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    msg = str(first["msg"]).removeprefix("Value error, ")  # pydantic's prefix for ours
    return param, f"{where}{msg}{more}"


def _type_tag(part: object) -> bool:
    """A `loc` part pydantic adds for a union's member (`str`, `list[int]`), not a field."""
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part)


_TYPE_NAMES: Final = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _unicode(value: str) -> str:
    if (why := text_problem(value)) is not None:
        raise ValueError(why)
    return value


def _checked_name(max_chars: int) -> Callable[[str], str]:
    def check(value: str) -> str:
        if (why := name_problem(value, max_chars)) is not None:
            raise ValueError(why)
        return value

    return check


Text = Annotated[str, AfterValidator(_unicode)]
"""A string that is Unicode text (`text_problem`)."""
ModelName = Annotated[str, AfterValidator(_checked_name(MAX_NAME_CHARS))]
Salt = Annotated[str, AfterValidator(_checked_name(MAX_SALT_CHARS))]


class RequestModel(BaseModel):
    """The base of request bodies: strict types, unknown fields ignored, null read as
    the field's default."""

    # strict: OpenAI's API takes no "yes" for a boolean and no 1.0 for a token id.
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _none_is_default(cls, value: Any, info: Any) -> Any:
        # Clients (the openai one among them) send explicit nulls for fields they leave
        # unset, which OpenAI's API reads as the default: so do we, for every field
        # whose default is not itself None.
        if value is None and info.field_name is not None:
            default = cls.model_fields[info.field_name].default
            if default is not None and default is not PydanticUndefined:
                return default
        return value


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == ""


def _zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


_NO_TOOLS = "tool calling is not supported by this server (its answers are text only)"

# Fields OpenAI's API has and this server does not honour: what each neutral value
# looks like, and why any other is refused.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (_absent, "log probabilities are not returned by this server"),
    "top_logprobs": (_zero, "log probabilities are not returned by this server"),
    "tools": (_absent, _NO_TOOLS),
    "functions": (_absent, _NO_TOOLS),
    "tool_choice": (lambda v: v in (None, "none", "auto"), _NO_TOOLS),
    "function_call": (lambda v: v in (None, "none", "auto"), _NO_TOOLS),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        'only {"type": "text"} is supported (no JSON mode or schema)',
    ),
    "presence_penalty": (_zero, "penalties are not supported (only 0)"),
    "frequency_penalty": (_zero, "penalties are not supported (only 0)"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported"),
    "suffix": (_absent, "suffix (insertion) is not supported"),
}


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields shared by both endpoints."""

    model: ModelName
    max_tokens: int | None = Field(default=None, ge=0, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=1)
    # vLLM's field: prompts with the same salt share cached prefixes, different salts
    # share nothing (one tenant cannot time another's prompts through the cache).
    cache_salt: Salt | None = None
    # UNSUPPORTED: accepted only at their neutral values.
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator(*UNSUPPORTED, mode="after")
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        neutral, why = UNSUPPORTED[info.field_name]
        if not neutral(value):
            raise ValueError(f"{info.field_name} {json_text(value)}: {why}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit() is True
                raise ValueError(f"logit_bias keys are token ids (0-9 only), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias_by_id(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    role: Text = Field(min_length=1)
    content: Text | list[TextPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # The newer name of max_tokens; either may be sent.
    max_completion_tokens: int | None = Field(default=None, ge=0, strict=True)

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(SamplingFields):
    """`prompt`: a string, a list of token ids, or a one-element list of either."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, value: Any) -> Any:
        # Token ids said plainly (the union's own error names its first member only),
        # and an empty list of them refused here, by the field's name.
        if isinstance(value, list) and (why := prompt_ids_problem(value)) is not None:
            raise ValueError(why)
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(value)}")
            return value[0]
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens


# -- responses ------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class Completion(BaseModel):
    """A `/v1/completions` answer; streamed chunks have the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cas_bank"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ErrorType = Annotated[str, Field(description="invalid_request_error, not_found_error, ...")]


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def json_text(value: Any, limit: int = 60) -> str:
    """`value` as a short JSON snippet for an error message."""
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
