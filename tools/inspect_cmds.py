"""`cas-bank stats` and `ls`: what a bank holds, read from its counters and its
headers only (no payload is read, so they stay fast on a large bank).

Both open the bank as a RocksDB secondary (`common.read_bank`), so they run while a
server or any other writer holds it. `tree` lives in `tree_cmd.py`, `show` in
`show_cmd.py`.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from cas_bank import Bank, native
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.evict.access import last_use
from cas_bank.index.chain import Header
from cas_bank.index.ends import split_record
from cas_bank.index.tree import (
    SALTED,
    HeaderIndex,
    load_namespaces,
    namespace_labels,
)

from .common import (
    CliError,
    add_bank_argument,
    add_command,
    emit,
    fields,
    human_bytes,
    plural,
    positive_int,
    print_json,
    read_bank,
    select_namespace,
    short,
    table,
    when,
)
from .quota_cmd import tenant_rows, tenant_table

SORT_KEYS = ("depth", "size", "chains", "last-use")


def register(subparsers: Any) -> None:
    p = add_command(subparsers, "stats", cmd_stats, "counters: blocks, bytes, dedup, hits")
    add_bank_argument(p)

    p = add_command(
        subparsers,
        "ls",
        cmd_ls,
        "list blocks (or end records)",
        "List blocks: namespace, depth (block index), sizes, chains through them, last use. "
        "Sorted by namespace and depth unless --sort is given (size, chains and last-use "
        "sort the largest / most shared / most recent first). With --ends, list the end "
        "records: end hash, namespace, parent block, prompt length, what each holds "
        "(--sort size and --limit apply).",
    )
    add_bank_argument(p)
    p.add_argument("--namespace", metavar="NAME", help="only this namespace (name or root prefix)")
    p.add_argument("--sort", choices=SORT_KEYS, help="sort key")
    p.add_argument("--limit", type=positive_int, metavar="N", help="show at most N rows")
    p.add_argument(
        "--ends",
        action="store_true",
        help="list the end records instead (their end hashes are what `show` takes)",
    )


# -- stats ---------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    s, (specs, bad), tenants = read_bank(
        args.bank, lambda bank: (bank.stats(), load_namespaces(bank.store), tenant_rows(bank))
    )
    labels = namespace_labels(specs, s.block_size)
    namespaces: list[dict[str, Any]] = [
        {
            "name": labels[root],
            "root": root.hex(),
            "layers": len(spec.layers),
            "hybrid": spec.is_hybrid,
            "tokenizer": spec.tokenizer,
            "salted": SALTED in labels[root],
        }
        for root, spec in sorted(specs.items(), key=lambda kv: labels[kv[0]])
    ]
    helpers = native.status()
    if args.json:
        out = s.model_dump()
        out.update(
            native_helpers=list(helpers.loaded),
            native_missing=helpers.missing,
            dedup_ratio=s.dedup_ratio,
            hit_rate=s.hit_rate,
            namespace_list=namespaces,
            unreadable_namespaces=len(bad),
            tenants=tenants,  # by the salt's digest, never the salt
        )
        print_json(out)
        return 0
    names = ", ".join(n["name"] for n in namespaces) or "-"
    rows = stat_rows(args.bank, s, names)
    rows += remote_rows(s)
    rows.append(("this process", helpers.summary()))
    if bad:
        rows.append(("unreadable namespaces", len(bad)))
    if tenants:
        emit(fields(rows), tenant_table(tenants))
    else:
        emit(fields(rows))
    return 0


def stat_rows(bank: Any, s: Any, names: str) -> list[tuple[str, Any]]:
    """`stats`' table: the bank's counters, one row each."""
    return [
        ("bank", str(bank)),
        ("block size", f"{s.block_size} tokens"),
        ("namespaces", f"{s.namespaces} ({names})"),
        ("blocks", s.blocks),
        ("states", s.states),
        ("payload bytes", f"{human_bytes(s.payload_bytes)} ({s.payload_bytes})"),
        ("state bytes", f"{human_bytes(s.state_bytes)} ({s.state_bytes})"),
        ("end records", f"{s.ends} ({human_bytes(s.end_bytes)}, {s.end_bytes} bytes)"),
        ("disk bytes", human_bytes(s.disk_bytes)),
        ("logical tokens", s.logical_tokens),
        ("unique tokens", s.unique_tokens),
        ("dedup ratio", f"{s.dedup_ratio:.2f}"),
        ("stores", s.stores),
        ("restores", s.restores),
        ("hits / misses", f"{s.hits} / {s.misses}"),
        ("hit rate", f"{s.hit_rate:.1%} of queried tokens"),
        ("end hits", f"{s.exact_hits} exact repeats, {s.end_hits} extensions"),
        ("partial blocks", f"{s.partial_hits} restores took {s.partial_tokens} tokens of one"),
        ("corrupt reads", s.corrupt_reads),
        (
            "evicted",
            f"{s.blocks_evicted} blocks, {s.states_evicted} states, {s.ends_evicted} end records",
        ),
    ]


def remote_rows(s: Any) -> list[tuple[str, Any]]:
    """The shared tier's lines of `stats` (none for a bank that never had one)."""
    if s.remote is None and not (s.remote_publishes or s.remote_hits or s.remote_errors):
        return []
    return [
        ("remote tier", s.remote or "-"),
        (
            "remote hits",
            f"{s.remote_hits} restores, {s.remote_hit_blocks} blocks, {s.remote_hit_tokens} tokens",
        ),
        ("remote fetched", f"{human_bytes(s.remote_bytes_fetched)} ({s.remote_bytes_fetched})"),
        (
            "remote publishes",
            f"{s.remote_publishes} ({human_bytes(s.remote_published_bytes)}), "
            f"{s.remote_dropped} dropped (queue full)",
        ),
        (
            "remote faults",
            f"{s.remote_errors} errors, {s.remote_timeouts} time-outs, "
            f"{s.remote_skipped} skipped (breaker open)",
        ),
        ("remote rejected", f"{s.remote_rejected} entries (MAC, digest or chain link)"),
        ("remote adopted", f"{s.remote_adopted_blocks} blocks written locally"),
    ]


