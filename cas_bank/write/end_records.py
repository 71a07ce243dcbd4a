"""Writing an end record (`Namespace.store_end`, inline or from the background
writer): its own transaction, never a dangling record, published to the shared tier
once committed. The record's format and lookups are `index.ends`'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.hot import record_heads
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.index.ends import EndHeader, EndInput, encode_end, end_place, stored_end
from cas_bank.owner import Owner
from cas_bank.spec import ModelSpec


class EndWrite(NamedTuple):
    """What `write_end` did: the bytes it wrote (0: none), and whether the record is
    stored now (written, or held already; not where its blocks are not stored): a
    store leases its cache only where it is, else nothing would ever take that lease."""

    written: int
    stored: bool


def write_end(
    bank: Owner,
    spec: ModelSpec,
    root: bytes,
    hashes: Sequence[BlockHash],
    end: EndInput,
    place: tuple[bytes, bytes, bytes] | None = None,
) -> EndWrite:
    """Write the end record of `tokens` in a transaction of its own (`EndWrite`): nothing
    is written where the same record is stored already (holding at least as much, and
    intact), or its parent block is not stored (an end record never dangles).

    `hashes`: the chain hashes of `end.tokens`; `place`: its `end_place`, where the
    caller found it already.
    """
    state, logits, hidden = end.state, end.logits, end.hidden
    n = len(end.tokens)
    if place is None:
        place = end_place(root, hashes, end.tokens, bank.config.block_size)
    parent, tail, key = place
    base = n - len(tail) // 4
    flags = end.flags
    if _holds(bank.store, key, flags):
        bank.access.touch((), ends=[parent])
        return EndWrite(0, True)
    payload, flags = encode_end(
        spec, end.tail_views(), state, logits, hidden, bank.config.compression, bank.payload_check
    )
    header = EndHeader(parent, root, n, tail, codec.embedded_digest(payload), len(payload), flags)
    value = header.encode() + payload
    with bank.transaction() as tx:
        if base and tx.store.get(Family.HEADERS, parent) is None:
            tx.abort()  # its block was not stored (admission) or was evicted since
            return EndWrite(0, False)
        old = tx.store.get(Family.ENDS, key)
        tx.put(Family.ENDS, key, value)
        tx.add(
            ends=0 if old is not None else 1,
            end_bytes=len(value) - len(old or b""),
            ends_written=1,
            bytes_written=len(value),
        )
        tx.touch((), ends=[parent])
    if bank.remote is not None:  # committed: to the shared tier, off this thread
        bank.remote.publish_end(root, key, value, len(header.encode()))
    return EndWrite(len(value), True)


def _holds(store: BlockStore, key: bytes, flags: int) -> bool:
    """Whether the end record stored under `key` is intact and holds everything `flags`
    asks for: its header first (of a record kept as a file, its head: what the hot
    tier holds of it), its payload read and checked only where the header holds them."""
    (value,) = record_heads(store, Family.ENDS, [key])
    found = stored_end(key, value, None)
    return found is not None and found.header.holds(flags) and found.intact()
