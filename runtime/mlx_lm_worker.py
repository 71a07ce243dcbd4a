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

It also pins the model (`pinned`): every request is served by the model the server
was started with, whatever names the handler accepted for it (`mlx_lm_requests`), so
mlx-lm's `ModelProvider` never loads another. And a failure to read a model's files
(with `--allow-model-switching`) is answered without the paths its message names.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Final

log = logging.getLogger("cas_bank.mlx_lm")

# What the generator subclass overrides or calls: an mlx-lm without them is refused.
_NEEDED: Final = ("_generate", "_run_generate", "_next_request", "generate")


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

    class WorkerGenerator(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Before mlx-lm's __init__, which starts the thread that reads them.
            self._in_flight: weakref.WeakSet[Any] = weakref.WeakSet()
            self._took_request = False
            super().__init__(*args, **kwargs)

        def generate(self, request: Any, generation_args: Any, *rest: Any, **kw: Any) -> Any:
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
                    log.critical(
                        "cas-bank mlx-lm-server: mlx-lm's generation thread cannot go on",
                        exc_info=True,
                    )
                    self._generation_failed = True
                    if on_death is not None:
                        on_death(e)
                    return

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

    return WorkerGenerator
