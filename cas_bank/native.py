"""The native helpers this process uses, and why one is missing.

Two C extensions are built with the package (setup.py): `cas_bank._chain` (a prompt's
chain hashes in one call) and `cas_bank._fill` (payload files read straight into a
restore's arrays, verified). Without them cas_bank does the same work in Python: the
same values, slower. That is never silent: `cas-bank --version`, `cas-bank stats`
and the servers' `/metrics` say which helpers are loaded, and `Bank.open` logs one
warning a process when one is missing.

`CAS_BANK_PURE_PYTHON=1` (any value but empty or `0`) turns both off on purpose: the
Python paths stay tested on every change (`make test`'s pure leg) and a user can
compare.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

PURE_ENV = "CAS_BANK_PURE_PYTHON"
HELPERS = ("_chain", "_fill")
WHAT = {"_chain": "chain hashing", "_fill": "payload fill"}


def pure_python() -> bool:
    """Whether `CAS_BANK_PURE_PYTHON` asks for the Python paths."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _load(name: str) -> tuple[ModuleType | None, str | None]:
    """The helper `cas_bank.<name>`, or None and why not."""
    if pure_python():
        return None, f"turned off by {PURE_ENV}=1"
    try:
        return importlib.import_module(f"cas_bank.{name}"), None
    except ImportError as e:  # not built: the install had no C compiler (or it failed)
        return None, f"not built ({e})"


_loaded = {name: _load(name) for name in HELPERS}
chain_module: ModuleType | None = _loaded["_chain"][0]
fill_module: ModuleType | None = _loaded["_fill"][0]


@dataclass(frozen=True)
class NativeStatus:
    """Which helpers are loaded; `missing` maps each absent one to why."""

    loaded: tuple[str, ...]
    missing: dict[str, str]

    @property
    def complete(self) -> bool:
        return not self.missing

    def summary(self) -> str:
        """One line: what is native, what is not and what that costs."""
        if self.complete:
            return "native helpers: " + ", ".join(f"{n} ({WHAT[n]})" for n in self.loaded)
        why = "; ".join(f"{n}: {reason}" for n, reason in self.missing.items())
        return (
            f"native helpers MISSING ({why}): "
            + " and ".join(WHAT[n] for n in self.missing)
            + " take the slower Python path (same values)"
        )


def status() -> NativeStatus:
    return NativeStatus(
        loaded=tuple(n for n in HELPERS if _loaded[n][0] is not None),
        missing={n: why for n, (mod, why) in _loaded.items() if mod is None and why},
    )


_warned = False


def warn_if_missing(log: logging.Logger) -> bool:
    """Log one warning a process when a helper is missing; whether this call did."""
    global _warned
    s = status()
    if s.complete or _warned:
        return False
    _warned = True
    log.warning("cas_bank: %s", s.summary())
    return True