# -- ls ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LsRow:
    hash: str
    namespace: str
    depth: int
    payload_bytes: int
    state_bytes: int | None
    chains: int
    last_use: float | None
    ends: int = 0  # end records under this block


_SORTS: dict[str, Callable[[LsRow], Any]] = {
    "depth": lambda r: r.depth,
    "size": lambda r: -(r.payload_bytes + (r.state_bytes or 0)),
    "chains": lambda r: -r.chains,
    "last-use": lambda r: -(r.last_use if r.last_use is not None else float("-inf")),
}


def cmd_ls(args: argparse.Namespace) -> int:
    if args.ends:
        return _ls_ends(args)
    labels, index, heads, last, ends = read_bank(
        args.bank, lambda bank: _read_blocks(bank, args.namespace)
    )
    rows = _ls_rows(labels, index, heads, last, ends)
    if args.sort is not None:
        rows.sort(key=_SORTS[args.sort])  # stable: ties keep namespace/depth order
    total = len(rows)
    if args.limit is not None:
        rows = rows[: args.limit]
    if args.json:
        print_json({"total": total, "blocks": [asdict(r) for r in rows]})
        return 0
    out: list[Any] = [_blocks_table(rows)]
    if len(rows) < total:
        out.append(f"({len(rows)} of {total} blocks shown)")
    n_ends = sum(ends.values())
    if n_ends:
        out.append(
            f"({plural(n_ends, 'end record')}: `cas-bank ls {args.bank} --ends` lists them, "
            f"`cas-bank show {args.bank} END` shows one)"
        )
    emit(*out)
    return 0


def _read_blocks(
    bank: Bank, namespace: str | None
) -> tuple[dict[bytes, str], HeaderIndex, list[Header], list[float | None], Counter[bytes]]:
    """What `ls` reads from the bank: the namespaces' labels, the header index, the
    headers listed (those of `namespace`, or all), their last uses, and the number of
    end records hanging from each block."""
    specs, _ = load_namespaces(bank.store)
    labels = namespace_labels(specs, bank.config.block_size)
    index = HeaderIndex.load(bank.store)
    root = select_namespace(namespace, specs, labels) if namespace else None
    heads = [h for h in index.headers.values() if root is None or h.root == root]
    last = last_use(bank.store, bank.access, [h.chain_hash for h in heads])
    ends = Counter(k[:32] for k in bank.store.keys(Family.ENDS))
    return labels, index, heads, last, ends


