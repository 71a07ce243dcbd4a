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
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from cas_bank.bank import Bank
from cas_bank.config import BankConfig
from cas_bank.errors import BankFullError, InvalidInputError

from . import prompts
from .decoding import Sampler, TextStream
from .generation import (
    EngineBusyError,
    EngineClosedError,
    EngineStats,
    Event,
    FinishReason,
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
from .prefill import DEFAULT_CHUNK_SIZE, PrefillCancelled
from .prefix_cache import PrefixCache
from .state_recorder import StateRecorder
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


class Job:
    """A submitted request; `cancel()` stops it at the next token (its blocks are kept)."""

    def __init__(self, request: GenerationRequest, sink: Sink) -> None:
        self.request = request
        self.sink = sink
        self.enqueued_at = time.perf_counter()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclasses.dataclass(frozen=True, slots=True)
class _Decoded:
    """What decoding made: the sampled tokens, why it stopped, the time to the first
    token (from the request's start) and the logits the last token was sampled from."""

    tokens: list[int]
    finish: FinishReason
    ttft: float
    logits: mx.array


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
                result = self._generate(job)
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

    def _generate(self, job: Job) -> GenerationResult:
        request = job.request
        assert request.max_tokens is not None, "submit resolves max_tokens"
        started = time.perf_counter()
        pc = self.prefix_cache.salted(request.cache_salt)
        prompt = list(request.prompt)
        # An exact repeat (a regenerate, a retry) restores the prompt's end record with
        # its logits: the first token is sampled from them, with no forward pass.
        cache, cached, stored_logits = pc.restore_exact(prompt)
        if stored_logits is not None:
            logits = stored_logits
        else:
            try:
                logits = self._prefill(job, pc, prompt, cache, cached)
            except PrefillCancelled as e:  # its blocks so far are stored
                log.info("cas_bank: request cancelled during its prefill: %s", e)
                return self._cancelled_in_prefill(job, cached, started)
        recorder = pc.recorder(cache)
        text = TextStream(self.loaded.tokenizer, request.stop)
        decoded = self._decode(job, cache, recorder, text, logits, started)
        generated = decoded.tokens
        # The last sampled token never went through the model: the cache ends before it.
        # Its end record holds the logits the last token was sampled from: a next turn
        # (or the same conversation again) resumes exactly here.
        through_model = prompt + generated[:-1]
        if self.stores != "off":
            self._store_answer(pc, prompt, through_model, cache, recorder, decoded.logits)
        return GenerationResult(
            text=text.text,
            token_ids=generated,
            finish_reason=decoded.finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            queue_s=started - job.enqueued_at,
            ttft_s=decoded.ttft,
            total_s=time.perf_counter() - started,
        )

    def _prefill(
        self, job: Job, pc: PrefixCache, prompt: list[int], cache: list[Any], cached: int
    ) -> mx.array:
        """The prompt after its `cached` restored tokens through the model (storing its
        blocks and, with `keep_end`, its end record, unless stores are off); the last
        token's logits.
        Raises `PrefillCancelled` when the job is cancelled between chunks."""
        return pc.prefill(
            prompt,
            cache,
            start=cached,
            hints=job.request.branch_hints,
            cancelled=lambda: job.cancelled,
            store=self.stores != "off",
        )

    def _decode(
        self,
        job: Job,
        cache: list[Any],
        recorder: StateRecorder,
        text: TextStream,
        logits: mx.array,
        started: float,
    ) -> _Decoded:
        """Sample from `logits`, then token by token on `cache`, sending each token's
        text to the job's sink, until an end token, a stop string, `max_tokens` or a
        cancel; the state recorder sees every step."""
        request = job.request
        assert request.max_tokens is not None, "submit resolves max_tokens"
        sampler = self._sampler(request)
        generated: list[int] = []
        finish: FinishReason = "length"
        ttft = 0.0
        while len(generated) < request.max_tokens:
            if generated:
                logits = self.loaded.model(mx.array([[generated[-1]]]), cache=cache)[0, -1]
                recorder.observe()  # copies the GDN state when a boundary was just reached
            token = sampler(logits)
            generated.append(token)
            if len(generated) == 1:
                ttft = time.perf_counter() - started
            if token in self.eos_ids:
                finish = "stop"
                job.sink(TextDelta(token, text.finish()))
                break
            piece = text.add(token)
            job.sink(TextDelta(token, piece))
            if text.stopped:
                finish = "stop"
                break
            if job.cancelled:
                finish = "cancelled"
                break
        tail = text.finish()
        if tail:
            job.sink(TextDelta(generated[-1], tail))
        return _Decoded(generated, finish, ttft, logits)

    @staticmethod
    def _store_answer(
        pc: PrefixCache,
        prompt: list[int],
        through_model: list[int],
        cache: list[Any],
        recorder: Any,
        logits: mx.array,
    ) -> None:
        """Store what decoding added: its new full blocks and (`keep_end`) the end record."""
        block = pc.block_size
        try:
            if len(through_model) // block > len(prompt) // block:
                pc.store(through_model, cache, states=recorder, logits=logits)
            elif len(through_model) > len(prompt) and pc.keep_end:
                pc.store_end(through_model, cache, logits=logits)
        except BankFullError as e:  # degraded: the answer still goes out
            log.warning("cas_bank: answer not stored: %s", e)

    def _cancelled_in_prefill(self, job: Job, cached: int, started: float) -> GenerationResult:
        now = time.perf_counter()
        return GenerationResult(
            text="",
            token_ids=[],
            finish_reason="cancelled",
            prompt_tokens=len(job.request.prompt),
            cached_tokens=cached,
            queue_s=started - job.enqueued_at,
            ttft_s=0.0,
            total_s=now - started,
        )

    def _sampler(self, request: GenerationRequest) -> Sampler:
        # A request without a seed gets a fresh one (greedy decoding uses none).
        seed = request.seed if request.seed is not None else secrets.randbits(64)
        return Sampler(
            self.prefix_cache.vocab_size,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=seed,
            logit_bias=request.logit_bias,
        )

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d
