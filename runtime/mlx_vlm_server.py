"""mlx-vlm's own HTTP server with the bank as its prefix cache (`cas-bank mlx-vlm-server`).

This runs `mlx_vlm.server`'s command line itself (`mlx_vlm.server.cli.main`: its
argument parser, its FastAPI app with the OpenAI, Anthropic and Responses routes, its
continuous-batching `ResponseGenerator`, uvicorn), all unchanged but for two things:

- its automatic prefix cache: mlx-vlm makes it with `mlx_vlm.apc.from_env` when it loads
  a model; here that returns a `BankAPC` (`mlx_vlm_apc`) on the bank, whatever
  `APC_ENABLED` says: the bank is the only tier, so every hit it counts is the bank's;
- its generator class: a `ResponseGenerator` that, once its model is loaded, binds the
  manager to it (a model whose images the bank cannot key is refused by name, and the
  server does not start), and registers each request with the manager as it is queued
  (its token ids, pixels and tenant), which mlx-vlm's APC hash alone does not carry.

Requests, images (URLs, `data:` URLs, paths), tenants (`X-APC-Tenant`) and every flag are
mlx-vlm's. `/v1/cache/stats` shows the manager's counts (hits are bank restores) and the
bank's (`bank`). SIGTERM or Ctrl-C stops uvicorn, which unloads the model (the
generator's thread ends); the caller then closes the bank, which writes what is queued.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from queue import Queue
from typing import Any

from cas_bank.bank import Bank

from .mlx_vlm_apc import BankAPC
from .process import server_settings, sigterm_as_interrupt

READY = "cas-bank mlx-vlm-server: listening on"


class _Ready(logging.Handler):
    """Prints one ready line on stdout when uvicorn says where it listens (`--port 0`
    picks a free port): `READY URL`, or with `json_line` a JSON object."""

    def __init__(self, json_line: bool) -> None:
        super().__init__()
        self.json_line = json_line

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"running on (\S+://\S+?:(\d+))", record.getMessage())
        if found is None:
            return
        url, port = found.group(1), int(found.group(2))
        line = json.dumps({"url": url, "port": port}) if self.json_line else f"{READY} {url}"
        print(line, flush=True)


class _Registering(Queue):  # type: ignore[type-arg]
    """The generator's request queue: each request is registered with the manager as it
    is put (on the caller's thread, before the GPU thread can take it)."""

    def __init__(self, manager: BankAPC) -> None:
        super().__init__()
        self.manager = manager

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        extra_hash = getattr(item, "apc_semantic_hash", None)
        if extra_hash is not None:
            args = getattr(item, "args", None)
            salt = getattr(args, "tenant_id", None) or None
            self.manager.remember(int(extra_hash), item.raw_inputs, salt)
        super().put(item, block, timeout)


def generator_class(manager: BankAPC) -> type:
    """mlx-vlm's `ResponseGenerator` with the manager bound and requests registered."""
    generation: Any = importlib.import_module("mlx_vlm.server.generation")
    base: Any = generation.ResponseGenerator

    class BankResponseGenerator(base):  # type: ignore[misc]
        # `ResponseGenerator.__init__` sets `self.requests = Queue()`: taken as ours.
        @property
        def requests(self) -> _Registering:
            return self._bank_requests

        @requests.setter
        def requests(self, _queue: Any) -> None:
            self._bank_requests = _Registering(manager)

        def _initialize_model(self) -> None:
            super()._initialize_model()
            manager.bind(self.model)  # raises for a model the bank cannot key

        def _gpu_embed(
            self, raw_inputs: dict[str, Any], images: Any = None, apc_semantic_hash: Any = None
        ) -> tuple[Any, dict[str, Any]]:
            """mlx-vlm's embedding of a request, with the images' encoder output from the
            bank when it has them (`BankAPC.image_features`)."""
            features = None
            if apc_semantic_hash is not None:
                features = manager.image_features(raw_inputs, int(apc_semantic_hash))
            if features is None:
                return super()._gpu_embed(raw_inputs, images, apc_semantic_hash)  # type: ignore[no-any-return]
            given = {**raw_inputs, "cached_image_features": features}
            ids, kwargs = super()._gpu_embed(given, images, apc_semantic_hash)
            kwargs.pop("cached_image_features", None)  # the embeddings hold them now
            return ids, kwargs

    return BankResponseGenerator


@contextmanager
def _announcing(json_line: bool) -> Iterator[None]:
    """uvicorn's "running on" message prints the ready line (`_Ready`): the handler is
    added once uvicorn has configured its loggers (its configuration replaces them)."""
    config: Any = importlib.import_module("uvicorn.config").Config
    original = config.configure_logging

    def configure_logging(self: Any) -> None:
        original(self)
        logging.getLogger("uvicorn.error").addHandler(_Ready(json_line))

    config.configure_logging = configure_logging
    try:
        yield
    finally:
        config.configure_logging = original


@contextmanager
def _swapped(manager: BankAPC) -> Iterator[None]:
    apc: Any = importlib.import_module("mlx_vlm.apc")
    app: Any = importlib.import_module("mlx_vlm.server.app")

    def from_env(model_namespace: str | None = None, overrides: Any = None) -> BankAPC:
        return manager

    saved = (apc.from_env, app.ResponseGenerator)
    apc.from_env = from_env
    app.ResponseGenerator = generator_class(manager)
    try:
        yield
    finally:
        apc.from_env, app.ResponseGenerator = saved


def serve(
    bank: Bank,
    mlx_vlm_args: Sequence[str],
    *,
    store: bool = True,
    background: bool = True,
    json_line: bool = False,
) -> None:
    """Run mlx-vlm's server with `mlx_vlm_args` (its own command line) on `bank`.

    `store`: False restores only. `background`: stores go through the bank's writer
    (False: inline, on the generation thread). One line on stdout says where it
    listens (`json_line`: a JSON object). Returns when uvicorn stops (SIGINT,
    SIGTERM); the caller closes the bank."""
    server_settings()
    manager = BankAPC(bank, store=store, background=None if background else False)
    cli = importlib.import_module("mlx_vlm.server.cli")
    argv = sys.argv
    sys.argv = ["mlx_vlm.server", *mlx_vlm_args]
    try:
        with (
            _swapped(manager),
            _announcing(json_line),
            sigterm_as_interrupt(),
            contextlib.suppress(KeyboardInterrupt),
        ):
            cli.main()
    finally:
        sys.argv = argv
