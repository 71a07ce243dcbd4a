"""Partial blocks: a restore keeps the first j tokens of the stored child of its last
matched block that shares them with the prompt (docs/design.md, "Partial blocks").

Attention KV is causal: the keys and values of a block's first j tokens depend only on
the tokens up to them, so a stored block (or end record's tail) whose first j tokens
are the prompt's next j is exact for those positions. The child is found by the
children index (`index.children`, one seek), then checked against its own header or
record (name, parent, root, depth, tokens) before anything of it is used. Its payload
is read and verified whole (the digest covers the whole payload), and only its first
j tokens are copied out. A recurrent state exists only where it was captured: a
hybrid model takes no partial block (an end record at exactly the prompt's position
is `index.ends`' job).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cas_bank.blocks.hashing import BlockHash, hash_block
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header, read_headers
from cas_bank.index.children import KIND_BLOCK, Child, nearest_child, shared_tokens
from cas_bank.index.ends import FoundEnd
from cas_bank.index.view import ReadView, is_queued

if TYPE_CHECKING:
    from cas_bank.blocks.codec import Decoded
    from cas_bank.index.continuation import ChainSpace, ChainTier

log = logging.getLogger("cas_bank")


@dataclass(frozen=True, slots=True)
class PartialPlan:
    """The child a restore takes the first `child.shared` tokens of, after `blocks`
    whole blocks; checked against its own header (a block) or record (an end record)."""

    child: Child
    blocks: int
    base: int  # tokens before it
    header: Header | None  # a block's header
    end: FoundEnd | None  # an end record
    # A block's payload, verified, from the shared tier; or a queued block's arrays.
    fetched: Decoded | None = None

    @property
    def own_tokens(self) -> bytes:
        """The child's tokens (<u4) as its own header or record says them."""
        if self.header is not None:
            return self.header.tokens
        assert self.end is not None
        return self.end.header.tail

    @property
    def queued(self) -> bool:
        """Whether the child is queued for the background writer (not written yet)."""
        if self.header is not None:
            return is_queued(self.header)
        return self.end is not None and self.end.held is not None

    @property
    def shared(self) -> int:
        return self.child.shared

    @property
    def tokens(self) -> int:
        return self.base + self.child.shared


def find_partial(
    view: ReadView,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray,
    blocks: int,
    block_size: int,
) -> PartialPlan | None:
    """The child of block `blocks - 1` (the root when 0) sharing the most of the
    `tokens` after it, checked (written or queued: `view`); None when none shares a
    token (or its record does not hold up: a stale or damaged entry is a miss,
    `verify` reports it)."""
    base = blocks * block_size
    if base >= len(tokens):  # no token after the matched blocks: nothing to share
        return None
    parent = bytes(root if blocks == 0 else hashes[blocks - 1])
    after = tokens[base : base + block_size].astype(">u4").tobytes()
    found = nearest_child(view, parent, after)
    if found is None:
        return None
    try:
        plan = _checked(view, found, root, parent, blocks, base)
    except CorruptDataError:
        return None
    if plan is None:
        return None
    # The record's own tokens, not the index's word for them.
    mine = np.frombuffer(plan.own_tokens, dtype="<u4").astype(">u4").tobytes()
    shared = shared_tokens(mine, after)
    if shared == 0 or (plan.end is not None and shared == plan.end.header.tail_len):
        return None  # a whole tail the prompt shares is `index.ends`' (`plan_end` reads it)
    if shared != found.shared or mine != found.tokens:
        child = Child(parent, found.kind, found.name, mine, shared)
        plan = PartialPlan(child, blocks, base, plan.header, plan.end, plan.fetched)
    return plan


def _checked(
    view: ReadView, found: Child, root: bytes, parent: bytes, blocks: int, base: int
) -> PartialPlan | None:
    """The plan of child `found` if its own header (a block) or record (an end record)
    says it is what the index says: name, parent, root, depth."""
    if found.is_block:
        header = read_headers(view, [found.name])[0]
        if (
            header is None
            or (header.parent, header.root, header.index) != (parent, root, blocks)
            or hash_block(parent, header.tokens) != found.name  # its tokens are its name's
        ):
            return None
        return PartialPlan(found, blocks, base, header, None, view.queued_block(header))
    end = view.end_records([found.record_key])[0]
    if end is None or end.header.root != root or end.header.n_tokens != base + end.header.tail_len:
        return None
    return PartialPlan(found, blocks, base, None, end)


def remote_partial(
    tier: ChainTier,
    ns: ChainSpace,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray,
    blocks: int,
) -> PartialPlan | None:
    """`find_partial` in the shared tier: the child a host lacks, fetched and checked
    there (`remote.children`), held in memory for `read_partial`."""
    bs = ns.block_size
    parent = bytes(ns.root if blocks == 0 else hashes[blocks - 1])
    base = blocks * bs
    after = tokens[base : base + bs].astype(">u4").tobytes()
    found = tier.partial_child(ns, parent, blocks, after)
    if found is None:
        return None
    header, block, shared = found
    mine = np.frombuffer(header.tokens, dtype="<u4").astype(">u4").tobytes()
    child = Child(parent, KIND_BLOCK, bytes(header.chain_hash), mine, shared)
    return PartialPlan(child, blocks, base, header, None, block)
