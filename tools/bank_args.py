"""The bank's options, one definition for both servers (`cas-bank serve` and
`cas-bank mlx-lm-server`): the disk budget, the hot tier, a new bank's block size, how
stores are written and the shared tier (`remote_args`), with the same names, defaults
and help in both. `bank_config` turns them into the `BankConfig` the server opens its
bank with, or a `CliError` naming the option whose value it refuses."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from cas_bank.config import BankConfig

from .common import CliError, positive_int
from .gc_cmd import parse_size
from .remote_args import add_remote_arguments, remote_settings

GROUP = "bank options"
STORE_MODES = ("background", "inline", "off")
DEFAULT_STORES = "background"
# BankConfig's fields these options set (None: left unset), and the option that sets
# each field an error may name (a check of several fields: the shared tier's).
SETTINGS = ("block_size", "max_bytes", "hot_bytes")
OPTION_OF = {
    "block_size": "--block-size",
    "max_bytes": "--max-bytes",
    "hot_bytes": "--hot-bytes",
    "remote": "--remote",
    "remote_tls_ca": "--remote-tls-ca",
    "remote_tls_cert": "--remote-tls-cert",
    "remote_tls_key": "--remote-tls-key",
}


def add_bank_arguments(parser: argparse.ArgumentParser) -> None:
    """The bank's options, in their own section of `parser`'s help."""
    group = parser.add_argument_group(GROUP)
    fields = BankConfig.model_fields
    group.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help=f"tokens per block of a new bank (default {fields['block_size'].default}); an "
        "existing bank keeps its own and refuses another value",
    )
    group.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        metavar="N",
        help="disk budget: the least recently used blocks are evicted to keep the bank's "
        "payload, state and end-record bytes under it (bytes, or 512M, 2GiB, ...; "
        "default: no bound)",
    )
    group.add_argument(
        "--hot-bytes",
        type=parse_size,
        default=None,
        metavar="N",
        help="memory for the bank in this process: the hot tier of decoded blocks and the "
        "leases together (bytes, or 512M, 2GiB, ...; 0 turns both off; default: "
        f"{fields['hot_bytes'].default >> 20}MiB)",
    )
    group.add_argument(
        "--stores",
        default=DEFAULT_STORES,
        choices=STORE_MODES,
        help=f"{DEFAULT_STORES} (default): stores go through the bank's background writer "
        "and no request waits for one; inline: written before the request goes on; off: "
        "nothing is stored (restores still run)",
    )
    add_remote_arguments(group)


def add_deprecated_inline_stores(parser: argparse.ArgumentParser) -> None:
    """`--inline-stores`, the old spelling of `--stores inline` (mlx-lm-server's): it
    still works, with a warning on stderr, and is left out of `--help`."""
    parser.add_argument(
        "--inline-stores",
        action=_DeprecatedInlineStores,
        nargs=0,
        dest="stores",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


class _DeprecatedInlineStores(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            "cas-bank: warning: --inline-stores is deprecated and will be removed; "
            "use --stores inline",
            file=sys.stderr,
        )
        namespace.stores = "inline"


def bank_config(args: argparse.Namespace) -> BankConfig:
    """The `BankConfig` of the bank options in `args`: a block size, budget or hot-tier
    size left out stays unset (a bank keeps its own block size); a refused value, or a
    fleet secret missing for `--remote`, is a `CliError` naming the option."""
    settings: dict[str, Any] = remote_settings(args)
    for field in SETTINGS:
        value = getattr(args, field)
        if value is not None:
            settings[field] = value
    try:
        return BankConfig(**settings)
    except ValidationError as e:
        error = e.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "remote"
        why = str(error["msg"]).removeprefix("Value error, ")
        raise CliError(f"bad {OPTION_OF.get(field, '--remote')}: {why}") from None
