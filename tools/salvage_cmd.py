"""`cas-bank salvage SRC DST`: copy every block and state of a damaged bank that still
verifies into a new bank at DST. SRC is never changed (see `cas_bank.maintenance.salvage`)."""

from __future__ import annotations

import argparse
from typing import Any

from cas_bank.maintenance.salvage import salvage

from .common import add_command, bank_path, emit, fields, print_json


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "salvage",
        cmd_salvage,
        "copy what still verifies from a damaged bank into a new one",
        "Copy every block and state of SRC whose digests and chain links verify into a "
        "new bank at DST (empty or absent). SRC is read from a scratch copy and never "
        "changed; a copy that does not open cleanly is repaired by RocksDB first.",
    )
    p.add_argument("src", type=bank_path, metavar="SRC", help="the damaged bank")
    p.add_argument("dst", type=bank_path, metavar="DST", help="the new bank (empty or absent)")


def cmd_salvage(args: argparse.Namespace) -> int:
    report = salvage(args.src, args.dst)
    if args.json:
        print_json(
            {
                "repaired": report.repaired,
                "headers_read": report.headers_read,
                "blocks_copied": report.blocks_copied,
                "states_copied": report.states_copied,
                "ends_copied": report.ends_copied,
                "skipped": report.skipped,
                "walk_errors": report.walk_errors,
                "unreadable_files": report.unreadable_files,
            }
        )
        return 0
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(report.skipped.items())) or "none"
    rows = [
        (
            "copied",
            f"{report.blocks_copied} blocks, {report.states_copied} states, "
            f"{report.ends_copied} end records",
        ),
        ("skipped", skipped),
        ("repaired", "yes (RocksDB rebuilt the copy's MANIFEST)" if report.repaired else "no"),
    ]
    rows += [("unreadable", e) for e in [*report.unreadable_files, *report.walk_errors]]
    emit(fields(rows))
    return 0
