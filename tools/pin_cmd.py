"""`cas-bank pin|unpin BANK --tokens FILE`, `cas-bank pins BANK`: prefixes eviction keeps.

A pinned prefix (a system prompt, say) is never evicted: its blocks, their states and
its end record with those beside it (`cas_bank.evict.pins`). The prefix must be stored;
the pin is a record in the bank, so it holds across restarts until `unpin`. `pin` and
`unpin` need the bank's writer lock (stop a server on the bank first); `pins` reads
beside a live writer. With `--max-bytes` (the budget the bank is served with) a pin
that would take every pin's bytes past `--pin-share` of it is refused, as
`Namespace.pin` refuses it under `BankConfig.max_bytes`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cas_bank import Bank, BankConfig
from cas_bank.blocks.hashing import as_token_array, chain_hashes
from cas_bank.evict.eviction import PinReport, pin_prefix, pins, unpin_prefix
from cas_bank.index.chain import read_headers
from cas_bank.index.tree import load_namespaces, namespace_labels

from .bundle import read_token_file
from .common import (
    CliError,
    add_bank_argument,
    add_command,
    emit,
    emit_listing,
    fields,
    human_bytes,
    open_writer,
    print_json,
    read_bank,
    select_namespace,
    short,
    table,
    when,
)
from .gc_cmd import parse_size

_DEFAULT_SHARE = BankConfig.model_fields["pin_share"].default


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "pin",
        cmd_pin,
        "keep a stored prefix (a system prompt) through every eviction, until unpinned",
    )
    _prefix_arguments(p)
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        metavar="N",
        help="the budget the bank is served with: refuse a pin past --pin-share of it",
    )
    p.add_argument(
        "--pin-share",
        type=float,
        default=_DEFAULT_SHARE,
        metavar="F",
        help=f"share of --max-bytes every pin together may hold (default {_DEFAULT_SHARE})",
    )
    u = add_command(subparsers, "unpin", cmd_unpin, "let a pinned prefix be evicted again")
    _prefix_arguments(u)
    s = add_command(subparsers, "pins", cmd_pins, "list the pinned prefixes and what they hold")
    add_bank_argument(s)


def _prefix_arguments(p: argparse.ArgumentParser) -> None:
    add_bank_argument(p)
    p.add_argument(
        "--tokens",
        type=Path,
        required=True,
        metavar="FILE",
        help="the prefix's token ids: a JSON list or whitespace-separated integers ('-': stdin)",
    )
    p.add_argument(
        "--namespace",
        metavar="NAME",
        help="namespace of the tokens (needed if the bank has several)",
    )


def _root(bank: Bank, wanted: str | None) -> bytes:
    specs, _ = load_namespaces(bank.store)
    labels = namespace_labels(specs, bank.config.block_size)
    if wanted is not None:
        return select_namespace(wanted, specs, labels)
    if len(specs) == 1:
        return next(iter(specs))
    names = ", ".join(sorted(labels.values())) or "none"
    raise CliError(f"give --namespace: the bank has {len(specs)} namespaces ({names})")


def cmd_pin(args: argparse.Namespace) -> int:
    if not 0.0 <= args.pin_share <= 1.0:
        raise CliError(f"--pin-share must be within 0 and 1, got {args.pin_share}")
    tokens = as_token_array(read_token_file(args.tokens))
    with open_writer(args.bank) as bank:
        root = _root(bank, args.namespace)
        bs = bank.config.block_size
        report = pin_prefix(
            bank,
            root,
            tokens,
            chain_hashes(root, tokens, bs),
            block_size=bs,
            max_bytes=args.max_bytes,
            share=args.pin_share,
        )
    if args.json:
        print_json(_report_json(report))
        return 0
    said = "pinned" if report.new else "already pinned"
    limit = "none (no --max-bytes)" if report.limit is None else human_bytes(report.limit)
    emit(
        fields(
            [
                (said, f"{report.tokens} tokens ({report.blocks} blocks)"),
                ("this prefix holds", human_bytes(report.bytes)),
                ("all pins hold", human_bytes(report.pinned_bytes)),
                ("pin limit", limit),
            ]
        )
    )
    return 0


def _report_json(report: PinReport) -> dict[str, Any]:
    return {
        "pinned": report.new,
        "tokens": report.tokens,
        "blocks": report.blocks,
        "bytes": report.bytes,
        "pinned_bytes": report.pinned_bytes,
        "limit": report.limit,
    }


def cmd_unpin(args: argparse.Namespace) -> int:
    tokens = as_token_array(read_token_file(args.tokens))
    with open_writer(args.bank) as bank:
        done = unpin_prefix(bank, _root(bank, args.namespace), tokens)
    if args.json:
        print_json({"unpinned": done})
    else:
        print("unpinned" if done else "not pinned: nothing changed")
    return 0 if done else 1


def _list(bank: Bank) -> list[dict[str, Any]]:
    specs, _ = load_namespaces(bank.store)
    labels = namespace_labels(specs, bank.config.block_size)
    out = []
    for pin in pins(bank.store):
        headers = read_headers(bank.store, list(pin.blocks))
        stored = [h for h in headers if h is not None]
        out.append(
            {
                "namespace": labels.get(pin.root, pin.root.hex()),
                "root": pin.root.hex(),
                "tokens": len(pin.tokens),
                "blocks": len(pin.blocks),
                "blocks_stored": len(stored),
                "bytes": sum(h.payload_size + h.state_size for h in stored),
                "end_records": pin.ends,
                "last_block": pin.blocks[-1].hex() if pin.blocks else None,
                "pinned_at": pin.time,
                "first_tokens": list(pin.tokens[:8]),
            }
        )
    return out


def cmd_pins(args: argparse.Namespace) -> int:
    return emit_listing(args.json, "pins", read_bank(args.bank, _list), _pin_table)


def _pin_table(rows: list[dict[str, Any]]) -> Any:
    return table(
        ["namespace", "tokens", "blocks", "bytes", "last block", "pinned", "first tokens"],
        [
            [
                r["namespace"],
                r["tokens"],
                f"{r['blocks_stored']}/{r['blocks']}",
                human_bytes(r["bytes"]),
                short(bytes.fromhex(r["last_block"])) if r["last_block"] else "-",
                when(r["pinned_at"]),
                " ".join(str(t) for t in r["first_tokens"]),
            ]
            for r in rows
        ],
    )
