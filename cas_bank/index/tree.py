"""Walking headers: children of a block, leaf chains below it, the prefix tree, and
naming a block by a unique hex prefix of its hash (as git does).

Everything here reads the headers family only (the small family: docs/design.md, "Record
families"), never a payload, so the tools that use it (ls, show, tree, verify, export)
stay cheap. A `HeaderIndex` is a snapshot of all headers in memory: a few hundred bytes
per block.

Words: a *leaf* is a block with no stored child; a *chain* is the path from a
namespace root down to a leaf; the chains *through* a block are the leaves below it
(a leaf counts itself), i.e. how many stored prompts share that block.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from cas_bank.blocks.hashing import DIGEST_SIZE, BlockHash, namespace_root
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.index.chain import Header
from cas_bank.spec import ModelSpec

_HEX = frozenset(string.hexdigits.lower())
_CANDIDATES_SHOWN = 8


class AmbiguousPrefixError(InvalidInputError):
    """A hash prefix names more than one block; `candidates` holds them all."""

    def __init__(self, prefix: str, candidates: list[bytes]) -> None:
        self.prefix = prefix
        self.candidates = sorted(candidates)
        shown = ", ".join(c.hex()[:16] for c in self.candidates[:_CANDIDATES_SHOWN])
        more = len(self.candidates) - _CANDIDATES_SHOWN
        tail = f" and {more} more" if more > 0 else ""
        super().__init__(
            f"hash prefix {prefix!r} is ambiguous: it matches {len(self.candidates)} blocks "
            f"({shown}{tail}); give more digits"
        )


class UnknownHashError(InvalidInputError):
    """No stored block has a hash starting with the given prefix."""


def resolve_prefix(prefix: str, keys: Iterable[bytes]) -> BlockHash:
    """The one key in `keys` whose hex starts with `prefix` (case-insensitive).

    Raises `InvalidInputError` for a prefix that is not hex or longer than a hash,
    `UnknownHashError` when nothing matches, `AmbiguousPrefixError` when several do.
    """
    p = prefix.strip().lower()
    if not p or len(p) > 2 * DIGEST_SIZE or not set(p) <= _HEX:
        raise InvalidInputError(
            f"{prefix!r} is not a block hash: give 1 to {2 * DIGEST_SIZE} hex digits"
        )
    matches = [k for k in keys if k.hex().startswith(p)]
    if not matches:
        raise UnknownHashError(f"no block hash starts with {p!r}")
    if len(matches) > 1:
        raise AmbiguousPrefixError(p, matches)
    return BlockHash(matches[0])


def load_namespaces(store: BlockStore) -> tuple[dict[bytes, ModelSpec], dict[bytes, str]]:
    """Every namespace record by root, and the roots whose record does not parse (why)."""
    specs: dict[bytes, ModelSpec] = {}
    bad: dict[bytes, str] = {}
    for root, raw in store.iterate(Family.NAMESPACES):
        try:
            specs[root] = ModelSpec.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as e:
            bad[root] = f"namespace record does not parse: {str(e).splitlines()[0]}"
    return specs, bad


SALTED = "+salt@"
"""In a label, what marks a salted namespace (a tenant's `cache_salt`): `name+salt@root`."""


def namespace_labels(
    specs: dict[bytes, ModelSpec], block_size: int | None = None
) -> dict[bytes, str]:
    """A short display name per root: the model name, with the root where names repeat.

    With `block_size` (the bank's), a root that is not its spec's unsalted root is a
    salted namespace, labelled `name+salt@root` (the salt itself is not recorded): the
    unsalted namespace of a model keeps its plain name.
    """
    salted = set()
    if block_size is not None:
        salted = {r for r, s in specs.items() if r != namespace_root(s.fingerprint, block_size)}
    counts: dict[str, int] = {}
    for root, spec in specs.items():
        if root not in salted:
            counts[spec.name] = counts.get(spec.name, 0) + 1
    out = {}
    for root, spec in specs.items():
        if root in salted:
            out[root] = f"{spec.name}{SALTED}{root.hex()[:8]}"
        else:
            out[root] = spec.name if counts[spec.name] == 1 else f"{spec.name}@{root.hex()[:8]}"
    return out


@dataclass(slots=True)
class HeaderIndex:
    """All headers of a bank, with the parent -> children links between them."""

    headers: dict[bytes, Header]
    unreadable: dict[bytes, str] = field(default_factory=dict)  # key -> why it did not decode
    children: dict[bytes, list[BlockHash]] = field(default_factory=dict)
    _chains: dict[bytes, int] | None = None
    _bytes: dict[bytes, int] | None = None

    @classmethod
    def load(cls, store: BlockStore) -> HeaderIndex:
        """Read every header (one pass over the headers family).

        Where RocksDB cannot walk past a damaged table block, the headers it did not
        reach are looked for by their blocks' keys (a payload is stored under its
        header's key) and read one by one: those in the damaged block are `unreadable`
        (with RocksDB's reason), the rest are read as usual.
        """
        headers: dict[bytes, Header] = {}
        unreadable: dict[bytes, str] = {}

        def add(key: bytes, raw: bytes) -> None:
            try:
                headers[key] = Header.decode(key, raw)
            except CorruptDataError as e:
                unreadable[key] = str(e)

        try:
            for key, raw in store.iterate(Family.HEADERS):
                add(key, raw)
        except CorruptDataError:
            for key, _ in store.readable(Family.BLOCKS, values=False):
                if key in headers or key in unreadable:
                    continue
                try:
                    found = store.get(Family.HEADERS, key)
                except CorruptDataError as e:
                    unreadable[key] = str(e)
                    continue
                if found is not None:
                    add(key, found)
        return cls.of(headers.values(), unreadable)

    @classmethod
    def of(
        cls, headers: Iterable[Header], unreadable: dict[bytes, str] | None = None
    ) -> HeaderIndex:
        by_hash: dict[bytes, Header] = {h.chain_hash: h for h in headers}
        children: dict[bytes, list[BlockHash]] = {}
        for h in by_hash.values():
            children.setdefault(h.parent, []).append(h.chain_hash)
        for kids in children.values():
            kids.sort()
        return cls(by_hash, dict(unreadable or {}), children)

    def keys(self) -> list[bytes]:
        """Every stored header key, readable or not (what a hash prefix may name)."""
        return [*self.headers, *self.unreadable]

    def children_of(self, chain_hash: bytes) -> list[Header]:
        """Stored blocks whose parent is `chain_hash` (a block or a namespace root)."""
        return [self.headers[c] for c in self.children.get(chain_hash, [])]

    def tops(self) -> list[Header]:
        """Blocks whose parent is not a stored block: first blocks, and dangling ones."""
        return sorted(
            (h for h in self.headers.values() if h.parent not in self.headers),
            key=lambda h: (h.root, h.index, h.chain_hash),
        )

    def descendants(self, chain_hashes: Iterable[bytes]) -> set[bytes]:
        """Every stored block below any of `chain_hashes` (not including them)."""
        out: set[bytes] = set()
        stack = [c for h in chain_hashes for c in self.children.get(h, [])]
        while stack:
            h = stack.pop()
            if h in out:
                continue
            out.add(h)
            stack.extend(self.children.get(h, []))
        return out

    def path(self, chain_hash: bytes) -> list[Header]:
        """The chain from its first block down to `chain_hash`, walking parents up.

        Raises `InvalidInputError` if a parent is missing (a dangling chain) or a
        link is inconsistent.
        """
        out: list[Header] = []
        h = self.headers.get(chain_hash)
        if h is None:
            raise UnknownHashError(f"no readable header for block {chain_hash.hex()}")
        while True:
            out.append(h)
            if h.index == 0:
                if h.parent != h.root:
                    raise InvalidInputError(
                        f"block {h.chain_hash.hex()[:16]} is block 0 but its parent is not "
                        "its namespace root"
                    )
                break
            parent = self.headers.get(h.parent)
            if parent is None:
                raise InvalidInputError(
                    f"chain of {chain_hash.hex()[:16]} is broken: the parent "
                    f"{h.parent.hex()[:16]} of block {h.index} is not stored"
                )
            if parent.index != h.index - 1 or len(out) > len(self.headers):
                raise InvalidInputError(
                    f"chain of {chain_hash.hex()[:16]} has an inconsistent link at block {h.index}"
                )
            h = parent
        out.reverse()
        return out

    # -- counts over subtrees --------------------------------------------------------
    def chains_through(self, chain_hash: bytes) -> int:
        """Leaf chains below (or ending at) this block: how many stored prompts share it."""
        self._count()
        assert self._chains is not None
        return self._chains.get(chain_hash, 0)

    def subtree_bytes(self, chain_hash: bytes) -> int:
        """Payload and state bytes of this block and every block below it."""
        self._count()
        assert self._bytes is not None
        return self._bytes.get(chain_hash, 0)

    def _count(self) -> None:
        """Leaf counts and byte sums, bottom-up, without recursion (chains may be long)."""
        if self._chains is not None:
            return
        chains: dict[bytes, int] = {}
        sizes: dict[bytes, int] = {}
        for top in self.tops():
            stack: list[tuple[bytes, bool]] = [(top.chain_hash, False)]
            while stack:
                h, expanded = stack.pop()
                kids = [k for k in self.children.get(h, []) if k in self.headers]
                if not expanded:
                    if h in chains:
                        continue
                    chains[h] = 0  # marks "in progress": a corrupt cycle cannot loop us
                    stack.append((h, True))
                    stack.extend((k, False) for k in kids if k not in chains)
                    continue
                header = self.headers[h]
                chains[h] = sum(chains[k] for k in kids) or 1
                sizes[h] = (
                    header.payload_size + header.state_size + sum(sizes.get(k, 0) for k in kids)
                )
        for h, header in self.headers.items():  # only blocks on a corrupt cycle are left
            chains.setdefault(h, 1)
            sizes.setdefault(h, header.payload_size + header.state_size)
        self._chains, self._bytes = chains, sizes


@dataclass(slots=True)
class TreeNode:
    """A run of blocks where the chain goes alone (each block but the last has exactly
    one child), and the subtrees where it branches after the run."""

    blocks: list[Header]
    chains: int  # leaf chains through the run
    run_bytes: int  # payload and state bytes of the run's own blocks
    subtree_bytes: int  # ... and of everything below it
    children: list[TreeNode] = field(default_factory=list)

    @property
    def first(self) -> Header:
        return self.blocks[0]

    @property
    def last(self) -> Header:
        return self.blocks[-1]


def prefix_tree(index: HeaderIndex, parent: bytes) -> list[TreeNode]:
    """The subtrees hanging below `parent` (a namespace root, or any block's hash),
    with single-child runs collapsed into one node. Children are ordered by the number
    of chains through them (most shared first), then by hash."""

    def ordered(hashes: list[BlockHash]) -> list[Header]:
        heads = [index.headers[h] for h in hashes if h in index.headers]
        return sorted(heads, key=lambda h: (-index.chains_through(h.chain_hash), h.chain_hash))

    out: list[TreeNode] = []
    # Iterative over branch points: each stack entry fills one list of sibling nodes.
    stack: list[tuple[list[TreeNode], Header]] = [
        (out, h) for h in reversed(ordered(index.children.get(parent, [])))
    ]
    seen: set[bytes] = set()
    while stack:
        siblings, start = stack.pop()
        run = [start]
        seen.add(start.chain_hash)
        kids = ordered(index.children.get(start.chain_hash, []))
        while len(kids) == 1 and kids[0].chain_hash not in seen:
            run.append(kids[0])
            seen.add(kids[0].chain_hash)
            kids = ordered(index.children.get(kids[0].chain_hash, []))
        node = TreeNode(
            blocks=run,
            chains=index.chains_through(start.chain_hash),
            run_bytes=sum(h.payload_size + h.state_size for h in run),
            subtree_bytes=index.subtree_bytes(start.chain_hash),
        )
        siblings.append(node)
        stack.extend((node.children, k) for k in reversed(kids) if k.chain_hash not in seen)
    return out
