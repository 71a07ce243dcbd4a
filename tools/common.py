"""What every `cas-bank` command shares: adding a subcommand (with `--json`), opening a
bank for reading or writing, and printing aligned tables or JSON.

A command module calls `add_command` from its `register(subparsers)` and gives a
handler `(args) -> int` (the exit status). Handlers raise `CliError` (or any
`CasBankError`) for a problem the user can fix; `cli.main` prints it as one line.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cas_bank import Bank, BankConfig
from cas_bank.blocks.bankdir import check_directory
from cas_bank.errors import BankLockedError, InvalidInputError
from cas_bank.index.tree import SALTED
from cas_bank.spec import ModelSpec

Handler = Callable[[argparse.Namespace], int]


class CliError(Exception):
    """A problem with the user's request; printed as `cas-bank: error: <message>`."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (and exit status 2)."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(2, f"cas-bank: error: {message} (see `{self.prog} --help`)\n")


def add_command(
    subparsers: Any, name: str, handler: Handler, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand `name` running `handler`, with the `--json` flag every command has."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help, description=description or help
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument(  # also here: `cas-bank CMD ... --debug` as the hint says
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show a traceback for unexpected errors",
    )
    parser.set_defaults(handler=handler)
    return parser


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr (a server that
    seems hung says where each thread waits); the process goes on. Servers call it."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for out in (sys.stderr, sys.__stderr__):  # a captured stderr has no descriptor
        if out is None:
            continue
        try:
            faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation too
            continue


def bank_path(text: str) -> Path:
    """An argparse type for a bank directory: an empty one (`''`, the current
    directory to `Path`) is refused, not taken as `.`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the bank path is empty; name a directory")
    return Path(text)


MAX_PORT = 65535


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"port {port} is out of range: a port is 0 (a free one) to {MAX_PORT}"
        )
    return port


def positive_int(text: str) -> int:
    """argparse's type for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_port_arguments(argv: Sequence[str]) -> None:
    """Checks the `--port N` / `--port=N` in a command line passed on to another parser
    (mlx_lm.server's), with `port_number`'s message as a `CliError`."""
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--port="):
            value = arg.removeprefix("--port=")
        else:
            continue
        try:
            port_number(value)
        except argparse.ArgumentTypeError as e:
            raise CliError(f"argument --port: {e}") from None


def add_bank_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bank", type=bank_path, metavar="BANK", help="bank directory")


# -- opening banks ---------------------------------------------------------------------
# No hot tier: a tool reads each record once (verify reads every payload), so caching
# would only hold memory; and no spares (`BankConfig.spare_bytes`): a tool restores
# nothing, and a reopened bank would make its last session's at the open. The block
# size is taken from the bank on disk.
_TOOL_CONFIG = BankConfig(hot_bytes=0, spare_bytes=0)


def open_reader(path: Path, *, payloads: bool = False) -> Bank:
    """Open for reading without the writer's lock, so read commands run beside a server.

    Header-only commands get a RocksDB secondary (it follows a live writer). Commands
    that read payloads get a read-only open: RocksDB cannot read BlobDB values through
    a secondary instance (the process crashes; facebook/rocksdb#13296, #13248), and
    payloads of 4 KiB and more live in blob files.
    """
    # No bank, a file, other files, another program's database: refused by the open
    # itself (`cas_bank.blocks.bankdir`), as for a writer.
    return Bank.open(path, _TOOL_CONFIG, mode="read_only" if payloads else "secondary")


def bank_files(path: Path) -> frozenset[tuple[str, int, int]]:
    """Name, size and mtime of every file of a bank: it changes whenever a writer
    appends to its log, flushes or compacts. Empty for a path that is no directory."""
    out = set()
    if not path.is_dir():
        return frozenset()
    for entry in os.scandir(path):
        try:
            st = entry.stat()
        except FileNotFoundError:  # deleted by the writer while we looked
            continue
        out.add((entry.name, st.st_size, st.st_mtime_ns))
    return frozenset(out)


T = TypeVar("T")
READ_ATTEMPTS = 3


def read_bank(path: Path, work: Callable[[Bank], T], *, payloads: bool = False) -> T:
    """`work(bank)` on a reader's view of the bank (see `open_reader`).

    Opening beside a live writer can race with it: a file the writer deletes after a
    flush or compaction may vanish between the open's look at the manifest and its
    read. An error is therefore tried again (up to `READ_ATTEMPTS` looks) when the
    bank's files changed meanwhile; on a bank that stood still it is raised at once.
    """
    for attempt in range(READ_ATTEMPTS):
        before = bank_files(path)
        try:
            with open_reader(path, payloads=payloads) as bank:
                return work(bank)
        except (CliError, InvalidInputError):  # the request's fault: no second look
            raise
        except Exception:
            if attempt + 1 == READ_ATTEMPTS or bank_files(path) == before:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def open_writer(
    path: Path,
    *,
    create_block_size: int | None = None,
    create_hint: str = "",
    config: BankConfig | None = None,
) -> Bank:
    """Open as the one writer; a clear error when another process holds the bank.

    A missing bank is an error (`create_hint` says how to make one), unless
    `create_block_size` is given: then it is made. A file or a directory of other
    files is refused either way (`cas_bank.blocks.bankdir`). `config`: instead of the
    tools' own (no hot tier), e.g. with a shared tier.
    """
    exists = check_directory(path, create=True)
    if not exists and create_block_size is None:
        raise CliError(f"no bank at {path}{create_hint}")
    config = config or _TOOL_CONFIG
    if not exists:
        config = config.model_copy(update={"block_size": create_block_size})
    try:
        return Bank.open(path, config, mode="read_write")
    except BankLockedError:
        raise CliError(
            f"bank at {path} is held by another writer (a server?); stop it first"
        ) from None


def open_for_serving(path: Path, config: BankConfig) -> Bank:
    """The bank a server runs on (made if missing, its parent directory too); a clear
    error for what the open refuses (a TLS file missing: the message names it) or when
    another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return Bank.open(path, config)
    except InvalidInputError as e:
        raise CliError(str(e)) from None
    except BankLockedError:
        raise CliError(f"bank at {path} is held by another process (a server?)") from None


# -- output --------------------------------------------------------------------------
def console() -> Console:
    """A console for stdout; wide when piped, so tables are not wrapped at 80 columns."""
    width = None if sys.stdout.isatty() else 200
    return Console(width=width, highlight=False, soft_wrap=False)


def emit(*renderables: Any) -> None:
    """Print tables and text to stdout, without the trailing blanks rich pads rows with."""
    out = console()
    with out.capture() as captured:
        for r in renderables:
            out.print(r)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def emit_listing(
    as_json: bool, name: str, rows: list[dict[str, Any]], render: Callable[[list[Any]], Any]
) -> int:
    """A listing command's output: `{name: rows}` with `--json`, `no <name>` when
    there are none, else `render(rows)` (a table); the command's exit status."""
    if as_json:
        print_json({name: rows})
    elif not rows:
        print(f"no {name}")
    else:
        emit(render(rows))
    return 0


RICH_TABLE_ROWS = 200
"""Above this many rows `table` lays text out itself: rich's per-row layout would make
`ls` of a large bank take minutes (docs/design.md, "Where each figure is measured").
The layout is the same."""


def table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None
) -> Table | Text:
    """An aligned table: numbers right, text left, two spaces apart, no wrapping."""
    numeric = [
        bool(rows) and all(isinstance(r[i], (int, float)) for r in rows)
        for i in range(len(columns))
    ]
    if len(rows) > RICH_TABLE_ROWS:
        return _plain_table(columns, rows, numeric, title)
    t = Table(title=title, box=None, header_style="bold", pad_edge=False, title_justify="left")
    for name, num in zip(columns, numeric, strict=True):
        t.add_column(name, justify="right" if num else "left", no_wrap=True)
    for r in rows:
        t.add_row(*(Text(str(c)) for c in r))  # Text: no markup parsing of names
    return t


