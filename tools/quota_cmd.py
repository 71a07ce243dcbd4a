"""`cas-bank quota set|show|clear`, `cas-bank revoke`: tenants' quotas and revocation.

A tenant is a salt (`cache_salt`); `--unsalted` names the data stored without one. The
salt is given as an argument, or read from a file (`--salt-file FILE`, '-' for stdin:
an argument is visible to other users of the machine in the process list). It is
never stored or printed: the bank and these commands name a tenant by its digest
(`cas_bank.evict.tenants.tenant_id`). A quota is a record in the bank, so it holds
across restarts and wins over `BankConfig.tenant_quotas`; `set` evicts the tenant's
own entries down to it at once, and the bank does again after every store. `revoke`
removes everything the tenant holds, in batches that each leave every chain whole.
`set`, `clear` and `revoke` need the bank's writer lock (stop a server on the bank
first); `show` reads beside a live writer.

`revoke --remote URL` (the fleet secret in `$CAS_BANK_REMOTE_SECRET`, as `serve`
takes them) also removes the tenant's entries from the shared tier, first; a cluster
or a master that cannot be purged is said, with exit status 1, after the local
revoke (run it again to finish). Other hosts' banks keep their copies, serve them
and publish what they store anew: revoke each host's bank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cas_bank import Bank, BankConfig
from cas_bank.evict.tenants import UNSALTED, RevokeReport, short_id, tenant_id

from .common import (
    CliError,
    add_bank_argument,
    add_command,
    emit,
    emit_listing,
    fields,
    human_bytes,
    open_writer,
    positive_int,
    print_json,
    read_bank,
    table,
)
from .gc_cmd import parse_size
from .remote_args import add_remote_arguments, remote_settings


def register(subparsers: Any) -> None:
    q = subparsers.add_parser(
        "quota",
        help="byte quotas per tenant (cache_salt): set, show, clear",
        description="Byte quotas per tenant (a cache_salt; --unsalted: data without one). "
        "A tenant over its quota loses its own least valuable entries, never another's.",
    )
    sub = q.add_subparsers(dest="quota_command", metavar="COMMAND", required=True)
    s = add_command(sub, "set", cmd_set, "set a tenant's quota (kept in the bank) and enforce it")
    _salt_arguments(s)
    s.add_argument(
        "--limit-bytes",
        type=parse_size,
        required=True,
        metavar="N",
        help="bytes of blocks, states and end records the tenant may hold (K, M, G suffixes)",
    )
    c = add_command(sub, "clear", cmd_clear, "remove a tenant's stored quota")
    _salt_arguments(c)
    show = add_command(sub, "show", cmd_show, "every tenant: quota, bytes, hits (by digest)")
    add_bank_argument(show)

    r = add_command(
        subparsers,
        "revoke",
        cmd_revoke,
        "remove everything a tenant (cache_salt) holds, in batches",
        "Remove everything a tenant (a cache_salt) holds in this bank, in batches. With "
        "--remote, first its entries in the shared tier (every master SCANned for its "
        "namespaces' keys); exit status 1 if a master could not be purged (run it "
        "again). Other hosts' banks keep the tenant's data, serve it and publish what "
        "they store anew: revoke every host's bank too.",
    )
    _salt_arguments(r)
    add_remote_arguments(r)
    r.add_argument(
        "--batch",
        type=positive_int,
        default=1024,
        metavar="N",
        help="removals per batch (default 1024): each batch is one transaction",
    )


def _salt_arguments(p: argparse.ArgumentParser) -> None:
    add_bank_argument(p)
    p.add_argument("salt", nargs="?", metavar="SALT", help="the tenant's cache_salt")
    p.add_argument(
        "--salt-file",
        type=Path,
        metavar="FILE",
        help="read the salt from FILE ('-': stdin; one trailing newline is dropped)",
    )
    p.add_argument("--unsalted", action="store_true", help="the data stored without a salt")


def _salt(args: argparse.Namespace) -> str | None:
    given = [x for x in (args.salt is not None, args.salt_file is not None, args.unsalted) if x]
    if len(given) != 1:
        raise CliError("name one tenant: SALT, --salt-file FILE or --unsalted")
    if args.unsalted:
        return None
    if args.salt_file is not None:
        text = sys.stdin.read() if str(args.salt_file) == "-" else args.salt_file.read_text()
        salt = text[:-1] if text.endswith("\n") else text
    else:
        salt = args.salt
    if not salt:
        raise CliError("the salt is empty: use --unsalted for the data stored without one")
    return str(salt)


def _label(tenant: str) -> str:
    return short_id(tenant) + (" (unsalted)" if tenant == UNSALTED else "")


def cmd_set(args: argparse.Namespace) -> int:
    salt = _salt(args)
    with open_writer(args.bank) as bank:
        went = bank.set_quota(salt, args.limit_bytes)
    tenant = tenant_id(salt)
    evicted = sum(len(e.evicted) for e in went)
    freed = sum(e.bytes_evicted for e in went)
    if args.json:
        print_json(
            {
                "tenant": short_id(tenant),
                "unsalted": tenant == UNSALTED,
                "limit_bytes": args.limit_bytes,
                "evicted": evicted,
                "bytes_evicted": freed,
            }
        )
        return 0
    emit(
        fields(
            [
                ("tenant", _label(tenant)),
                ("quota", f"{human_bytes(args.limit_bytes)} ({args.limit_bytes})"),
                ("evicted now", f"{evicted} entries, {human_bytes(freed)}"),
            ]
        )
    )
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    salt = _salt(args)
    with open_writer(args.bank) as bank:
        done = bank.clear_quota(salt)
    if args.json:
        print_json({"tenant": short_id(tenant_id(salt)), "cleared": done})
    else:
        print("quota cleared" if done else "no stored quota: nothing changed")
    return 0 if done else 1


def tenant_rows(bank: Bank) -> list[dict[str, Any]]:
    """Every tenant's figures, by its short digest (for `quota show` and `stats`)."""
    return [
        {
            "tenant": short_id(t.tenant),
            "unsalted": t.unsalted,
            "namespaces": t.namespaces,
            "bytes": t.bytes,
            "hits": t.hits,
            "hit_tokens": t.hit_tokens,
            "quota": t.quota,
        }
        for t in bank.tenant_stats()
    ]


