"""`cas-bank explain BANK --tokens FILE`: why a prompt did (not) hit.

How far the prompt's chain matched, where it diverged from a stored block and at
which token, which boundaries lacked a recurrent state, which blocks are corrupt,
whether the first missing block was evicted (when, by what) or never stored, and
what a restore would cover now (see `cas_bank.maintenance.explain`). The tokens file holds
the ids a restore looks up: a JSON list or whitespace-separated integers (a runtime
looks up a prompt's ids less the last one). `--json` prints the same as the
server's `POST /v1/explain`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cas_bank import Bank
from cas_bank.index.tree import load_namespaces, namespace_labels
from cas_bank.maintenance.explain import Explanation, explain

from .bundle import read_token_file
from .common import (
    CliError,
    add_bank_argument,
    add_command,
    print_json,
    read_bank,
    select_namespace,
)


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "explain",
        cmd_explain,
        "why a prompt did (not) hit: matched blocks, divergence, missing states, corruption, "
        "evicted or never stored",
    )
    add_bank_argument(p)
    p.add_argument(
        "--tokens",
        type=Path,
        required=True,
        metavar="FILE",
        help="the token ids looked up: a JSON list or whitespace-separated integers ('-': stdin)",
    )
    p.add_argument(
        "--namespace",
        metavar="NAME",
        help="namespace of the tokens (needed if the bank has several)",
    )


def _explain(bank: Bank, args: argparse.Namespace, tokens: list[int]) -> Explanation:
    specs, _ = load_namespaces(bank.store)
    labels = namespace_labels(specs, bank.config.block_size)
    if args.namespace is not None:
        root = select_namespace(args.namespace, specs, labels)
    elif len(specs) == 1:
        root = next(iter(specs))
    else:
        names = ", ".join(sorted(labels.values())) or "none"
        raise CliError(f"give --namespace: the bank has {len(specs)} namespaces ({names})")
    return explain(bank, root, tokens)


def cmd_explain(args: argparse.Namespace) -> int:
    tokens = read_token_file(args.tokens)
    result = read_bank(args.bank, lambda bank: _explain(bank, args, tokens), payloads=True)
    if args.json:
        print_json(result.as_dict())
    else:
        for line in result.summary():
            print(line)
    return 0
