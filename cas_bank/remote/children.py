"""The shared tier's children index: a host that lacks the stored block a prompt
leaves inside fetches it, and restores its first tokens (docs/design.md, "Partial
blocks").

Key `cb1:<root>:{<parent hex>}:c`: a sorted set per parent block (or namespace root),
every member scored 0 and holding `the child's tokens as >u4 || its chain hash`, so
that ZRANGE BYLEX answers which member sorts just before the prompt's next tokens and
which just after: the one sharing the longest prefix is one of the two (as for the
local index, `index.children`). A publish adds the member with the block's header and
payload. A member is advice only: the child's header and payload are read and
checked as the chain's are (MAC, then parent, index, root, its chain hash and the
tokens it shares; the payload's MAC, size and digest), so a forged or stale member
is a miss (rejected when its entry fails a check).

Two round trips for a restore that asks: the two ranges, then the child's header and
payload. Asked only where the local bank has no child for the prompt to take tokens
of, by an attention-only model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import hash_block
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header
from cas_bank.index.children import shared_tokens
from cas_bank.remote import keys
from cas_bank.remote.fetch import FetchingTier

HASH = 32


def child_entry(root: bytes, header: Header) -> tuple[Any, ...]:
    """The command that adds a published block to its parent's children."""
    member = np.frombuffer(header.tokens, dtype="<u4").astype(">u4").tobytes()
    return ("ZADD", keys.key(root, header.parent, "c"), 0, member + bytes(header.chain_hash))


def fetch_child(
    tier: FetchingTier, root: bytes, parent: bytes, index: int, after: bytes
) -> tuple[Header, codec.Decoded, int] | None:
    """The child of `parent` (block `index - 1`, or the root) in the shared tier that
    shares the most of `after` (the prompt's next tokens, >u4), checked: its header,
    payload and how many tokens it shares; None if there is none (or it fails)."""
    if not after:
        return None
    k = keys.key(root, parent, "c")
    below = ("ZRANGE", k, b"(" + after, b"-", "BYLEX", "REV", "LIMIT", 0, 1)
    above = ("ZRANGE", k, b"[" + after, b"+", "BYLEX", "LIMIT", 0, 1)
    got = tier.client.run([below, above])
    if got is None:
        return None
    best: tuple[bytes, int] | None = None
    for answer in got:
        for member in answer if isinstance(answer, list) else []:
            if not isinstance(member, bytes) or len(member) <= HASH:
                continue
            j = shared_tokens(member[:-HASH], after)
            if 4 * j == len(member) - HASH:
                continue  # the whole block: the chain's own next block (asked already)
            if j and (best is None or j > best[1]):
                best = (member[-HASH:], j)
    if best is None:
        return None
    name = best[0]
    hk, pk = keys.key(root, name, "h"), keys.key(root, name, "p")
    got = tier.client.run([("GET", hk), ("GET", pk)])
    if got is None or not all(isinstance(a, bytes) for a in got):
        return None
    tier.bank.counters.count(remote_bytes_fetched=sum(len(a) for a in got))
    try:
        header = Header.decode(name, keys.open_header(tier.mkey, hk, got[0]))
        mine = np.frombuffer(header.tokens, dtype="<u4").astype(">u4").tobytes()
        shared = shared_tokens(mine, after)
        if (
            header.parent != parent
            or header.index != index
            or header.root != root
            or hash_block(parent, header.tokens) != name
            or shared == 0
        ):
            raise CorruptDataError("the child does not hang under this chain")
        payload = keys.open_payload(tier.mkey, pk, got[1])
        if len(payload) != header.payload_size:
            raise CorruptDataError("payload size differs from its header")
        block = codec.decode(payload, header.payload_digest)
    except CorruptDataError as e:
        tier.reject(name, str(e))
        return None
    return header, block, shared
