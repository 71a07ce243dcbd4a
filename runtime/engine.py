"""`Engine`: one model behind a queue, generating with the prefix cache.

Requests that arrive together are served one at a time, in arrival order, by a
single worker thread that owns the model and its `PrefixCache`. That is the choice
of this runtime: an mlx-lm prompt cache holds one sequence, the CPU build has no
spare cores for a second forward pass, and a FIFO makes every answer the one the
same request would get alone (greedy output does not depend on the traffic). The
queue is bounded (`max_queue`); a full queue is refused at once (`EngineBusyError`)
rather than letting latency grow without bound.

One request, on the worker:
  restore (longest stored prefix; for an exact repeat, the prompt's end record and
  its logits: no prefill at all) -> prefill the rest (stores its blocks, the states
  the bank asks for and the prompt's end record) -> sample -> decode token by token
  on the same cache, recording the hybrid model's state at every block boundary
  decoding crosses -> stop at an end token, `max_tokens` or a stop string -> store
  prompt + response (the tokens that went through the model) and its end record, so
  that the next turn of the conversation restores through this answer exactly.

Callers hand `submit` a sink: it receives a `TextDelta` per generated token (the
text may be "" while a character or a possible stop string is incomplete), then the
`GenerationResult`, or an exception. The sink runs on the worker thread and must
not block.

Here: the queue, the worker and the engine's life (open, check, submit, stop, close);
one request on the worker (the steps above) is `runtime.generate_request`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cas_bank.bank import Bank
from cas_bank.config import BankConfig
from cas_bank.errors import InvalidInputError

from . import prompts
from .decoding import Sampler
from .generate_request import Job, generate_request
from .generation import (
    EngineBusyError,
    EngineClosedError,
    EngineStats,
    Event,
    GenerationRequest,
    GenerationResult,
    RequestError,
    Sink,
    TextDelta,
)

# DEFAULT_MODEL and resolve_model live in .models now; still importable from here.
from .models import DEFAULT_MODEL as DEFAULT_MODEL
from .models import LoadedModel, model_context_length, resolve_model
from .prefetch import Prefetcher
from .prefill import DEFAULT_CHUNK_SIZE
from .prefix_cache import PrefixCache
from .tokenizer import eos_token_ids

log = logging.getLogger("cas_bank.engine")

DEFAULT_MAX_QUEUE = 64
STORE_MODES = ("background", "inline", "off")


def _bank_config(config: BankConfig | None, given: Mapping[str, Any]) -> BankConfig:
    """`config` (None: the defaults) with the settings in `given` that are not None set
    over it; what `config` leaves unset stays unset (`Bank.open` takes a bank's own
    block size when it is)."""
    settings = {} if config is None else config.model_dump(include=config.model_fields_set)
    settings.update({k: v for k, v in given.items() if v is not None})
    return BankConfig(**settings)


class Engine:
    """Serves `loaded` from `bank` one request at a time (see the module docstring).

    `owns_bank`: `close()` also closes the bank (set by `Engine.open`). A request
    without a `seed` samples with one drawn for it (as OpenAI's API does: the same
    prompt twice gives two answers); a given seed repeats. `chunk_size`: prompt tokens
    per forward pass; a cancelled request (its client gone, a shutdown) stops at the
    end of the current one. `prefetch`: with a shared tier, a request queued while the
    worker is busy has its prefix fetched into the local bank meanwhile
    (`runtime.prefetch`).
    `stores`: `background` (the default: through the bank's background writer, so no
    request waits for a store, before its first token or after its last; inline on a
    bank opened with `write_behind=0`), `inline` (written before the request goes on) or
    `off` (nothing is stored; restores still run). `keep_end` (default True): every
    prompt and every answer keeps its exact end, an end record (`PrefixCache`'s
    `keep_end`), so an exact repeat needs no prefill and the next turn of a
    conversation restores all of the last prompt and answer; False: whole blocks and
    boundary states only.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        bank: Bank,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        owns_bank: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        prefetch: bool = True,
        stores: str = "background",
        keep_end: bool = True,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if stores not in STORE_MODES:
            raise ValueError(f"stores must be one of {', '.join(STORE_MODES)}; got {stores!r}")
        self.stores = stores
        self.loaded = loaded
        self.bank = bank
        self.model_id = loaded.name
        self.context_length = model_context_length(loaded)
        # A full disk degrades the server (answers without storing), never fails it.
        self.prefix_cache = PrefixCache(
            bank,
            loaded,
            skip_store_when_full=True,
            chunk_size=chunk_size,
            background=stores != "inline",
            keep_end=keep_end,
        )
        self.eos_ids = eos_token_ids(loaded.tokenizer)
        self._owns_bank = owns_bank
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("requests", "failed", "prompt_tokens", "cached_tokens", "completion_tokens"), 0
        )
        self._busy = False
        self._closed = False
        self._current: Job | None = None
        self._worker = threading.Thread(target=self._run, name="cas-bank-engine", daemon=True)
        self._worker.start()
        # While the worker is busy, queued requests' prefixes come from the shared tier.
        self.prefetcher = Prefetcher() if prefetch and bank.remote is not None else None

    @classmethod
    def open(
        cls,
        bank_dir: str | Path,
        model: str | Path | None = None,
        *,
        config: BankConfig | None = None,
        block_size: int | None = None,
        seed: int = 0,
        max_queue: int = DEFAULT_MAX_QUEUE,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        remote: str | None = None,
        remote_secret: str | None = None,
        remote_tls_ca: str | None = None,
        remote_tls_cert: str | None = None,
        remote_tls_key: str | None = None,
        stores: str = "background",
        keep_end: bool = True,
    ) -> Engine:
        """Open (or create) the bank at `bank_dir` and serve `model` from it.

        `model`: None for the embedded default, an embedded model name (`tiny-qwen3`,
        ...), or the path of a local mlx-lm model directory. `config`: the bank's
        settings (`BankConfig`: the budget `max_bytes`, the hot tier `hot_bytes`, ...;
        None: the defaults); a block size it leaves unset is the bank's own (64 for a
        new bank). `block_size` and the `remote*` keywords, where given, are set over
        `config`: `block_size` as `BankConfig.block_size`, `remote` the shared tier's
        URL, `remote_secret` its fleet secret (required with it), `remote_tls_*` its TLS
        files (`BankConfig.remote_tls_ca` and the client certificate and key).
        `seed`: the embedded model's weights. `chunk_size`: prompt tokens per forward
        pass. `stores`, `keep_end`: see the class.
        """
        given = {
            "block_size": block_size,
            "remote": remote,
            "remote_secret": remote_secret,
            "remote_tls_ca": remote_tls_ca,
            "remote_tls_cert": remote_tls_cert,
            "remote_tls_key": remote_tls_key,
        }
        config = _bank_config(config, given)  # a bad setting: refused before the model loads
        loaded = resolve_model(model, seed=seed)
        bank = Bank.open(bank_dir, config)
        try:
            return cls(
                loaded,
                bank,
                max_queue=max_queue,
                owns_bank=True,
                chunk_size=chunk_size,
                stores=stores,
                keep_end=keep_end,
            )
        except BaseException:
            bank.close()
            raise

    # -- requests ------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids for a conversation, through the model's chat template."""
        return prompts.chat_prompt(self.loaded.tokenizer, messages)

    def branch_hints(
        self, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int]
    ) -> tuple[int, ...]:
        """Where later prompts likely leave this one (`prompts.branch_hints`)."""
        return prompts.branch_hints(self.loaded.tokenizer, messages, prompt)

    def text_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids for a completion: text through the tokenizer, or ids as given."""
        return prompts.text_prompt(self.loaded.tokenizer, prompt)

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """The request as it will run (max_tokens resolved), or a `RequestError`."""
        n = len(request.prompt)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        try:
            self.prefix_cache.tokens(request.prompt)
        except InvalidInputError as e:
            raise RequestError(str(e), param="prompt") from e
        if n >= self.context_length:
            raise RequestError(
                f"the prompt has {n} tokens; model {self.model_id!r} has a context of "
                f"{self.context_length} tokens and needs room for at least one more",
                code="context_length_exceeded",
            )
        room = self.context_length - n
        if request.max_tokens is not None and request.max_tokens < 0:
            raise RequestError(
                f"max_tokens must be >= 0, got {request.max_tokens}", param="max_tokens"
            )
        limit = room if request.max_tokens is None else min(request.max_tokens, room)
        try:  # bad settings fail here, before queueing (MLX work stays on the worker)
            Sampler.check(
                self.prefix_cache.vocab_size,
                temperature=request.temperature,
                top_p=request.top_p,
                logit_bias=request.logit_bias,
            )
        except InvalidInputError as e:
            raise RequestError(
                str(e), param="logit_bias" if "logit_bias" in str(e) else None
            ) from e
        return dataclasses.replace(request, prompt=list(request.prompt), max_tokens=limit)

    def submit(self, request: GenerationRequest, sink: Sink) -> Job:
        """Check and queue `request`; its events go to `sink` (see the module docstring)."""
        job = Job(self.check(request), sink)
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise EngineBusyError(
                f"{self._jobs.maxsize} requests are already waiting; try again later"
            ) from None
        if self.prefetcher is not None and self._busy:
            pc = self.prefix_cache.salted(job.request.cache_salt)
            self.prefetcher.submit(pc, job.request.prompt)
        return job

    def generate(
        self, request: GenerationRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerationResult:
        """Submit and wait: the blocking form, for scripts and the demo."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.submit(request, events.put)
        while True:
            event = events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerationResult):
                return event
            if on_delta is not None:
                on_delta(event)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> EngineStats:
        p = self.prefetcher
        prefetch = (
            {
                "prefetches": p.requests,
                "prefetched_blocks": p.blocks,
                "prefetches_dropped": p.dropped,
                "prefetches_failed": p.failed,
            }
            if p is not None
            else {}
        )
        with self._lock:
            return EngineStats(
                queue_depth=self._jobs.qsize(), busy=self._busy, **self._counts, **prefetch
            )

    def stop(self) -> None:
        """Begin shutting down at once (a signal handler may call it): refuse new and
        queued requests, and stop the running one at its next token. `close` then
        waits for the worker."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.sink(EngineClosedError("the engine shut down before this request ran"))
        current = self._current
        if current is not None:
            current.cancel()

    def close(self) -> None:
        """Finish the running request, refuse the queued ones, stop; close an owned bank."""
        if self._closed and not self._worker.is_alive():
            return
        self._closed = True
        self._jobs.put(None)  # blocks only while the queue is full; the worker drains it
        self._worker.join()
        if self.prefetcher is not None:
            self.prefetcher.close()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.sink(EngineClosedError("the engine shut down before this request ran"))
        if self._owns_bank:
            self.bank.close()
        else:
            self.bank.flush()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed:
                job.sink(EngineClosedError("the engine shut down before this request ran"))
                continue
            with self._lock:
                self._busy = True
                self._current = job
            try:
                result = generate_request(self, job)
            except Exception as e:  # reported to the caller; the worker keeps serving
                log.exception("cas_bank: request failed")
                self._count(failed=1)
                job.sink(e)
            else:
                self._count(
                    requests=1,
                    prompt_tokens=result.prompt_tokens,
                    cached_tokens=result.cached_tokens,
                    completion_tokens=result.completion_tokens,
                )
                job.sink(result)
            finally:
                with self._lock:
                    self._busy = False
                    self._current = None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d
