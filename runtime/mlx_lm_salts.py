"""Tenant salts (`cache_salt`) on mlx-lm's own server (`cas-bank mlx-lm-server`).

A request's `cache_salt` (vLLM's field, as `cas-bank serve` takes it) picks the
namespace its prompt is restored from and stored into: the same salt shares every
block, different salts (or none) share none (`BankPromptCache.salted`).

mlx-lm's server hands its prompt cache nothing of the request but the tokens: its
batched path (`BatchGenerator`) fetches and inserts for many requests at once, with
no way to tell whose cache an insert is. So a salted request is served on mlx-lm's
sequential path (`_serve_single`, one request from fetch to insert, as mlx-lm already
does for a request with a seed), with the generator's prompt cache swapped for that
salt's view of the bank for exactly that call. Unsalted requests are batched as
before; a salted one waits for the running batch to finish (mlx-lm drains it).

The salt travels from the HTTP handler to the generation thread as an attribute of
mlx-lm's request and generation-argument objects (`SALT_ATTR`).
"""

from __future__ import annotations

from typing import Any, Final

from .openai_types import MAX_SALT_CHARS, name_problem

SALT_ATTR: Final = "cas_bank_cache_salt"

# What the generator subclass overrides: an mlx-lm without them cannot keep salts apart.
_NEEDED: Final = ("generate", "_is_batchable", "_serve_single")


def request_salt(body: dict[str, Any]) -> str | None:
    """The request's `cache_salt`, checked as `cas-bank serve` checks it (a string of 1
    to 1024 characters, Unicode text, no NUL); ValueError (mlx-lm's 400) names a bad one."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if (why := name_problem(salt, MAX_SALT_CHARS)) is not None:
        raise ValueError(f"cache_salt {why}")
    return str(salt)


def salt_of(obj: Any) -> str | None:
    value = getattr(obj, SALT_ATTR, None)
    return value if isinstance(value, str) else None


def salting_generator(base: Any) -> Any:
    """mlx-lm's `ResponseGenerator` class `base`, serving each salted request from its
    salt's namespaces (see the module docstring)."""
    missing = [name for name in _NEEDED if not hasattr(base, name)]
    if missing:
        raise RuntimeError(
            f"this mlx-lm's ResponseGenerator has no {', '.join(missing)}: cas-bank "
            "mlx-lm-server cannot keep tenants' salts apart with it"
        )

    class SaltingGenerator(base):  # type: ignore[misc]
        prompt_cache: Any  # mlx-lm's (untyped): a `BankPromptCache` here

        def generate(self, request: Any, generation_args: Any, *rest: Any, **kw: Any) -> Any:
            if generation_args is not None:  # (None: mlx-lm's own RuntimeError, below)
                setattr(generation_args, SALT_ATTR, salt_of(request))
            return super().generate(request, generation_args, *rest, **kw)

        def _is_batchable(self, args: Any) -> bool:
            return salt_of(args) is None and bool(super()._is_batchable(args))

        def _serve_single(self, request: Any, stream: Any) -> Any:
            salt = salt_of(request[2])
            if salt is None:
                return super()._serve_single(request, stream)
            shared = self.prompt_cache
            if not hasattr(shared, "salted"):  # a cache without tenants (mlx-lm's own)
                request[0].put(ValueError("cache_salt needs the bank as the prompt cache"))
                return None
            try:  # an error here is this request's, never the generation thread's
                self.prompt_cache = shared.salted(salt)  # this one request, on this thread
            except Exception as e:
                request[0].put(e)
                return None
            try:
                return super()._serve_single(request, stream)
            finally:
                self.prompt_cache = shared

    return SaltingGenerator
