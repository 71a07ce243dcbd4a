"""The `cas-bank` console script: `cas-bank --version` with the library alone, and a
one-line error naming the extra to install when the runtime's packages are missing
(the commands need `pip install "cas_bank[runtime]"`: rich, FastAPI, uvicorn, mlx-lm)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

RUNTIME = ("rich", "fastapi", "uvicorn", "mlx_lm", "starlette", "transformers")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        from .about import version_text

        print(version_text())
        return 0
    try:
        from .cli import main as run
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in RUNTIME:
            raise
        print(
            f"cas-bank: error: the commands need the runtime extra ({missing} is not "
            'installed): pip install "cas_bank[runtime]"',
            file=sys.stderr,
        )
        return 2
    return run(args)
