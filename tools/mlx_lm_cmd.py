"""`cas-bank mlx-lm-server`: mlx-lm's own server, with the bank as its prompt cache.

    cas-bank mlx-lm-server --bank DIR --model PATH [any other mlx_lm.server argument]

Everything after cas-bank's own options (`--bank`, `--no-capture-states`, `--json`, and
the bank options `serve` takes too, from `bank_args`: `--block-size`, `--max-bytes`,
`--hot-bytes`, `--stores`, `--remote` and `--remote-tls-*`; the old `--inline-stores`
still works, with a warning) goes to `mlx_lm.server`'s argument parser as it is; see
`cas_bank.runtime.mlx_lm_server` for what runs. One line on stdout says where the
server listens (with `--json`, a JSON object), so `--port 0` works for scripts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .bank_args import add_bank_arguments, add_deprecated_inline_stores, bank_config
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
        "mlx-lm-server",
        _run,
        help="run mlx-lm's own HTTP server (mlx_lm.server) with the bank as its prompt cache",
        description="Run mlx_lm.server with a cas_bank bank as its prompt cache. Arguments "
        "not listed here (--model, --port, --kv-bits, ...) are mlx_lm.server's own.",
    )
    cmd.add_argument(
        "--bank",
        type=bank_path,
        default=DEFAULT_BANK_DIR,
        help=f"bank directory, created if missing (default: {DEFAULT_BANK_DIR})",
    )
    cmd.add_argument(
        "--no-capture-states",
        dest="capture_states",
        action="store_false",
        help="hybrid models: do not prefill new prefixes again to capture the recurrent "
        "states at their block boundaries (mlx-lm's own prefill shows none)",
    )
    add_bank_arguments(cmd)
    add_deprecated_inline_stores(cmd)
    cmd.add_argument(
        "--allow-model-switching",
        action="store_true",
        help="serve any model a request names in `model`, `draft_model` or `adapters`, "
        "loading it as mlx_lm.server does (default: only --model and its --draft-model; "
        "any other name is a 404)",
    )
    cmd.set_defaults(extra_args=True)


def _run(args: argparse.Namespace) -> int:
    dump_stacks_on_sigusr1()
    check_port_arguments(args.extra)  # before the bank opens (mlx-lm: an OverflowError)

    _check_model(args.extra)
    config = bank_config(args)
    from cas_bank.runtime.mlx_lm_server import serve  # MLX: after the checks without it

    with open_for_serving(args.bank, config) as bank:
        serve(
            bank,
            list(args.extra),
            json_line=args.json,
            capture_states=args.capture_states,
            allow_model_switching=args.allow_model_switching,
            background=args.stores == "background",
            store=args.stores != "off",
        )
    return 0


def _check_model(mlx_lm_args: list[str]) -> None:
    """Refuse, before anything is made, a `--model` mlx-lm's server cannot load: none,
    or one of cas-bank's embedded models (they have no Hugging Face tokenizer, so only
    `cas-bank serve` runs them; mlx-lm would look the name up on the Hub)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=None)
    model = parser.parse_known_args(mlx_lm_args)[0].model
    if model is None:
        raise CliError(
            "mlx-lm-server needs --model (a local mlx-lm model directory or a Hugging Face "
            "repo id): the bank keeps the caches of the model it is started with"
        )
    from cas_bank.runtime.models import MODEL_NAMES  # MLX: after the checks without it

    if model in MODEL_NAMES and not Path(model).exists():
        raise CliError(
            f"--model {model} is one of cas-bank's embedded models ({', '.join(MODEL_NAMES)}), "
            "which only `cas-bank serve` runs (they have no Hugging Face tokenizer, which "
            "mlx-lm's server needs); give mlx-lm-server a local mlx-lm model directory"
        )
