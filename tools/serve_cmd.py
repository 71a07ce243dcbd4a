"""`cas-bank serve` (the OpenAI-compatible server) and `cas-bank demo` (the main job).

`serve` opens (or creates) the bank directory, builds or loads the model and serves
it until SIGINT/SIGTERM. Its one line on stdout says where it listens (`--json`: the
same as a JSON object), so a script can start it with `--port 0` and read the port.
The bank keeps every prefix across restarts of the server on the same `--bank`.

`demo` plays a fleet of agents against the server, restarts it, plays one more turn
and prints what the bank saved (see `cas_bank.runtime.demo`). Without `--bank` it
works in a temporary directory, so every run starts clean.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cas_bank.blocks.bankdir import check_directory
from cas_bank.errors import BankLockedError, BankSettingsError, InvalidInputError

from .bank_args import add_bank_arguments, bank_config
from .common import (
    CliError,
    add_command,
    bank_path,
    console,
    dump_stacks_on_sigusr1,
    port_number,
    positive_int,
    print_json,
)

# The commands' defaults live here (not in the runtime modules, whose imports, MLX and
# FastAPI, would slow down every other command's start).
DEFAULT_BANK_DIR = Path.home() / ".cache" / "cas_bank" / "bank"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_PREFILL_STEP = 512  # runtime.prefill.DEFAULT_CHUNK_SIZE
DEMO_AGENTS = 4
DEMO_TURNS = 3
DEMO_MAX_TOKENS = 32
DEMO_BLOCK_SIZE = 64


def register(subparsers: Any) -> None:
    serve = add_command(
        subparsers,
        "serve",
        _serve,
        help="serve a model over an OpenAI-compatible HTTP API, with the bank as prefix cache",
    )
    _add_served_model_arguments(serve)
    _add_listening_arguments(serve)
    _add_request_arguments(serve)
    add_bank_arguments(serve)

    play = add_command(
        subparsers,
        "demo",
        _demo,
        help="the main job: agents sharing a system prompt, a restart, what the bank saved",
    )
    _add_demo_workload_arguments(play)
    _add_demo_setup_arguments(play)


def _add_served_model_arguments(serve: argparse.ArgumentParser) -> None:
    """What `serve` serves: the model (and the embedded one's seed) and the bank."""
    serve.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local mlx-lm model directory, or an embedded model name "
        "(default: the embedded tiny-hybrid with a byte tokenizer)",
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the embedded model's weights")
    serve.add_argument(
        "--bank",
        type=bank_path,
        default=DEFAULT_BANK_DIR,
        help="bank directory: a bank, or an empty or new directory to make one in "
        f"(default: {DEFAULT_BANK_DIR})",
    )


def _add_listening_arguments(serve: argparse.ArgumentParser) -> None:
    """Where `serve` listens, and what its HTTP server logs."""
    serve.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    serve.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help="port; 0 picks a free one"
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )


def _add_request_arguments(serve: argparse.ArgumentParser) -> None:
    """How `serve` runs requests: prefill steps and the queue before the model."""
    serve.add_argument(
        "--prefill-step-size",
        type=positive_int,
        default=DEFAULT_PREFILL_STEP,
        metavar="TOKENS",
        help="prompt tokens per forward pass (as mlx_lm.server's option); a request whose "
        "client goes away, or a shutdown, stops its prefill at the end of the current step",
    )
    serve.add_argument(
        "--max-queue", type=positive_int, default=64, help="requests that may wait for the model"
    )


def _add_demo_workload_arguments(play: argparse.ArgumentParser) -> None:
    """What the demo's agents do: how many, how many turns, how long each reply."""
    play.add_argument("--agents", type=positive_int, default=DEMO_AGENTS, help="agents")
    play.add_argument(
        "--turns", type=positive_int, default=DEMO_TURNS, help="turns before the restart"
    )
    play.add_argument(
        "--max-tokens", type=positive_int, default=DEMO_MAX_TOKENS, help="tokens per reply"
    )


