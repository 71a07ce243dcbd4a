"""The records of a block beside its header: the last-use records' format, and the
write recipes that add, rewrite or remove a block or its state (with the counter
deltas they carry). Stores, imports, eviction and `verify --fix` all use these, so a
block is removed the same way wherever it goes.

Last uses live in the `access` family, one little-endian f64 (seconds since the
epoch) per key: the chain hash for the block, the chain hash + b"s" for its state,
the chain hash + b"e" for the end records under it (`index.ends`; under a namespace
root, the root + b"e").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header

TIME = struct.Struct("<d")
STATE_SUFFIX = b"s"
END_SUFFIX = b"e"


def access_key(chain_hash: bytes, state: bool = False) -> bytes:
    """The access-family key holding the last use of a block (or of its state)."""
    return chain_hash + STATE_SUFFIX if state else chain_hash


def end_access_key(parent: bytes) -> bytes:
    """The access-family key holding the last use of the end records under `parent`."""
    return bytes(parent) + END_SUFFIX


def end_deletes(keys: list[bytes], parent: bytes) -> list[Write]:
    """The writes that remove the end records `keys` (all under `parent`) and their last use."""
    writes: list[Write] = [(Family.ENDS, k, None) for k in keys]
    return [*writes, (Family.ACCESS, end_access_key(parent), None)]


def parse_time(value: bytes) -> float | None:
    """The time in an access record, or None if it is not one."""
    return TIME.unpack(value)[0] if len(value) == TIME.size else None


def read_times(store: BlockStore, keys: Sequence[bytes]) -> list[float | None]:
    """The last uses under access keys `keys` (one multi-get), None where there is none.
    Where RocksDB cannot read them all (a damaged file), each is read on its own and
    the unreadable ones are unknown: a last use is advice, never a reason to fail."""
    try:
        values = store.get_many(Family.ACCESS, keys)
    except CorruptDataError:
        values = []
        for key in keys:
            try:
                values.append(store.get(Family.ACCESS, key))
            except CorruptDataError:
                values.append(None)
    return [None if v is None else parse_time(v) for v in values]


def block_deletes(key: bytes, *, with_state: bool = True) -> list[Write]:
    """The writes that remove a block: header, payload, last use; with `with_state`
    (or when unsure) its state and the state's last use too."""
    writes: list[Write] = [
        (Family.HEADERS, key, None),
        (Family.BLOCKS, key, None),
        (Family.ACCESS, access_key(key), None),
    ]
    if with_state:
        writes += [(Family.STATES, key, None), (Family.ACCESS, access_key(key, True), None)]
    return writes


def state_deletes(header: Header) -> list[Write]:
    """The writes that remove a block's state: the state, its last use, and the state
    flag of the header (rewritten without it)."""
    key = header.chain_hash
    return [
        (Family.STATES, key, None),
        (Family.ACCESS, access_key(key, True), None),
        (Family.HEADERS, key, header.with_state(None).encode()),
    ]


def block_rewrite(
    store: BlockStore, key: bytes, old: Header | None, damaged: bool, size: int
) -> tuple[dict[str, int], list[Write]]:
    """Counter deltas, and extra writes, of writing a block payload of `size` bytes
    (with a new header) where `old` is its readable header or None.

    A `damaged` header (present, unreadable) is already counted: its block counts
    again only by the difference in size, and a state stored under it (which the new
    header cannot announce) is removed.
    """
    if not damaged:
        if old is None:
            return {"blocks": 1, "payload_bytes": size}, []
        return {"payload_bytes": size - old.payload_size}, []
    stale, stale_state = store.get(Family.BLOCKS, key), store.get(Family.STATES, key)
    deltas = {"payload_bytes": size - len(stale or b"")}
    if stale_state is None:
        return deltas, []
    deltas.update(states=-1, state_bytes=-len(stale_state))
    return deltas, [(Family.STATES, key, None)]


def state_write_delta(base: Header, size: int) -> dict[str, int]:
    """Counter deltas of writing a state of `size` bytes at the end of block `base`."""
    if base.has_state:
        return {"state_bytes": size - base.state_size}
    return {"states": 1, "state_bytes": size}
