"""`cas-bank`: block-level tools to see, verify, move and prune what a bank holds.

Each command group lives in its own module with a `register(subparsers)` function;
`COMMAND_MODULES` below lists them. Errors the user can act on (no such bank, an
ambiguous hash prefix, a damaged bundle, a bad argument) are one line on stderr,
`cas-bank: error: ...`, and a non-zero exit status; never a traceback (`--debug`
shows one for an unexpected failure).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType

from cas_bank.errors import CasBankError

from . import (
    bundle,
    explain_cmd,
    gc_cmd,
    inspect_cmds,
    mlx_lm_cmd,
    mlx_vlm_cmd,
    pin_cmd,
    quota_cmd,
    salvage_cmd,
    serve_cmd,
    show_cmd,
    tree_cmd,
    verify_cmd,
)
from .about import VersionAction
from .common import ArgumentParser, CliError

# The command groups, in the order `cas-bank --help` lists them.
# To add a group (serve, demo, gc, ...): write tools/<name>.py with a module docstring
# and `def register(subparsers) -> None`, which calls `common.add_command(subparsers,
# "<name>", handler, help=...)` for each command (that adds `--json`) and adds its
# arguments; the handler takes the parsed args and returns the exit status. Then
# import the module above and append it here. Raise `common.CliError` for user errors.
COMMAND_MODULES: list[ModuleType] = [
    serve_cmd,
    mlx_lm_cmd,
    mlx_vlm_cmd,
    inspect_cmds,
    tree_cmd,
    show_cmd,
    explain_cmd,
    verify_cmd,
    salvage_cmd,
    bundle,
    gc_cmd,
    pin_cmd,
    quota_cmd,
]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="cas-bank",
        description="Serve models with a cas_bank prefix cache, and inspect, verify, move "
        "and prune the blocks of a bank. Hashes may be given by a unique hex prefix.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show a traceback for unexpected errors"
    )
    parser.add_argument(
        "--version",
        action=VersionAction,
        help="the version, whether the native helpers are loaded, MLX's version and device",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (0 ok, 1 problems found, 2 bad usage)."""
    parser = build_parser()
    # A command that takes another program's arguments (mlx-lm-server) sets
    # `extra_args`: what cas-bank does not know goes to it in `args.extra`.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        status: int = args.handler(args)
        return status
    except (CliError, CasBankError, FileNotFoundError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # The reader went away (`cas-bank ls BANK | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:
        if args.debug:
            raise
        return _fail(f"{type(e).__name__}: {e} (run with --debug for a traceback)")


def _fail(message: str, status: int = 1) -> int:
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"cas-bank: error: {first}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
