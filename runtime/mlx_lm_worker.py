"""mlx-lm's generation thread under `cas-bank mlx-lm-server`: one request's error never
ends it, and a thread that cannot go on ends the process.

mlx-lm serves every request on one generation thread (`ResponseGenerator._generate`).
An exception that escapes its loop (on its batched path, mlx-lm tokenizes stop words
and builds samplers outside any `try`) ends that thread: mlx-lm's server then answers
every later request 404 "generation thread died" and `/health` 503, and the process
lives on, so a supervisor that watches the process never restarts it. Here
(`worker_generator`):

- an error while the loop holds requests ends those requests (each one's caller gets a
  `RuntimeError`, which mlx-lm's handler answers with a 404 before any reply starts),
  and the loop starts again; requests still queued are served after it;
- an error before the loop took any request (its model cannot be loaded again) is one
  no request caused and no retry gets past: the thread ends, `on_death` is called
  (`mlx_lm_server` stops the server then, and the command exits non-zero).

A prompt whose prefill stops before its end keeps what it computed: on mlx-lm's
batched path a request whose client went away mid-prefill (mlx-lm notices it when a
streamed keepalive cannot be written) is removed from the batch, and the prompts still
in their prefill when the loop stops (SIGTERM) are dropped with it; here each one's
cache and the tokens it holds are inserted into the prompt cache first
(`BankPromptCache.insert_stopped`: its blocks, and an end record with the recurrent
state right where it stopped, without prefilling them again), so the next attempt at
the prompt restores all of it. mlx-lm builds its `BatchGenerator` inside its
generation loop, by the name `mlx_lm.server.BatchGenerator`: that name is swapped once
for a subclass (`_keeping_batch_generator`) that does this only for the batches a
`worker_generator`'s loop makes (a thread-local names their generator) and is mlx-lm's
own for any other. mlx-lm's sequential path (`_serve_single`: seeded and salted
requests) sees a client go only after the prefill, and then stores the whole prompt.

It also pins the model (`pinned`): every request is served by the model the server
was started with, whatever names the handler accepted for it (`mlx_lm_requests`), so
mlx-lm's `ModelProvider` never loads another. And a failure to read a model's files
(with `--allow-model-switching`) is answered without the paths its message names.
"""

from __future__ import annotations

import importlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

log = logging.getLogger("cas_bank.mlx_lm")

# What the generator subclass overrides or calls: an mlx-lm without them is refused.
_NEEDED: Final = ("_generate", "_run_generate", "_next_request", "generate")
# What keeping a cut prompt needs of mlx-lm's BatchGenerator: without them (another
# mlx-lm) a cut prompt is dropped, as mlx-lm does, with a warning.
_BATCH_NEEDED: Final = ("remove", "extract_cache", "_find_uids", "close")
_PREFILLING: Final = 1  # `BatchGenerator._find_uids`'s stage of a prompt in its prefill

# `.owner`: the generator whose loop runs on this thread (its batches keep cut prompts).
_LOOP = threading.local()


def _keeping_batch_generator(base: Any) -> Any:
    """mlx-lm's `BatchGenerator` class `base`; one made inside a `worker_generator`'s
    loop hands the prompts it drops mid-prefill to that generator (`_keep_cut`)."""

    class KeepingBatchGenerator(base):  # type: ignore[misc]
        keeps_cut_prompts = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._owner: Any = getattr(_LOOP, "owner", None)
            if self._owner is not None:
                self._model_key = self._owner.model_provider.model_key
                self._owner._batches.add(self)

        def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
            if self._owner is not None and not return_prompt_caches:
                self.keep_prefilling("its client went away", uids)
            return super().remove(uids, return_prompt_caches)

        def keep_prefilling(self, why: str, uids: Any = None) -> None:
            """Hand the prompts of `uids` still in their prefill (None: all of them) to
            the owner; a failure is logged, and the prompts are dropped as by mlx-lm."""
            try:
                if uids is None:
                    uids = list(self._prompt_batch.uids)
                cut = self.extract_cache(self._prefilling(uids))
                self._owner._keep_cut(list(cut.values()), self._model_key, why)
            except Exception:
                log.exception("cas-bank mlx-lm-server: a prompt cut short could not be kept")

        def close(self) -> None:
            owner: Any = getattr(self, "_owner", None)  # (None if __init__ failed)
            if owner is not None:
                owner._batches.discard(self)
            super().close()

        def _prefilling(self, uids: Iterable[int]) -> list[int]:
            found = self._find_uids(uids).items()
            return [uid for uid, (stage, _) in found if stage == _PREFILLING]

    return KeepingBatchGenerator


def _install_keeping_batches() -> None:
    """Swap `mlx_lm.server.BatchGenerator` for its keeping subclass (once)."""
    mls: Any = importlib.import_module("mlx_lm.server")
    base = mls.BatchGenerator
    if getattr(base, "keeps_cut_prompts", False):
        return
    missing = [name for name in _BATCH_NEEDED if not hasattr(base, name)]
    if missing:
        log.warning(
            "this mlx-lm's BatchGenerator has no %s: a prompt cut short mid-prefill "
            "keeps nothing of it",
            ", ".join(missing),
        )
        return
    mls.BatchGenerator = _keeping_batch_generator(base)