def _add_demo_setup_arguments(play: argparse.ArgumentParser) -> None:
    """Where the demo runs: its bank, block size, model and number of hosts."""
    play.add_argument(
        "--bank", type=bank_path, default=None, help="bank directory (default: a temporary one)"
    )
    play.add_argument(
        "--block-size", type=positive_int, default=DEMO_BLOCK_SIZE, help="tokens per block"
    )
    play.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local mlx-lm model directory (its tokenizer and chat template), or an "
        "embedded model name (default: the embedded tiny-hybrid)",
    )
    play.add_argument(
        "--hosts",
        type=positive_int,
        default=1,
        help="N > 1: start a local 3-master Valkey cluster and N hosts sharing it; agents "
        "move to another host every turn and still restore",
    )


def _serve(args: argparse.Namespace) -> int:
    dump_stacks_on_sigusr1()
    config = bank_config(args)  # a bad value, no fleet secret: refused before anything
    check_directory(args.bank, create=True)  # a file, other files: before the model loads
    from cas_bank.runtime.engine import Engine
    from cas_bank.runtime.process import server_settings
    from cas_bank.runtime.server import bind, run_server, url_of

    server_settings()  # restores reuse freed caches' memory (keep_freed_memory)
    args.bank.parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = Engine.open(
            args.bank,
            args.model,
            config=config,
            seed=args.seed,
            max_queue=args.max_queue,
            chunk_size=args.prefill_step_size,
            stores=args.stores,
        )
    except InvalidInputError as e:  # e.g. a TLS file missing: the message names it
        raise CliError(str(e)) from None
    except BankLockedError:
        raise CliError(f"bank at {args.bank} is held by another process (a server?)") from None
    except BankSettingsError as e:
        if args.block_size is None or "block_size=" not in str(e):
            raise
        raise CliError(f"{e}: leave out --block-size to serve it with its own") from None
    from cas_bank.runtime.process import freeze_startup_objects

    freeze_startup_objects()  # no full collection over the model inside a request
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        engine.close()
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    url = url_of(sock)
    if args.json:
        ready = {"url": url, "model": engine.model_id, "bank": str(args.bank)}
        if engine.bank.remote is not None:
            ready["remote"] = engine.bank.remote.url
        print(json.dumps(ready), flush=True)
    else:
        print(
            f"cas-bank serve: {engine.model_id} at {url}/v1 (bank {args.bank}, "
            f"block size {engine.bank.config.block_size}"
            + (f", shared tier {engine.bank.remote.url})" if engine.bank.remote else ")"),
            flush=True,
        )
    run_server(engine, sock, log_level=args.log_level)  # closes the engine when it stops
    # The process exits next: its last garbage collection, over everything MLX, mlx-lm
    # and transformers loaded, takes seconds on a busy machine, and nothing needs it.
    gc.freeze()
    return 0


def _progress(args: argparse.Namespace, out: Console) -> Progress:
    """The demos' progress bar (on stderr when the report goes to stdout as JSON)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out if not args.json else console_stderr(),
        transient=True,
    )


def _demo(args: argparse.Namespace) -> int:
    if args.hosts > 1:
        return _fleet_demo(args)
    from cas_bank.runtime.demo import report_tables, run_demo

    out = console()
    steps = args.agents * (args.turns + 1) + args.agents
    with _progress(args, out) as bar:
        task = bar.add_task("starting the server", total=steps)

        def step(message: str) -> None:
            bar.update(task, advance=1, description=message)

        report = run_demo(
            args.agents,
            args.turns,
            bank_dir=args.bank,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            progress=step,
            model=args.model,
        )
    if args.json:
        print_json(report.as_dict())
        return 0
    for t in report_tables(report):
        out.print(t)
        out.print()
    return 0


def _fleet_demo(args: argparse.Namespace) -> int:
    from cas_bank.runtime.fleet_demo import fleet_tables, run_fleet_demo

    out = console()
    with _progress(args, out) as bar:
        task = bar.add_task(
            "starting the cluster and the hosts", total=1 + args.agents * args.turns
        )

        def step(message: str) -> None:
            bar.update(task, advance=1, description=message)

        report = run_fleet_demo(
            args.hosts,
            args.agents,
            args.turns,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            model=args.model,
            progress=step,
        )
    if args.json:
        print_json(report.as_dict())
        return 0
    for t in fleet_tables(report):
        out.print(t)
        out.print()
    return 0


def console_stderr() -> Console:
    return Console(file=sys.stderr)
