"""`cas-bank verify BANK [--fix]`: check every payload, state and chain link.

Without `--fix` the bank is opened read-only (it runs beside a live writer, see
`verify_beside_writer`); `--fix` needs the writer's lock and removes what is corrupt
and what is no longer reachable, then says what it removed. Exit status 1 when problems were found
(also when `--fix` removed them: run verify again to see a clean bank), 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from cas_bank.index.tree import load_namespaces, namespace_labels
from cas_bank.maintenance.verify import VerifyReport, verify
from cas_bank.spec import ModelSpec

from .common import (
    add_bank_argument,
    add_command,
    bank_files,
    emit,
    fields,
    human_bytes,
    open_writer,
    plural,
    print_json,
    read_bank,
    short,
    table,
)


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "verify",
        cmd_verify,
        "check every digest and chain link (exit 1 on problems)",
        "Check every block's header, chain link, payload digest and state digest, and "
        "look for payloads and states no header claims. Exit status 1 on problems. "
        "--fix removes corrupt blocks and states, every block below a removed one, and "
        "unclaimed records (it needs the bank's writer lock).",
    )
    add_bank_argument(p)
    p.add_argument("--fix", action="store_true", help="remove what is corrupt or unreachable")


@contextmanager
def _progress() -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr when it is a terminal (verify reads every
    payload, which takes a while on a large bank); nothing otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("verifying"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("verify", total=None)

        def tick(done: int, total: int) -> None:
            if done == total or done % 256 == 0:
                bar.update(task, completed=done, total=total)

        yield tick


def report_json(report: VerifyReport, labels: dict[bytes, str], looks: int) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "looks": looks,
        "blocks_checked": report.blocks_checked,
        "states_checked": report.states_checked,
        "ends_checked": report.ends_checked,
        "bytes_checked": report.bytes_checked,
        "problems": [
            {
                "kind": p.kind,
                "hash": p.chain_hash.hex(),
                "depth": p.index,
                "namespace": None if p.root is None else labels.get(p.root, p.root.hex()[:8]),
                "detail": p.detail,
            }
            for p in report.problems
        ],
        "fixed": report.fixed,
        "removed_blocks": [h.hex() for h in report.removed_blocks],
        "removed_states": [h.hex() for h in report.removed_states],
        "removed_orphans": report.removed_orphans,
        "removed_ends": report.removed_ends,
        "unindexed": report.unindexed,
        "indexed": report.indexed,
        "counter_drift": {
            k: {"counter": c, "found": f} for k, (c, f) in report.counter_drift.items()
        },
    }


LOOKS = 3


def verify_beside_writer(path: Path) -> tuple[VerifyReport, dict[bytes, ModelSpec], int]:
    """Verify through a reader's view; the report, the namespaces and the looks taken.

    A view opened while a writer flushes or compacts can miss a few of its latest
    records (RocksDB opens beside a writer are not exact snapshots), which reads as
    dangling chains or unclaimed payloads. So when the bank's files changed during a
    look that found problems, look again, up to `LOOKS` times, and report only the
    problems every look found; damage on disk is found by all of them.
    """
    seen: set[tuple[str, bytes]] | None = None
    for look in range(1, LOOKS + 1):
        before = bank_files(path)
        with _progress() as tick:
            report, specs = read_bank(
                path,
                lambda bank: (verify(bank, progress=tick), load_namespaces(bank.store)[0]),
                payloads=True,
            )
        found: set[tuple[str, bytes]] = {(p.kind, p.chain_hash) for p in report.problems}
        seen = found if seen is None else seen & found
        report.problems = [p for p in report.problems if (p.kind, p.chain_hash) in seen]
        if report.ok or bank_files(path) == before:
            return report, specs, look
    return report, specs, LOOKS


def cmd_verify(args: argparse.Namespace) -> int:
    report, specs, looks = _run_verify(args.bank, fix=args.fix)
    labels = namespace_labels(specs)
    status = 0 if report.ok else 1
    if args.json:
        print_json(report_json(report, labels, looks))
        return status
    out: list[Any] = []
    if report.problems:
        out.append(_problems_table(report, labels))
    out.append(fields(_summary(report, args.bank, looks)))
    emit(*out)
    return status


def _run_verify(path: Path, *, fix: bool) -> tuple[VerifyReport, dict[bytes, ModelSpec], int]:
    """The report, the namespaces and the looks taken: `--fix` under the writer's
    lock (one look), else through a reader's view beside a possible writer."""
    if not fix:
        return verify_beside_writer(path)
    with open_writer(path) as bank, _progress() as tick:
        report = verify(bank, fix=True, progress=tick)
        specs, _ = load_namespaces(bank.store)
    return report, specs, 1


def _problems_table(report: VerifyReport, labels: dict[bytes, str]) -> Table | Text:
    """One row a problem: its kind, block, namespace, depth and detail."""
    return table(
        ["problem", "block", "namespace", "depth", "detail"],
        [
            (
                p.kind,
                short(p.chain_hash),
                "-" if p.root is None else labels.get(p.root, short(p.root, 8)),
                "-" if p.index is None else p.index,
                p.detail,
            )
            for p in report.problems
        ],
    )


def _summary(report: VerifyReport, path: Path, looks: int) -> list[tuple[str, Any]]:
    """The summary's fields: what was checked and found, then what was removed or
    what to run next, and what else a reader should know."""
    summary: list[tuple[str, Any]] = [
        (
            "checked",
            f"{plural(report.blocks_checked, 'block')}, "
            f"{plural(report.states_checked, 'state')}, "
            f"{plural(report.ends_checked, 'end record')}, {human_bytes(report.bytes_checked)}",
        ),
        ("problems", len(report.problems)),
    ]
    summary += _next_steps(report, path)
    if report.indexed:
        summary.append(("indexed", plural(report.indexed, "record")))
    if looks > 1:
        summary.append(("looks", f"{looks} (a writer was busy; problems shown were seen in all)"))
    for name, (counter, found) in report.counter_drift.items():
        summary.append((f"counter {name}", f"says {counter}, headers hold {found}"))
    return summary


def _next_steps(report: VerifyReport, path: Path) -> list[tuple[str, Any]]:
    """What `--fix` removed, or the commands that would remove, salvage or index."""
    steps: list[tuple[str, Any]] = []
    if report.fixed:
        steps.append(
            (
                "removed",
                f"{plural(len(report.removed_blocks), 'block')}, "
                f"{plural(len(report.removed_states), 'state')}, "
                f"{plural(report.removed_orphans, 'unclaimed record')}, "
                f"{plural(report.removed_ends, 'end record')}",
            )
        )
    elif any(p.chain_hash for p in report.problems):
        steps.append(("fix", f"run `cas-bank verify {path} --fix` to remove them"))
    if any(not p.chain_hash for p in report.problems):  # damage --fix cannot name
        steps.append(("salvage", f"`cas-bank salvage {path} NEW_DIR`: see the problems"))
    if report.unindexed and not report.fixed:
        steps.append(
            (
                "unindexed",
                f"{plural(report.unindexed, 'record')} from before the children index "
                f"(no partial-block reuse): `cas-bank verify {path} --fix` indexes them",
            )
        )
    return steps
