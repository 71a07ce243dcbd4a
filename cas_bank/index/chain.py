"""The longest-prefix lookup over a chain (chain records first, then headers), and
where a restore may stop.

The headers (`index.header`) and the chain records (`index.chain_records`) are
defined beside this module; `Header`, `HeaderSource` and `read_headers` are
re-exported here, where most callers have always imported them.

Recurrent (GDN) states sit at block boundaries. A state cannot be cut from a longer
one, so it is captured exactly at a boundary and stored under the chain hash of the
block that ends there. The restore point of a hybrid model is the deepest matched
boundary with a stored state (`restore_blocks`): KV of length n is never combined with
a state of another position (docs/design.md, "State capture policy").

The capture policy (`plan_boundaries`) names the boundaries a prefill should stop at:
  1. the deepest boundary strictly before the prompt's last token, so the same prompt
     again, or its next turn, restores all but the tail;
  2. the branch point: the boundary where the prompt leaves the stored chain, so the
     next agent sharing the same system prompt restores exactly to its end;
  3. every `stride` blocks, when a stride is set;
  4. the deepest boundary at or below each hint: a position the runtime knows to be a
     likely branch point (the end of a chat's system prompt), so that even the second
     agent sharing it restores exactly up to it.
Boundaries at or before the restore start, or that already hold a state, are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cas_bank.blocks.hashing import BlockHash, chain_hashes
from cas_bank.blocks.store import Family
from cas_bank.index import chain_records
from cas_bank.index.chain_records import read_runs
from cas_bank.index.header import Header, HeaderSource, read_headers
from cas_bank.index.prefixes import read_prefixes

_U4 = np.dtype("<u4")

__all__ = [
    "WHOLE_CHAIN_READ",
    "Header",
    "HeaderSource",
    "headers_after",
    "longest_chain",
    "plan_boundaries",
    "read_headers",
    "restore_blocks",
    "stored_chain",
    "stored_prefix",
]


# Chains up to this many blocks (8k tokens of 64) are read whole by `longest_chain`:
# a reopened lookup of 64 stored headers 507 -> 355 us, a miss of 64 blocks the same
# (124 -> 130: the bloom filters answer each absent key). At 256 a whole read saved a
# hit nothing and cost a miss 160 -> 385 us, so a longer chain is measured first.
WHOLE_CHAIN_READ = 128


def stored_prefix(store: HeaderSource, hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of the chain `hashes` have a header: a binary search.

    Valid because stored chains are prefix-closed: a block is written only with or
    after its parent, and eviction and repair remove leaves (or whole subtrees) only.
    A 32k-token miss then costs ~log2(blocks) point reads, not a read per block.
    """
    lo, hi = 0, len(hashes)  # blocks below lo are stored; blocks from hi on are not
    if hi and store.get(Family.HEADERS, hashes[-1]) is not None:
        return hi  # the whole chain: the common case of a prompt sent again
    while lo < hi:
        mid = (lo + hi) // 2
        if store.get(Family.HEADERS, hashes[mid]) is not None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def stored_chain(
    store: HeaderSource, root: bytes, tokens: np.ndarray, block_size: int
) -> tuple[list[BlockHash], list[Header]]:
    """The chain hashes of the full blocks of `tokens` (ids checked: `as_token_array`)
    and the headers of their longest stored prefix, as `longest_chain` gives them.

    The prefix records first (`prefixes.read_prefixes`: one multi-get keyed by the
    tokens, no block hashed): a chain stored as it is asked needs nothing else. Past
    the blocks they give, the chain is hashed from the last block they name and
    `longest_chain` goes on from there."""
    n = len(tokens) // block_size
    blocks = tokens[: n * block_size]
    if blocks.dtype != _U4 or not blocks.flags.c_contiguous:  # as `as_token_array` gives
        blocks = np.ascontiguousarray(blocks, dtype=_U4)
    hashes: list[BlockHash] = []
    found: list[Header] = []
    if n and not getattr(store, "queued_blocks", False):
        hashes, found = read_prefixes(store, root, blocks.data.cast("B"), 4 * block_size)
        if len(found) == n:
            return hashes, found
    parent = hashes[-1] if hashes else root
    hashes += chain_hashes(parent, blocks[len(hashes) * block_size :], block_size)
    return hashes, longest_chain(store, root, hashes, blocks, found)


