"""`cas-bank export` and `cas-bank import`: move one chain (with its states and its
namespace) between banks as a portable, digest-checked bundle file, e.g. to prewarm
another machine's bank with a shared system prompt.

Export opens the bank read-only (it runs beside a live writer); import needs
the writer's lock and writes everything in one batch after checking the whole bundle.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cas_bank import Bank
from cas_bank.index.tree import HeaderIndex, load_namespaces, namespace_labels, resolve_prefix
from cas_bank.maintenance.bundle import (
    ExportReport,
    chain_for_tokens,
    chain_to_leaf,
    export_chain,
    import_bundle,
    read_bundle,
)

from .common import (
    CliError,
    add_bank_argument,
    add_command,
    emit,
    fields,
    human_bytes,
    open_writer,
    print_json,
    read_bank,
    select_namespace,
)


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "export",
        cmd_export,
        "write one chain with its states to a bundle file",
        "Write one chain (from its first block) with its states and namespace to a "
        "bundle. Name the chain by the tokens of a prompt (the longest stored prefix is "
        "exported) or by a block hash (the chain down to it).",
    )
    add_bank_argument(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="token ids: a JSON list or whitespace-separated integers ('-' for stdin)",
    )
    which.add_argument("--leaf", metavar="HASH", help="the chain's last block (a hex prefix)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="BUNDLE")
    p.add_argument(
        "--namespace", metavar="NAME", help="namespace of --tokens (needed if the bank has several)"
    )

    p = add_command(
        subparsers,
        "import",
        cmd_import,
        "add a bundle's chain to a bank",
        "Check a bundle completely (file digest, every chain hash, payload and state "
        "digest), then add the blocks and states the bank lacks in one batch. A damaged "
        "bundle imports nothing.",
    )
    add_bank_argument(p)
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument(
        "--create",
        action="store_true",
        help="create the bank (with the bundle's block size) if it does not exist",
    )


def read_token_file(path: Path) -> list[int]:
    """Token ids from a JSON list or whitespace-separated integers."""
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as e:
        raise CliError(f"cannot read token file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CliError(f"token file {path} is not text: give a JSON list or integers") from None
    stripped = text.strip()
    try:
        ids = (
            json.loads(stripped) if stripped.startswith("[") else [int(t) for t in stripped.split()]
        )
    except ValueError as e:
        raise CliError(f"token file {path} is neither a JSON list nor integers: {e}") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise CliError(f"token file {path} must hold a flat list of integer ids")
    return ids


def _export(bank: Bank, args: argparse.Namespace, tokens: list[int] | None) -> ExportReport:
    if tokens is None:
        index = HeaderIndex.load(bank.store)
        chain = chain_to_leaf(bank, resolve_prefix(args.leaf, index.keys()))
    else:
        specs, unparsed = load_namespaces(bank.store)
        labels = namespace_labels(specs, bank.config.block_size)
        if args.namespace is not None:
            root = select_namespace(args.namespace, specs, labels)
        elif len(specs) == 1:
            root = next(iter(specs))
        elif not specs:
            why = "whose record parses (run `cas-bank verify`)" if unparsed else ""
            raise CliError(f"the bank at {args.bank} has no namespace {why}: nothing to export")
        else:
            names = ", ".join(sorted(labels.values())) or "none"
            raise CliError(f"give --namespace: the bank has several ({names})")
        chain = chain_for_tokens(bank, root, tokens)
        if not chain:
            raise CliError(
                f"no stored block matches the first {bank.config.block_size} tokens of "
                f"{args.tokens} in namespace {labels[root]}"
            )
    try:
        return export_chain(bank, chain, args.output)
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None


def cmd_export(args: argparse.Namespace) -> int:
    tokens = read_token_file(args.tokens) if args.leaf is None else None
    report = read_bank(args.bank, lambda bank: _export(bank, args, tokens), payloads=True)
    info = {
        "bundle": str(report.path),
        "namespace": report.namespace,
        "blocks": report.blocks,
        "states": report.states,
        "ends": report.ends,
        "tokens": report.tokens,
        "bytes": report.file_bytes,
        "leaf": report.leaf.hex(),
    }
    if args.json:
        print_json(info)
    else:
        emit(
            fields(
                [
                    (
                        "exported",
                        f"{report.blocks} blocks ({report.tokens} tokens), {report.states} "
                        f"states, {report.ends} end record{'' if report.ends == 1 else 's'}",
                    ),
                    ("namespace", report.namespace),
                    ("leaf", report.leaf.hex()),
                    ("bundle", f"{report.path} ({human_bytes(report.file_bytes)})"),
                ]
            )
        )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    if not args.bundle.is_file():
        raise CliError(f"no bundle file at {args.bundle}")
    # Checked before the bank is opened: a damaged bundle touches (or creates) nothing.
    bundle = read_bundle(args.bundle)
    create = bundle.block_size if args.create else None
    hint = f"; `--create` makes one (block size {bundle.block_size}, the bundle's)"
    with open_writer(args.bank, create_block_size=create, create_hint=hint) as bank:
        report = import_bundle(bank, bundle)
    info = {
        "namespace": report.namespace,
        "blocks": report.blocks,
        "blocks_written": report.blocks_written,
        "blocks_existing": report.blocks_existing,
        "states_written": report.states_written,
        "ends_written": report.ends_written,
        "bytes_written": report.bytes_written,
        "leaf": report.leaf.hex(),
    }
    if args.json:
        print_json(info)
    else:
        emit(
            fields(
                [
                    (
                        "imported",
                        f"{report.blocks_written} of {report.blocks} blocks "
                        f"({report.blocks_existing} already stored), "
                        f"{report.states_written} states, {report.ends_written} end records",
                    ),
                    ("namespace", report.namespace),
                    ("written", human_bytes(report.bytes_written)),
                    ("leaf", report.leaf.hex()),
                ]
            )
        )
    return 0
