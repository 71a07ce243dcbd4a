"""mlx-lm's own HTTP server with a bank as its prompt cache (`cas-bank mlx-lm-server`).

This runs `mlx_lm.server.main` itself: its argument parser, `ModelProvider`,
`ResponseGenerator` (the sequential and the batched generation paths), `APIHandler`
and HTTP server, all unchanged. The one thing swapped is `mlx_lm.server.run`, the
seven-line function that makes an `LRUPromptCache` and starts the generator: ours
makes a `BankPromptCache` on the model the provider loaded instead (and its
`--draft-model`, whose caches the bank keeps beside the model's), and uses an HTTP
server class that prints the address it bound (so `--port 0` works for scripts), a
handler that takes a request's `cache_salt` and a generator that serves a salted
request from its salt's namespaces (`mlx_lm_salts`). The handler checks every
completion body before mlx-lm sees it (`mlx_lm_requests`: its `Content-Length`, its
JSON, Unicode text, OpenAI's types, and the model the server was started with, unless
`allow_model_switching`),
and answers `/health`, `/metrics` and `/v1/models` itself (`mlx_lm_routes`). The
generator outlives a request's error (`mlx_lm_worker`).

SIGTERM stops the server the way Ctrl-C does (mlx-lm shuts its HTTP server down and
joins its generation thread); the bank is closed after that, on every exit path. A
generation thread that cannot go on stops the server the same way, and `serve` then
raises (the command exits non-zero), so a supervisor restarts it rather than keeping a
process that answers nothing.
"""

from __future__ import annotations

import _thread
import contextlib
import importlib
import io
import json
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cas_bank.bank import Bank
from cas_bank.errors import InvalidInputError
from cas_bank.remote.health import TierProbe

from . import mlx_lm_routes as routes
from .mlx_lm_requests import (
    COMPLETION_ROUTES,
    DEFAULT_MODEL,
    BodyError,
    ModelPin,
    body_length,
    check_body,
)
from .mlx_lm_salts import SALT_ATTR, request_salt, salting_generator
from .mlx_lm_worker import worker_generator
from .models import LoadedModel, weights_digest
from .process import freeze_startup_objects, server_settings, sigterm_as_interrupt
from .prompt_cache_adapter import BankPromptCache

READY = "cas-bank mlx-lm-server: listening on"


def _mlx_lm_server() -> Any:
    """`mlx_lm.server` (untyped; imported when a server starts, not with the tools)."""
    return importlib.import_module("mlx_lm.server")


def announcing_server(json_line: bool) -> type[ThreadingHTTPServer]:
    """mlx-lm's server class, printing one ready line once it listens."""

    class AnnouncingServer(ThreadingHTTPServer):
        def server_activate(self) -> None:
            super().server_activate()
            host, port = self.server_address[:2]
            shown = f"[{host!s}]" if ":" in str(host) else str(host)
            url = f"http://{shown}:{port}"
            if json_line:
                print(json.dumps({"url": url, "port": port}), flush=True)
            else:
                print(f"{READY} {url}", flush=True)

    return AnnouncingServer


def loaded_model(model_provider: Any, *, draft: bool = False) -> LoadedModel:
    """The provider's model (`draft`: its draft model) as a `LoadedModel`: the namespace
    then records its tokenizer's directory, and `cas-bank show` decodes blocks through
    it (a draft model shares the model's tokenizer)."""
    args = model_provider.cli_args
    path = Path(str(args.draft_model if draft else args.model))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model = model_provider.draft_model if draft else model_provider.model
    return LoadedModel(
        model=model,
        config=config,
        name=path.name,
        tokenizer=model_provider.tokenizer,
        weights_digest=weights_digest(model),
    )


@dataclass(frozen=True)
class _HandlerSettings:
    """What a `cas_bank_handler` class was made with (see it)."""

    bank: Bank
    tier: TierProbe | None = None
    cache_stats: Callable[[], dict[str, int]] = dict
    pin: ModelPin | None = None
    draft_model: bool = False


# The methods below go before mlx-lm's `APIHandler` in a `cas_bank_handler` class
# (whose `super()` they reach): typed as a subclass of anything.
_Base: Any = object