def longest_chain(
    store: HeaderSource,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray | bytes | None = None,
    found: Sequence[Header] = (),
) -> list[Header]:
    """Headers of the longest stored prefix of the chain `hashes`.

    With `tokens` (the chain's tokens, little-endian uint32, exactly its blocks), the
    chain records are read first (`read_runs`: one multi-get for a chain stored as it
    is asked, whole or as a prefix of a longer one): they give the headers of every
    block they cover without reading them, and one point read past them says whether
    the stored chain goes on. The rest of the chain, or all of it without records (a
    bank written before them, a store still queued in the view), is read from its
    headers: one multi-get, up to `WHOLE_CHAIN_READ` blocks (a stored chain is
    prefix-closed, so the first absent one ends it); a longer rest is cut to its stored
    length by `stored_prefix` first. Stops at the first block whose header is absent,
    unreadable or does not link to the block before it: a chain is never returned with
    a hole. `found`: the headers of its first blocks, known stored (as `stored_chain`
    has them): the lookup goes on after them, with the chain records where they end a
    segment, else with the headers.
    """
    matched = list(found)
    if len(matched) >= len(hashes):
        return matched[: len(hashes)]
    ended = False
    aligned = len(matched) % chain_records.SEGMENT == 0  # else read past it: its headers
    if tokens is not None and aligned and not getattr(store, "queued_blocks", False):
        more, ended = read_runs(store, root, hashes, tokens, len(matched))
        matched += more
    if not ended and len(matched) < len(hashes):
        parent = matched[-1].chain_hash if matched else root
        matched += headers_after(store, parent, hashes, len(matched))
    return matched


def headers_after(
    store: HeaderSource, parent: bytes, hashes: Sequence[BlockHash], start: int
) -> list[Header]:
    """Headers of the stored blocks of the chain `hashes` from block `start` on (block
    `start - 1` is `parent`, the root for 0), read from the headers: up to the first
    absent, unreadable or unlinked one (see `longest_chain`)."""
    rest = hashes[start:]
    if not rest:
        return []
    found = rest if len(rest) <= WHOLE_CHAIN_READ else rest[: stored_prefix(store, rest)]
    out: list[Header] = []
    for i, header in enumerate(read_headers(store, found), start):
        if header is None or header.parent != parent or header.index != i:
            break
        out.append(header)
        parent = header.chain_hash
    return out


def restore_blocks(matched: Sequence[Header], hybrid: bool) -> int:
    """How many of the matched blocks a restore can cover."""
    if not hybrid:
        return len(matched)
    for i in range(len(matched) - 1, -1, -1):
        if matched[i].has_state:
            return i + 1
    return 0


def plan_boundaries(
    n_tokens: int,
    block_size: int,
    *,
    start: int,
    matched_blocks: int,
    stored_states: set[int],
    stride: int | None = None,
    hints: Iterable[int] = (),
) -> list[int]:
    """Token boundaries (ascending) where a prefill of `n_tokens` should capture states.

    `start`: tokens already restored; `matched_blocks`: full blocks of the prompt already
    in the bank; `stored_states`: boundaries that already hold a state.
    """
    wanted: set[int] = set()
    if n_tokens > 1:
        wanted.add(((n_tokens - 1) // block_size) * block_size)
    wanted.add(matched_blocks * block_size)
    wanted.update((h // block_size) * block_size for h in hints if 0 < h <= n_tokens)
    if stride:
        step = stride * block_size
        wanted.update(range(step, n_tokens, step))
    return sorted(b for b in wanted if start < b <= n_tokens and b not in stored_states)
