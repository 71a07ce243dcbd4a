"""The shared tier's options, as `serve` and `mlx-lm-server` take them (`--remote`,
`--remote-tls-*`, the fleet secret in `$CAS_BANK_REMOTE_SECRET`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .common import CliError

SECRET_ENV = "CAS_BANK_REMOTE_SECRET"


def add_remote_arguments(parser: argparse._ActionsContainer) -> None:
    """The shared tier's options, on `parser` or on a group of one's options."""
    parser.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="shared tier: valkey://[user][:password]@host:port of any node of a Valkey "
        "cluster (or one server), valkeys:// for TLS; needs the fleet secret (the MAC key "
        f"of every entry, never the cluster's password) in ${SECRET_ENV}",
    )
    parser.add_argument(
        "--remote-tls-ca",
        default=None,
        metavar="PEM",
        help="with valkeys://: the CA file that signed the servers' certificates "
        "(default: the system's CAs)",
    )
    parser.add_argument(
        "--remote-tls-cert",
        default=None,
        metavar="PEM",
        help="with valkeys://: this host's client certificate (mutual TLS)",
    )
    parser.add_argument(
        "--remote-tls-key",
        default=None,
        metavar="PEM",
        help="the private key of --remote-tls-cert",
    )


def remote_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`BankConfig`'s shared-tier settings from the options (none without `--remote`);
    a `CliError` before anything is opened when the fleet secret is missing."""
    if args.remote is None:
        tls = [args.remote_tls_ca, args.remote_tls_cert, args.remote_tls_key]
        if any(t is not None for t in tls):
            raise CliError("--remote-tls-* options need --remote valkeys://host:port")
        return {}
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise CliError(
            f"--remote needs a fleet secret in ${SECRET_ENV} (one the cluster never "
            "sees): it keys the MAC of every shared-tier entry, and without it anyone who "
            "can log into the cluster could forge entries every host accepts"
        )
    return {
        "remote": args.remote,
        "remote_secret": secret,
        "remote_tls_ca": args.remote_tls_ca,
        "remote_tls_cert": args.remote_tls_cert,
        "remote_tls_key": args.remote_tls_key,
    }