def _ls_rows(
    labels: dict[bytes, str],
    index: HeaderIndex,
    heads: list[Header],
    last: list[float | None],
    ends: Counter[bytes],
) -> list[LsRow]:
    """One row a header, sorted by namespace, depth and hash."""
    rows = [
        LsRow(
            hash=h.chain_hash.hex(),
            namespace=labels.get(h.root, "?" + short(h.root, 8)),
            depth=h.index,
            payload_bytes=h.payload_size,
            state_bytes=h.state_size if h.has_state else None,
            chains=index.chains_through(h.chain_hash),
            last_use=t,
            ends=ends.get(h.chain_hash, 0),
        )
        for h, t in zip(heads, last, strict=True)
    ]
    rows.sort(key=lambda r: (r.namespace, r.depth, r.hash))
    return rows


def _blocks_table(rows: list[LsRow]) -> Table | Text:
    """The blocks' table as `ls` prints it (hashes cut to 12 hex digits)."""
    return table(
        ["hash", "namespace", "depth", "size", "state", "ends", "chains", "last use"],
        [
            (
                r.hash[:12],
                r.namespace,
                r.depth,
                human_bytes(r.payload_bytes),
                "-" if r.state_bytes is None else human_bytes(r.state_bytes),
                r.ends or "-",
                r.chains,
                when(r.last_use),
            )
            for r in rows
        ],
    )


@dataclass(frozen=True, slots=True)
class EndRow:
    end: str  # the end hash: what `show` takes
    namespace: str
    parent: str | None  # the last full block's chain hash; None: the namespace root
    tokens: int  # the prompt's length
    tail: int  # its tokens after the parent
    holds: list[str]
    bytes: int


def _end_row(key: bytes, value: bytes, labels: dict[bytes, str]) -> EndRow:
    try:
        end, _ = split_record(key, value)
    except CorruptDataError:  # verify names it
        return EndRow(key[32:].hex(), "?", key[:32].hex(), 0, 0, ["bad record"], len(value))
    holds = [w for w, f in (("state", end.has_state), ("logits", end.has_logits)) if f]
    return EndRow(
        end=key[32:].hex(),
        namespace=labels.get(end.root, "?" + short(end.root, 8)),
        parent=None if end.parent == end.root else end.parent.hex(),
        tokens=end.n_tokens,
        tail=end.tail_len,
        holds=["tail KV", *holds, *(["hidden"] if end.has_hidden else [])],
        bytes=len(value),
    )


def _ls_ends(args: argparse.Namespace) -> int:
    """`ls --ends`: one row per end record, sorted by namespace and prompt length."""
    if args.sort not in (None, "size"):
        raise CliError(f"with --ends, --sort takes only size (not {args.sort})")

    def look(bank: Bank) -> list[EndRow]:
        specs, _ = load_namespaces(bank.store)
        labels = namespace_labels(specs, bank.config.block_size)
        root = select_namespace(args.namespace, specs, labels) if args.namespace else None
        rows = [_end_row(k, v, labels) for k, v in bank.store.iterate(Family.ENDS)]
        label = labels.get(root, "") if root is not None else None
        return [r for r in rows if label is None or r.namespace == label]

    rows = sorted(read_bank(args.bank, look), key=lambda r: (r.namespace, r.tokens, r.end))
    if args.sort == "size":
        rows.sort(key=lambda r: -r.bytes)
    total = len(rows)
    rows = rows[: args.limit] if args.limit is not None else rows
    if args.json:
        print_json({"total": total, "ends": [asdict(r) for r in rows]})
        return 0
    columns = ["end", "namespace", "parent", "tokens", "tail", "holds", "size"]
    cells = [
        (
            r.end[:16],
            r.namespace,
            "root" if r.parent is None else r.parent[:12],
            r.tokens,
            r.tail,
            ", ".join(r.holds),
            human_bytes(r.bytes),
        )
        for r in rows
    ]
    out: list[Any] = [table(columns, cells) if rows else "(no end records)"]
    if len(rows) < total:
        out.append(f"({len(rows)} of {total} end records shown)")
    emit(*out)
    return 0