class _BankHandler(_Base):  # type: ignore[misc]
    """A `cas_bank_handler` class's own methods (see it)."""

    _settings: _HandlerSettings
    rfile: Any  # the request's stream (BaseHTTPRequestHandler's)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        got = self._settings
        if path == "/health":
            routes.health(self, got.bank, got.tier, draft_model=got.draft_model)
        elif path == "/metrics":
            routes.metrics(self, got.bank, got.tier, got.cache_stats())
        elif path.startswith("/v1/models"):
            routes.models(self, _mlx_lm_server().scan_cache_dir, others=got.pin is None)
        else:
            super().do_GET()

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if self.path not in COMPLETION_ROUTES or length is None:
            super().do_POST()  # mlx-lm answers (a 404, a 411)
            return
        try:
            raw = self.rfile.read(body_length(length))
            check_body(raw, self.path, self._settings.pin)
        except BodyError as e:
            self.close_connection = True  # a body left unread is no next request
            routes.send_json(self, e.status, {"error": str(e)})
            return
        stream = self.rfile
        self.rfile = io.BytesIO(raw)  # mlx-lm reads the body again
        try:
            super().do_POST()
        finally:
            self.rfile = stream

    # A factory's ValueError is mlx-lm's own 400: {"error": message}.
    def handle_text_completions(self) -> Any:
        salt = request_salt(self.body)
        return _tagged(super().handle_text_completions(), salt)

    def handle_chat_completions(self) -> Any:
        salt = request_salt(self.body)
        return _tagged(super().handle_chat_completions(), salt)


def cas_bank_handler(
    handler: Any,
    bank: Bank,
    tier: TierProbe | None = None,
    cache_stats: Callable[[], dict[str, int]] = dict,
    *,
    pin: ModelPin | None = None,
    draft_model: bool = False,
) -> Any:
    """mlx-lm's request handler, with what the bank adds:

    - `/health`, `/metrics` and `/v1/models` (`mlx_lm_routes`): the bank and the shared
      tier `tier` in the health and the metrics (`cache_stats`: the prompt cache's;
      `draft_model`: the health says the bank keeps a draft model's caches too);
    - a completion body is checked before mlx-lm reads it (`mlx_lm_requests`): a 400
      names a `Content-Length` that is not a number (413: one too large), a field of
      the wrong type or a string that is not Unicode text (an empty
      prompt too: in mlx-lm 0.32 one ended its generation thread for good), a 404 a
      model other than the one of `pin` (None: any, as mlx-lm does);
    - a request's `cache_salt` is carried to the generator (`mlx_lm_salts`), with or
      without a draft model.
    """

    class Handler(_BankHandler, handler):  # type: ignore[misc]
        _settings = _HandlerSettings(bank, tier, cache_stats, pin, draft_model)

    return Handler


def _tagged(request: Any, salt: str | None) -> Any:
    setattr(request, SALT_ATTR, salt)
    return request


def make_run(
    bank: Bank,
    *,
    json_line: bool = False,
    capture_states: bool = True,
    background: bool = True,
    store: bool = True,
    allow_model_switching: bool = False,
    on_death: Callable[[BaseException], None] | None = None,
) -> Callable[..., None]:
    """A replacement for `mlx_lm.server.run` that serves from `bank` (`store=False`:
    restores only, nothing is stored).

    `allow_model_switching`: serve the model a request names, as mlx-lm does (default:
    only the model the server was started with). `on_death`: called if the generation
    thread cannot go on (`mlx_lm_worker`)."""
    mls = _mlx_lm_server()

    def run(
        host: str,
        port: int,
        model_provider: Any,
        server_class: Any = None,
        handler_class: Any = None,
    ) -> None:
        args = _started_with_model(model_provider)
        prompt_cache = _prompt_cache(
            bank, model_provider, capture_states=capture_states, background=background, store=store
        )
        pin, pinned = _pins(args, allow_model_switching)
        worker = worker_generator(mls.ResponseGenerator, pinned=pinned, on_death=on_death)
        generator = salting_generator(worker)(model_provider, prompt_cache)
        freeze_startup_objects()  # no full collection over the model inside a request
        tier = TierProbe(bank.remote) if bank.remote is not None else None
        try:
            mls._run_http_server(
                host,
                port,
                generator,
                server_class=server_class or announcing_server(json_line),
                handler_class=handler_class
                or cas_bank_handler(
                    mls.APIHandler,
                    bank,
                    tier,
                    lambda: dict(prompt_cache.stats()),
                    pin=pin,
                    draft_model=prompt_cache.draft_prefix_cache is not None,
                ),
            )
        finally:
            if generator.generation_available():  # an exit other than Ctrl-C / SIGTERM
                generator.stop_and_join()

    return run


