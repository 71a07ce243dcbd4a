"""`cas-bank mlx-vlm-server`: mlx-vlm's own server, with the bank as its prefix cache.

    cas-bank mlx-vlm-server --bank DIR --model PATH [any other mlx_vlm.server argument]

Everything after cas-bank's own options (`--bank` and the bank options `serve` takes,
from `bank_args`: `--block-size`, `--max-bytes`, `--hot-bytes`, `--stores`, `--remote`
and `--remote-tls-*`) goes to `mlx_vlm.server`'s argument parser as it is; see
`cas_bank.runtime.mlx_vlm_server` for what runs. One line on stdout says where the
server listens (with `--json`, a JSON object), so `--port 0` works for scripts. Needs
the `vision` extra (mlx-vlm).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from .bank_args import add_bank_arguments, bank_config
from .common import (
    CliError,
    add_command,
    bank_path,
    check_port_arguments,
    dump_stacks_on_sigusr1,
    open_for_serving,
)
from .serve_cmd import DEFAULT_BANK_DIR


def register(subparsers: Any) -> None:
    cmd = add_command(
        subparsers,
        "mlx-vlm-server",
        _run,
        help="run mlx-vlm's own HTTP server (mlx_vlm.server) with the bank as its prefix "
        "cache: images in prompts, kept across restarts",
        description="Run mlx_vlm.server with a cas_bank bank as its automatic prefix cache. "
        "Arguments not listed here (--model, --port, --host, ...) are mlx_vlm.server's own.",
    )
    cmd.add_argument(
        "--bank",
        type=bank_path,
        default=DEFAULT_BANK_DIR,
        help=f"bank directory, created if missing (default: {DEFAULT_BANK_DIR})",
    )
    add_bank_arguments(cmd)
    cmd.set_defaults(extra_args=True)


def _run(args: argparse.Namespace) -> int:
    dump_stacks_on_sigusr1()
    check_port_arguments(args.extra)
    _check_model(args.extra)
    if importlib.util.find_spec("mlx_vlm") is None:
        raise CliError('mlx-vlm-server needs mlx-vlm: pip install "cas_bank[vision]"')

    config = bank_config(args)
    from cas_bank.runtime.mlx_vlm_server import serve  # MLX, mlx-vlm: after the checks

    with open_for_serving(args.bank, config) as bank:
        serve(
            bank,
            list(args.extra),
            store=args.stores != "off",
            background=args.stores == "background",
            json_line=args.json,
        )
    # The bank is closed (its queue written). mlx-vlm's server process aborts in the
    # interpreter's teardown ("terminate called without an active exception", with or
    # without the bank, mlx-vlm 0.7.10): end here, with the exit status of a clean stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_model(mlx_vlm_args: list[str]) -> None:
    """Refuse a server without `--model` (the bank keeps the caches of the model the
    server starts with; mlx-vlm would otherwise wait for a request to name one), and one
    with quantized KV (`--kv-bits`, or mlx-vlm's `KV_BITS`): mlx-vlm's prefix cache, whose
    place the bank takes, does not support it (its own start-up check says so)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-bits", default=None)
    given = parser.parse_known_args(mlx_vlm_args)[0]
    if given.model is None:
        raise CliError(
            "mlx-vlm-server needs --model (a local mlx-vlm model directory or a Hugging "
            "Face repo id): the bank keeps the caches of the model it is started with"
        )
    if given.kv_bits is not None or os.environ.get("KV_BITS"):
        raise CliError(
            "mlx-vlm-server does not take --kv-bits (or KV_BITS): mlx-vlm's prefix cache, "
            "which the bank replaces, does not support quantized KV"
        )
