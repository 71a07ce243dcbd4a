"""`cas-bank gc BANK --max-bytes N`: evict offline until the bank fits a budget.

The same eviction a writer runs after a store when `BankConfig.max_bytes` is set
(`cas_bank.evict.eviction`: the policy's order, least frequently used first by
default; leaf blocks only, states on their own before blocks of the same rank; pinned
prefixes kept), then a compaction so the disk space is released.
It needs the bank's writer lock: stop a server on the bank first.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from cas_bank.blocks.store import Capability
from cas_bank.evict.eviction import EvictionReport, evict_to_budget

from .common import (
    add_bank_argument,
    add_command,
    emit,
    fields,
    human_bytes,
    open_writer,
    print_json,
    short,
    table,
    when,
)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SHOWN = 40  # rows of the human table; --json lists everything


def parse_size(text: str) -> int:
    """`N` bytes, or with a unit: 512K, 64MiB, 1.5G (binary), 100MB (decimal)."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with K, M, G, KiB, MB, ..."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "gc",
        cmd_gc,
        "evict leaves and states, least frequently used first, until the bank fits --max-bytes",
        "Evict until payload, state and end-record bytes fit --max-bytes, in the bank's "
        "eviction order (BankConfig.eviction_policy, lfu: least frequently used first, "
        "what was popular once aging out); only leaf blocks (no chain ever gets a hole); a "
        "state on its own before a block of the same rank; pinned prefixes (cas-bank pin) "
        "are kept. Then compact, so the disk space is released. Needs the bank's writer "
        "lock.",
    )
    add_bank_argument(p)
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        required=True,
        metavar="N",
        help="budget for payloads and states (bytes, or 512M, 2GiB, ...)",
    )


def cmd_gc(args: argparse.Namespace) -> int:
    bank = open_writer(args.bank)
    with bank:
        disk_before = bank.store.disk_bytes()
        report = evict_to_budget(bank, args.max_bytes, reason="gc")
        if bank.files is not None:
            bank.files.sweep()  # payload files a crash left without their records
        if report.evicted and Capability.COMPACT in bank.store.capabilities:
            bank.store.compact()  # deleted records leave the disk only when compacted
        disk_after = bank.store.disk_bytes()
    if args.json:
        print_json(report_json(report, disk_before, disk_after))
        return 0
    out: list[Any] = [
        fields(
            [
                ("budget", human_bytes(report.max_bytes)),
                ("stored before", human_bytes(report.bytes_before)),
                ("stored after", human_bytes(report.bytes_after)),
                ("blocks evicted", report.blocks_evicted),
                ("states evicted", report.states_evicted),
                ("end records evicted", report.ends_evicted),
                ("bytes evicted", human_bytes(report.bytes_evicted)),
                ("pinned (kept)", human_bytes(report.pinned_bytes)),
                ("disk before", human_bytes(disk_before)),
                ("disk after", human_bytes(disk_after)),
            ]
        )
    ]
    if report.evicted:
        rows = [
            [
                e.kind
                + (" + state" if e.with_state else "")
                + (" + end records" if e.kind == "block" and e.ends else ""),
                short(e.chain_hash),
                e.size,
                when(e.last_use),
            ]
            for e in report.evicted[:_SHOWN]
        ]
        out.append(
            table(["removed", "hash", "bytes", "last use"], rows, title="\nremoved, in order")
        )
        if len(report.evicted) > _SHOWN:
            out.append(f"... and {len(report.evicted) - _SHOWN} more (--json lists all)")
    elif report.bytes_before <= report.max_bytes:
        out.append("the bank already fits the budget: nothing removed")
    emit(*out)  # through sys.stdout: a reader that goes away is not an error
    return 0


def report_json(
    report: EvictionReport, disk_before: int | None, disk_after: int | None
) -> dict[str, Any]:
    return {
        "max_bytes": report.max_bytes,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "blocks_evicted": report.blocks_evicted,
        "states_evicted": report.states_evicted,
        "ends_evicted": report.ends_evicted,
        "bytes_evicted": report.bytes_evicted,
        "pinned_bytes": report.pinned_bytes,
        "disk_bytes_before": disk_before,
        "disk_bytes_after": disk_after,
        "removed": [
            {
                "kind": e.kind,
                "hash": e.chain_hash.hex(),
                "payload_bytes": e.payload_bytes,
                "state_bytes": e.state_bytes,
                "end_bytes": e.end_bytes,
                "ends": e.ends,
                "with_state": e.with_state,
                "last_use": e.last_use,
            }
            for e in report.evicted
        ],
    }
