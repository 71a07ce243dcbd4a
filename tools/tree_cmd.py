"""`cas-bank tree`: the prefix tree of every namespace, where chains share blocks and
branch, read from the headers only (no payload is read).

It opens the bank as a RocksDB secondary (`common.read_bank`), so it runs while a
server or any other writer holds it.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.tree import Tree

from cas_bank import Bank
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.ends import split_record
from cas_bank.index.tree import (
    HeaderIndex,
    TreeNode,
    load_namespaces,
    namespace_labels,
    prefix_tree,
)

from .common import (
    add_bank_argument,
    add_command,
    emit,
    human_bytes,
    plural,
    print_json,
    read_bank,
    select_namespace,
    short,
)


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "tree",
        cmd_tree,
        "the prefix tree, where chains share blocks and branch",
        "The prefix tree of every namespace. Runs of blocks where a chain goes alone are "
        "collapsed into one line; each line shows its block range, the chains (stored "
        "prompts) through it and its bytes.",
    )
    add_bank_argument(p)
    p.add_argument("--namespace", metavar="NAME", help="only this namespace (name or root prefix)")


def _node_json(node: TreeNode) -> dict[str, Any]:
    return {
        "first": node.first.chain_hash.hex(),
        "last": node.last.chain_hash.hex(),
        "start": node.first.index,
        "end": node.last.index,
        "blocks": len(node.blocks),
        "chains": node.chains,
        "bytes": node.run_bytes,
        "subtree_bytes": node.subtree_bytes,
        "states": sum(1 for h in node.blocks if h.has_state),
        "children": [_node_json(c) for c in node.children],
    }


def _node_label(node: TreeNode) -> str:
    n = len(node.blocks)
    span = (
        f"{short(node.first.chain_hash)}"
        if n == 1
        else f"{short(node.first.chain_hash)}..{short(node.last.chain_hash)}"
    )
    where = (
        f"block {node.first.index}" if n == 1 else f"blocks {node.first.index}-{node.last.index}"
    )
    states = sum(1 for h in node.blocks if h.has_state)
    parts = [f"{span}  {where} ({n})", plural(node.chains, "chain"), human_bytes(node.run_bytes)]
    if states:
        parts.append(plural(states, "state"))
    return ", ".join(parts)


def _add_nodes(tree: Tree, nodes: list[TreeNode]) -> None:
    for node in nodes:
        _add_nodes(tree.add(_node_label(node)), node.children)


@dataclass(frozen=True, slots=True)
class TreeGroup:
    """The subtrees below one parent: a namespace root, or a block that is gone."""

    title: str
    info: dict[str, Any]
    nodes: list[TreeNode]


def _end_roots(bank: Bank) -> Counter[bytes]:
    """End records per namespace root (records that do not parse are left to verify)."""
    out: Counter[bytes] = Counter()
    for key, value in bank.store.iterate(Family.ENDS):
        try:
            out[split_record(key, value)[0].root] += 1
        except CorruptDataError:
            continue
    return out


def _groups(
    index: HeaderIndex,
    labels: dict[bytes, str],
    only: bytes | None,
    ends: Counter[bytes] | None = None,
) -> list[TreeGroup]:
    tops = index.tops()
    roots = sorted(
        {*labels, *(h.root for h in tops if h.index == 0 and h.parent == h.root)},
        key=lambda r: (labels.get(r, "~"), r),
    )
    out: list[TreeGroup] = []
    for root in roots:
        if only is not None and root != only:
            continue
        nodes = prefix_tree(index, root)
        name = labels.get(root, f"unknown namespace {short(root, 8)}")
        chains = sum(n.chains for n in nodes)
        blocks = _count_blocks(nodes)
        size = sum(n.subtree_bytes for n in nodes)
        n_ends = (ends or Counter())[root]
        title = (
            f"[bold]{escape(name)}[/bold] (root {short(root, 8)}): "
            f"{plural(chains, 'chain')}, {plural(blocks, 'block')}, "
            f"{plural(n_ends, 'end record')}, {human_bytes(size)}"
        )
        info = {
            "namespace": name,
            "root": root.hex(),
            "chains": chains,
            "blocks": blocks,
            "ends": n_ends,
        }
        out.append(TreeGroup(title, {**info, "bytes": size}, nodes))
    # Blocks whose parent is gone hang below the missing parent (verify reports them).
    for parent in sorted({h.parent for h in tops if not (h.index == 0 and h.parent == h.root)}):
        if only is not None and not any(h.root == only for h in index.children_of(parent)):
            continue
        title = f"[bold]unattached[/bold]: parent {short(parent)} is not stored"
        out.append(TreeGroup(title, {"unattached_below": parent.hex()}, prefix_tree(index, parent)))
    return out


def _count_blocks(nodes: list[TreeNode]) -> int:
    total, stack = 0, list(nodes)
    while stack:
        node = stack.pop()
        total += len(node.blocks)
        stack.extend(node.children)
    return total


def cmd_tree(args: argparse.Namespace) -> int:
    (specs, _), index, ends, block_size = read_bank(
        args.bank,
        lambda bank: (
            load_namespaces(bank.store),
            HeaderIndex.load(bank.store),
            _end_roots(bank),
            bank.config.block_size,
        ),
    )
    labels = namespace_labels(specs, block_size)
    only = select_namespace(args.namespace, specs, labels) if args.namespace else None
    groups = _groups(index, labels, only, ends)
    if args.json:
        print_json([{**g.info, "children": [_node_json(n) for n in g.nodes]} for g in groups])
        return 0
    out: list[Any] = []
    for g in groups:
        t = Tree(g.title)
        _add_nodes(t, g.nodes)
        out.append(t)
    if not groups:
        out.append("(no blocks)")
    emit(*out)
    return 0
