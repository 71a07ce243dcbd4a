"""How many of the project's functions and files a restore and an inline store run.

The measure of issue 42's "a newcomer follows a restore": a stored prompt restored
with `PrefixCache.restore` after the bank is reopened, and an inline `prefill` that
stores, each traced with `sys.setprofile`; every distinct function of cas_bank's
own code that runs is counted, with the files it lives in. Comprehensions and lambdas
are code objects of their own to `sys.setprofile`; the count of named functions (a
`def` a reader opens) leaves them out.

    python -m benchmarks.trace_paths [--model tiny-qwen3] [--list]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOTS = tuple(
    str(Path(__file__).resolve().parent.parent / part) + "/" for part in ("cas_bank", "runtime")
)


def traced(fn: Callable[[], Any]) -> set[tuple[str, str]]:
    """The (file, function) pairs of the project's code that `fn()` runs."""
    seen: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(ROOTS):
                seen.add((path, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def measure(model_name: str) -> dict[str, set[tuple[str, str]]]:
    from cas_bank.runtime import PrefixCache, build_model

    from cas_bank import Bank, BankConfig

    loaded = build_model(model_name, seed=0)
    tokens = np.random.default_rng(0).integers(0, 200, size=300).tolist()
    out: dict[str, set[tuple[str, str]]] = {}
    # Whole blocks only, as the issue measured them; then the default, which also keeps
    # the prompt's exact end (an end record: its write, and the restore's read of it).
    for keep_end, label in ((False, ""), (True, ", with its end record")):
        with tempfile.TemporaryDirectory() as tmp:
            config = BankConfig(block_size=16)
            with Bank.open(Path(tmp) / "bank", config) as bank:
                pc = PrefixCache(bank, loaded, background=False, keep_end=keep_end)
                cache = pc.new_cache()
                out[f"inline store (prefill){label}"] = traced(partial(pc.prefill, tokens, cache))
            with Bank.open(Path(tmp) / "bank", config) as bank:
                pc = PrefixCache(bank, loaded)
                out[f"restore after a reopen{label}"] = traced(partial(pc.restore, tokens))
    return out


_ANONYMOUS = re.compile(r"<(listcomp|genexpr|dictcomp|setcomp|lambda)>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--list", action="store_true", help="list the files of each path")
    args = parser.parse_args(argv)
    root = Path(ROOTS[0]).parent
    for name, seen in measure(args.model).items():
        files = sorted({Path(f).relative_to(root).as_posix() for f, _ in seen})
        named = [q for _, q in seen if not _ANONYMOUS.search(q)]
        print(f"{name}: {len(seen)} functions ({len(named)} named) in {len(files)} files")
        if args.list:
            for f in files:
                print(f"    {f}")


if __name__ == "__main__":
    main()