def _plain_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], numeric: list[bool], title: str | None
) -> Text:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(name), *(len(r[i]) for r in cells)) for i, name in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = Text(no_wrap=True, overflow="ignore")
    if title:
        out.append(title + "\n")
    out.append(line(columns) + "\n", style="bold")
    out.append("\n".join(line(r) for r in cells))
    return out


def fields(pairs: Sequence[tuple[str, Any]]) -> Table:
    """Aligned `name  value` lines (a two-column table without a header)."""
    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for name, value in pairs:
        t.add_row(name, Text(str(value)))
    return t


def plural(n: int, word: str) -> str:
    """`n` and `word`, with an s unless `n` is 1 ("1 chain", "3 blocks")."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def short(h: bytes, n: int = 12) -> str:
    return h.hex()[:n]


def when(seconds: float | None) -> str:
    """A last-use time as `YYYY-mm-dd HH:MM:SS` (local), or '-' when unknown."""
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def select_namespace(wanted: str, specs: dict[bytes, ModelSpec], labels: dict[bytes, str]) -> bytes:
    """The root named by `wanted`: a display label, a model name (its unsalted
    namespace where salted ones share the name), or a root hex prefix."""
    hits = [r for r, label in labels.items() if label == wanted]
    if not hits:
        named = [r for r, spec in specs.items() if spec.name == wanted]
        plain = [r for r in named if SALTED not in labels.get(r, "")]
        hits = plain if len(plain) == 1 else named
    w = wanted.lower()
    if not hits and len(w) >= 4 and all(c in "0123456789abcdef" for c in w):
        hits = [r for r in specs if r.hex().startswith(w)]
    known = ", ".join(sorted(labels.values())) or "none"
    if not hits:
        raise CliError(f"no namespace {wanted!r} in this bank (namespaces: {known})")
    if len(hits) > 1:
        names = ", ".join(sorted(labels[r] for r in hits))
        raise CliError(
            f"namespace {wanted!r} is ambiguous ({names}); give one of these labels or a "
            "root's hex prefix"
        )
    return hits[0]
