"""What the shared-tier benchmarks set up alike: the fleet secret, a host's bank
config (hot tier off, so every restore reads RocksDB or the cluster) and running one
benchmark alone from the command line."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from cas_bank import BankConfig

SECRET = "bench fleet secret"

S = TypeVar("S")


def bank_config(block_size: int, url: str | None, **more: Any) -> BankConfig:
    """A host's config: on the cluster at `url` with the fleet secret, or alone (None)."""
    return BankConfig(
        block_size=block_size,
        hot_bytes=0,
        remote=url,
        remote_secret=SECRET if url else None,
        **more,
    )


def run_alone(run: Callable[[Path, S], dict[str, Any]], s: S, prefix: str) -> dict[str, Any]:
    """`run(workdir, s)` in a temporary directory; print its figures as JSON, return them."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        res = run(Path(tmp), s)
    print(json.dumps(res, indent=2, default=str))
    return res
