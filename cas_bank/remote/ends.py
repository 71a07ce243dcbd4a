"""End records through the shared tier (docs/design.md, "End records", "Remote tier").

A host that stores an end record publishes it; a host that restores a prompt whose
chain (local, or continued from the cluster) ends at a block asks the cluster for the
end records under that block, as the local lookup (`index.ends.find_end`) does: the
candidates for every tail length the prompt allows, one pipelined GET, all on one
node (their key's hash tag is the parent's chain hash, as the parent block's own).

Key: `cb1:<root 8 bytes hex>:{<parent hex>}:e:<end hash hex>`. Entry: `CBR1 | MAC |
value`, the value as the local `ends` family stores it (end header, tail tokens,
codec payload). The MAC covers the key and the end header (whose payload digest
`decode_end` checks against the payload), and for an XXH3-128 payload (format 4) a
blake3 digest of the payload too (`keys.seal_end`: XXH3 is no defence against a
forger), so a forged or damaged record fails one or the other; `split_record` also
checks that the record is named after what it says (parent and tail). A record that
fails is a rejected miss: the next shallower candidate is tried, then the chain
restores without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from cas_bank.errors import CorruptDataError
from cas_bank.index.continuation import FetchedEnd
from cas_bank.index.ends import KEY_SIZE, EndPlan, candidate_keys, decode_end, split_record
from cas_bank.owner import Owner
from cas_bank.remote import keys
from cas_bank.spec import ModelSpec


class EndTier(Protocol):
    mkey: bytes
    bank: Owner

    def reject(self, chain_hash: bytes, why: str) -> None: ...


def remote_key(root: bytes, local_key: bytes) -> bytes:
    """The cluster key of the end record stored locally under `local_key`."""
    parent, name = local_key[:32], local_key[32:]
    return b"%s:%s:{%s}:e:%s" % (
        keys.KEY_VERSION,
        root[:8].hex().encode(),
        parent.hex().encode(),
        name.hex().encode(),
    )


def seal(mkey: bytes, k: bytes, value: bytes, header_len: int) -> bytes:
    """A cluster entry of an end record value (its end header is `value[:header_len]`)."""
    return keys.seal_end(mkey, k, value[:header_len], value[header_len:])


def candidates(
    root: bytes, parent: bytes, toks: np.ndarray, blocks: int, block_size: int
) -> list[tuple[bytes, bytes]]:
    """(local key, cluster key) of the end records under block `blocks - 1` (the root
    when 0) that a prompt `toks` could resume from, deepest first."""
    base = blocks * block_size
    longest = min(block_size - 1, len(toks) - base)
    if longest < 0:
        return []
    local = candidate_keys(parent, toks[base : base + longest])
    return [(k, remote_key(root, k)) for k in local]


def pick(
    tier: EndTier,
    spec: ModelSpec,
    root: bytes,
    cands: Sequence[tuple[bytes, bytes]],
    answers: Sequence[object],
    block_size: int,
) -> FetchedEnd | None:
    """The deepest candidate whose entry passes its MAC, names itself and decodes."""
    for (local, k), raw in zip(cands, answers, strict=True):
        if not isinstance(raw, bytes):
            continue
        try:
            value = _open(tier.mkey, k, local, raw)
            header, payload = split_record(local, value)
            if header.root != root:
                raise CorruptDataError("end record of another namespace")
            decoded = decode_end(spec, header, payload)
            plan = EndPlan(header, decoded, header.parent_blocks(block_size))
        except CorruptDataError as e:
            tier.reject(local[KEY_SIZE // 2 :], str(e))
            continue
        return FetchedEnd(plan, local, value)
    return None


def _open(mkey: bytes, k: bytes, local: bytes, entry: bytes) -> bytes:
    """The record value of an entry whose MAC holds over its end header."""
    if len(entry) < len(keys.MAGIC) + keys.MAC_SIZE:
        raise CorruptDataError("not a cas_bank remote entry (bad magic or truncated)")
    body = entry[len(keys.MAGIC) + keys.MAC_SIZE :]
    try:  # the header's length is in the header: parse it, then check the MAC over it
        header, _ = split_record(local, body)
    except CorruptDataError:
        raise CorruptDataError("remote end record does not parse") from None
    return keys.open_end(mkey, k, entry, len(header.encode()))