def _started_with_model(model_provider: Any) -> Any:
    """The server's arguments, its model loaded; refused without `--model`."""
    args = model_provider.cli_args
    if args.model is None:
        raise InvalidInputError(
            "cas-bank mlx-lm-server needs --model: the bank keeps the caches of the "
            "model it is started with"
        )
    model_provider.load_default()
    return args


def _prompt_cache(
    bank: Bank, model_provider: Any, *, capture_states: bool, background: bool, store: bool
) -> BankPromptCache:
    """The server's prompt cache: a `BankPromptCache` on `bank` for the provider's model
    and, with `--draft-model`, its draft model (speculative decoding's caches are the
    model's followed by the draft model's: each kept in its own namespace, restored to
    the same length). mlx-lm serves every request of a server with a draft model on
    its sequential path: its provider marks such a model not batchable. (A draft model
    named by a request, with `--allow-model-switching`, is another model key: served
    uncached.)"""
    args = model_provider.cli_args
    draft = loaded_model(model_provider, draft=True) if model_provider.draft_model else None
    return BankPromptCache(
        bank,
        loaded_model(model_provider),
        model_key=model_provider.model_key,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        capture_states=capture_states,
        background=None if background else False,
        store=store,
        draft_model=draft,
    )


def _pins(args: Any, allow_model_switching: bool) -> tuple[ModelPin | None, Any]:
    """The model a request must name (None: any) and the `ModelDescription` every
    request is served with (None: the request's own), from mlx-lm's arguments."""
    if allow_model_switching:
        return None, None
    pin = ModelPin.of(args.model, args.draft_model, args.adapter_path)
    mls = _mlx_lm_server()
    return pin, mls.ModelDescription(model=DEFAULT_MODEL, draft=DEFAULT_MODEL, adapter=None)


@contextmanager
def _swapped_run(run: Callable[..., None]) -> Iterator[None]:
    mls = _mlx_lm_server()

    original = mls.run
    mls.run = run
    try:
        yield
    finally:
        mls.run = original


def serve(
    bank: Bank,
    mlx_lm_args: Sequence[str],
    *,
    json_line: bool = False,
    capture_states: bool = True,
    background: bool = True,
    store: bool = True,
    allow_model_switching: bool = False,
) -> None:
    """Run mlx-lm's server with `mlx_lm_args` (its own command line) on `bank`.

    `background`: inserts store through the bank's background writer (False: inline).
    `store`: False stores nothing (restores still run).
    `allow_model_switching`: a request may name another model, which mlx-lm loads
    (default: a 404 for any but the one of `--model`).
    Returns when the server stops (SIGINT or SIGTERM); the caller closes the bank,
    which writes what is still queued. Raises `RuntimeError` when it stopped because
    mlx-lm's generation thread could not go on.
    """
    died: list[BaseException] = []

    def on_death(error: BaseException) -> None:
        died.append(error)
        _thread.interrupt_main(signal.SIGTERM)  # stops the server as SIGTERM does

    mls = _mlx_lm_server()
    server_settings()  # restores reuse freed caches' memory (keep_freed_memory)

    argv = sys.argv
    sys.argv = ["mlx_lm.server", *mlx_lm_args]
    try:
        run = make_run(
            bank,
            json_line=json_line,
            capture_states=capture_states,
            background=background,
            store=store,
            allow_model_switching=allow_model_switching,
            on_death=on_death,
        )
        # A stop (Ctrl-C, SIGTERM) before mlx-lm's serve loop catches it (just after the
        # ready line) is a stop all the same, not an error.
        with _swapped_run(run), sigterm_as_interrupt(), contextlib.suppress(KeyboardInterrupt):
            mls.main()
    finally:
        sys.argv = argv
    if died:
        raise RuntimeError(
            f"mlx-lm's generation thread could not go on ({type(died[0]).__name__}: "
            f"{died[0]}); the server stopped"
        )
