"""One request on an `Engine`'s worker: restore the longest stored prefix (for an exact
repeat, the prompt's end record and its logits: no prefill at all), prefill the rest
(storing its blocks, the states the bank asks for and the prompt's end record), sample,
decode token by token on the same cache (the hybrid model's state recorded at every
block boundary decoding crosses), stop at an end token, `max_tokens`, a stop string or
a cancel, and store the prompt with its answer and their end record
(`generate_request`, which `Engine`'s worker runs for each `Job`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from typing import Any, Protocol

import mlx.core as mx

from cas_bank.errors import BankFullError

from .decoding import Sampler, TextStream
from .generation import FinishReason, GenerationRequest, GenerationResult, Sink, TextDelta
from .models import LoadedModel
from .prefill import PrefillCancelled
from .prefix_cache import PrefixCache
from .state_recorder import StateRecorder

log = logging.getLogger("cas_bank.engine")


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


class ServingEngine(Protocol):
    """What a request needs of its `Engine` (which meets it; a protocol, so that this
    module does not import the one that imports it)."""

    loaded: LoadedModel
    prefix_cache: PrefixCache
    eos_ids: frozenset[int]
    stores: str


def generate_request(engine: ServingEngine, job: Job) -> GenerationResult:
    """Serve `job` (see the module docstring): each token's text goes to the job's
    sink as it is made; the result is returned (the worker sends it on)."""
    request = job.request
    assert request.max_tokens is not None, "submit resolves max_tokens"
    started = time.perf_counter()
    pc = engine.prefix_cache.salted(request.cache_salt)
    prompt = list(request.prompt)
    # An exact repeat (a regenerate, a retry) restores the prompt's end record with
    # its logits: the first token is sampled from them, with no forward pass.
    cache, cached, stored_logits = pc.restore_exact(prompt)
    if stored_logits is not None:
        logits = stored_logits
    else:
        try:
            logits = _prefill(engine, job, pc, prompt, cache, cached)
        except PrefillCancelled as e:  # its blocks so far are stored
            log.info("cas_bank: request cancelled during its prefill: %s", e)
            return _cancelled_in_prefill(job, cached, started)
    recorder = pc.recorder(cache)
    text = TextStream(engine.loaded.tokenizer, request.stop)
    decoded = _decode(engine, job, cache, recorder, text, logits, started)
    generated = decoded.tokens
    # The last sampled token never went through the model: the cache ends before it.
    # Its end record holds the logits the last token was sampled from: a next turn
    # (or the same conversation again) resumes exactly here.
    through_model = prompt + generated[:-1]
    if engine.stores != "off":
        _store_answer(pc, prompt, through_model, cache, recorder, decoded.logits)
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
    engine: ServingEngine,
    job: Job,
    pc: PrefixCache,
    prompt: list[int],
    cache: list[Any],
    cached: int,
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
        store=engine.stores != "off",
    )


def _decode(
    engine: ServingEngine,
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
    sampler = _sampler(engine, request)
    generated: list[int] = []
    finish: FinishReason = "length"
    ttft = 0.0
    while len(generated) < request.max_tokens:
        if generated:
            logits = engine.loaded.model(mx.array([[generated[-1]]]), cache=cache)[0, -1]
            recorder.observe()  # copies the GDN state when a boundary was just reached
        token = sampler(logits)
        generated.append(token)
        if len(generated) == 1:
            ttft = time.perf_counter() - started
        if token in engine.eos_ids:
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


def _cancelled_in_prefill(job: Job, cached: int, started: float) -> GenerationResult:
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


def _sampler(engine: ServingEngine, request: GenerationRequest) -> Sampler:
    # A request without a seed gets a fresh one (greedy decoding uses none).
    seed = request.seed if request.seed is not None else secrets.randbits(64)
    return Sampler(
        engine.prefix_cache.vocab_size,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=seed,
        logit_bias=request.logit_bias,
    )