def tenant_table(rows: list[dict[str, Any]]) -> Any:
    return table(
        ["tenant", "namespaces", "bytes", "quota", "hits", "hit tokens"],
        [
            [
                r["tenant"] + (" (unsalted)" if r["unsalted"] else ""),
                r["namespaces"],
                human_bytes(r["bytes"]),
                human_bytes(r["quota"]),
                r["hits"],
                r["hit_tokens"],
            ]
            for r in rows
        ],
    )


def cmd_show(args: argparse.Namespace) -> int:
    return emit_listing(args.json, "tenants", read_bank(args.bank, tenant_rows), tenant_table)


def _revoke_config(args: argparse.Namespace) -> BankConfig | None:
    """The tools' config with the shared tier of `--remote`, or None without it."""
    settings = remote_settings(args)
    if not settings:
        return None
    try:
        return BankConfig(hot_bytes=0, spare_bytes=0, **settings)  # as `_TOOL_CONFIG`
    except ValidationError as e:
        why = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise CliError(f"bad --remote: {why}") from None


def cmd_revoke(args: argparse.Namespace) -> int:
    salt = _salt(args)
    with open_writer(args.bank, config=_revoke_config(args)) as bank:
        report = bank.revoke(salt, batch=args.batch)
        published_to = bank.stats().remote if report.remote_purged is None else None
    out = {
        "tenant": short_id(report.tenant),
        "namespaces": report.namespaces,
        "pins": report.pins,
        "batches": report.batches,
        "blocks": report.blocks,
        "states": report.states,
        "end_records": report.ends,
        "bytes": report.bytes,
        "done": report.done,
        "remote_purged": report.remote_purged,
        "remote_keys": report.remote_keys,
        "remote_failed": list(report.remote_failed),
    }
    status = 0 if report.remote_purged is not False else 1
    if report.remote_purged is False:
        print(
            "cas-bank revoke: the shared tier was not purged on "
            f"{', '.join(report.remote_failed)} (down, timed out or refused); the local "
            "revoke is done: run it again to finish the shared tier",
            file=sys.stderr,
        )
    elif published_to is not None:
        print(
            f"cas-bank revoke: this bank used the shared tier {published_to}; its entries "
            "there stay (pass --remote to remove them too)",
            file=sys.stderr,
        )
    if args.json:
        print_json(out)
        return status
    emit(
        fields(
            [
                ("tenant", _label(report.tenant)),
                ("namespaces", report.namespaces),
                (
                    "removed",
                    f"{report.blocks} blocks, {report.states} states, "
                    f"{report.ends} end records, {human_bytes(report.bytes)}",
                ),
                ("pins removed", report.pins),
                ("batches", report.batches),
                *_remote_rows(report),
            ]
        )
    )
    return status


def _remote_rows(report: RevokeReport) -> list[tuple[str, Any]]:
    if report.remote_purged is None:
        return []
    state = "purged" if report.remote_purged else "NOT purged: " + ", ".join(report.remote_failed)
    return [("shared tier", f"{state}, {report.remote_keys} keys removed")]