@dataclass(frozen=True)
class _Settings:
    """What a `worker_generator` class was made with."""

    pinned: Any = None  # the `ModelDescription` every request is served with
    on_death: Callable[[BaseException], None] | None = None


# The methods below go before mlx-lm's `ResponseGenerator` in a `worker_generator`
# class (whose `super()` they reach): typed as a subclass of anything.
_Base: Any = object


class _Worker(_Base):  # type: ignore[misc]
    """A `worker_generator` class's own methods (see the module docstring)."""

    _settings = _Settings()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before mlx-lm's __init__, which starts the thread that reads them.
        self._in_flight: weakref.WeakSet[Any] = weakref.WeakSet()
        self._took_request = False
        self._batches: set[Any] = set()  # the loop's live BatchGenerators
        super().__init__(*args, **kwargs)

    def _generate(self) -> None:
        # mlx-lm deletes its `prompt_cache` attribute when its loop ends.
        self._cut_cache = self.prompt_cache
        self._batches = set()
        _LOOP.owner = self
        try:
            super()._generate()
        finally:
            _LOOP.owner = None
            batches, self._batches = self._batches, set()
        for batch in batches:  # the loop stopped: the prompts still in their prefill
            batch.keep_prefilling("the server stopped")

    def _keep_cut(self, cut: list[Any], model_key: Any, why: str) -> None:
        """Insert each (cache, tokens) of a prompt cut short mid-prefill (see the
        module docstring; `insert_stopped` logs its own failures)."""
        cache = self._cut_cache
        if not hasattr(cache, "insert_stopped"):  # a cache without it (not a bank's)
            return
        for prompt_cache, tokens in cut:
            held = list(tokens)
            cache.insert_stopped(model_key, held, prompt_cache)
            log.info(
                "cas-bank mlx-lm-server: a prefill stopped (%s) after %d tokens; they "
                "are stored for the next attempt",
                why,
                len(held),
            )

    def generate(self, request: Any, generation_args: Any, *rest: Any, **kw: Any) -> Any:
        pinned = self._settings.pinned
        if pinned is not None and generation_args is not None:
            generation_args.model = pinned
        try:
            return super().generate(request, generation_args, *rest, **kw)
        except OSError as e:  # a model's files: the message names their paths
            log.warning("cas-bank mlx-lm-server: a model could not be loaded: %s", e)
            raise RuntimeError(
                f"the model could not be loaded ({type(e).__name__}; the server's log says why)"
            ) from None

    def _next_request(self, timeout: Any = None) -> Any:
        request = super()._next_request(timeout)
        if request is not None:  # (response queue, request, arguments)
            self._in_flight.add(request[0])
            self._took_request = True
        return request

    def _run_generate(self) -> None:
        while True:
            self._took_request = False
            try:
                self._generate()
                return  # stopped
            except Exception as e:
                if self._stop:  # stopping anyway
                    log.exception("cas-bank mlx-lm-server: generation ended in an error")
                    return
                if self._took_request:
                    self._fail_requests(e)
                    continue
                self._die(e)
                return

    def _die(self, error: Exception) -> None:
        """The loop failed before it took a request: the thread ends (`on_death`)."""
        log.critical(
            "cas-bank mlx-lm-server: mlx-lm's generation thread cannot go on",
            exc_info=True,
        )
        self._generation_failed = True
        if self._settings.on_death is not None:
            self._settings.on_death(error)

    def _fail_requests(self, error: Exception) -> None:
        log.error(
            "cas-bank mlx-lm-server: a request failed in mlx-lm's generation thread; "
            "the requests it held end with the error, the thread goes on",
            exc_info=error,
        )
        why = type(error).__name__ if isinstance(error, OSError) else repr(error)
        for queue in list(self._in_flight):
            queue.put(RuntimeError(f"the request failed in mlx-lm's generation: {why}"))
        self._in_flight.clear()


def worker_generator(
    base: Any,
    *,
    pinned: Any = None,
    on_death: Callable[[BaseException], None] | None = None,
) -> Any:
    """mlx-lm's `ResponseGenerator` class `base`, made to outlive a request's error (see
    the module docstring). `pinned`: the `ModelDescription` every request is served
    with (None: the request's own, as mlx-lm does)."""
    missing = [name for name in _NEEDED if not hasattr(base, name)]
    if missing:
        raise RuntimeError(
            f"this mlx-lm's ResponseGenerator has no {', '.join(missing)}: cas-bank "
            "mlx-lm-server cannot keep its generation thread going with it"
        )

    _install_keeping_batches()

    class WorkerGenerator(_Worker, base):  # type: ignore[misc]
        _settings = _Settings(pinned, on_death)

    return WorkerGenerator
