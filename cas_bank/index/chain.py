"""Block headers, the longest-prefix lookup over a chain, and where a restore may stop.

A header is the small record kept apart from the payload (docs/design.md, "Record
families"): lookups, tools and eviction walk headers only. It names the parent, so
chains can be walked up from any block, and it carries the block's token ids, so tools
can show them and a lookup can check them.

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

import struct
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, cast

import numpy as np

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.native import chain_module


class HeaderSource(Protocol):
    """What the chain lookups read: a `BlockStore`, or the read view of a bank
    (`index.view.ReadView`: its queued headers in front of its store)."""

    def get(self, family: Family, key: bytes) -> bytes | None: ...

    def get_parsed(
        self, family: Family, keys: Sequence[bytes], parse: Callable[[bytes, bytes], object | None]
    ) -> tuple[list[bytes | None], list[object | None]]: ...


HEADER_VERSION = 1
FLAG_STATE = 1
_FIXED = struct.Struct("<BBHIQQ32s32s32s32s")
_new = tuple.__new__


class Header(NamedTuple):
    """What the bank knows of one block without reading its payload.

    A named tuple rather than a frozen dataclass: a reopened restore decodes a header
    per block (256 for a 16k-token prompt), and a frozen dataclass's `__init__` (one
    `object.__setattr__` a field) cost 2.1 us of a 2.6 us decode; `tuple.__new__` 0.2.
    """

    chain_hash: BlockHash
    parent: bytes  # the parent block's chain hash, or the namespace root for block 0
    # The block index: the block covers tokens [index*B, (index+1)*B). It shadows the
    # tuple's own `index` method, which nothing here calls.
    index: int  # type: ignore[assignment]
    root: bytes
    payload_digest: bytes
    payload_size: int
    tokens: bytes  # little-endian uint32 ids of this block
    state_digest: bytes | None = None  # the state at this block's end boundary, if any
    state_size: int = 0

    @property
    def has_state(self) -> bool:
        return self.state_digest is not None

    @property
    def end(self) -> int:
        """Number of tokens covered up to the end of this block."""
        return (self.index + 1) * (len(self.tokens) // 4)

    def token_ids(self) -> list[int]:
        return [int(t) for t in np.frombuffer(self.tokens, dtype="<u4")]

    def with_state(self, state_digest: bytes | None, state_size: int = 0) -> Header:
        return self._replace(state_digest=state_digest, state_size=state_size)

    def encode(self) -> bytes:
        flags = FLAG_STATE if self.state_digest is not None else 0
        fixed = _FIXED.pack(
            HEADER_VERSION,
            flags,
            len(self.tokens) // 4,
            self.index,
            self.payload_size,
            self.state_size,
            self.parent,
            self.root,
            self.payload_digest,
            self.state_digest or bytes(32),
        )
        return fixed + self.tokens

    @classmethod
    def decode(cls, chain_hash: bytes, data: bytes) -> Header:
        try:
            (version, flags, n, index, size, state_size, parent, root, pd, sd) = _FIXED.unpack_from(
                data
            )
        except struct.error:
            raise CorruptDataError(f"header of {chain_hash.hex()} is truncated") from None
        if version != HEADER_VERSION:
            raise CorruptDataError(f"header of {chain_hash.hex()} has version {version}")
        tokens = data[_FIXED.size :]
        if len(tokens) != 4 * n:
            raise CorruptDataError(f"header of {chain_hash.hex()} has a bad token list")
        # In field order, by tuple.__new__ (what the named tuple's own constructor calls,
        # less its argument binding); the chain hash as it came (BlockHash is a NewType).
        return _new(
            cls,
            (
                chain_hash,
                parent,
                index,
                root,
                pd,
                size,
                tokens,
                sd if flags & FLAG_STATE else None,
                state_size,
            ),
        )


def read_headers(
    store: HeaderSource, hashes: Sequence[bytes], damaged: set[int] | None = None
) -> list[Header | None]:
    """Headers of `hashes` in one multi-get; None where absent or unreadable.

    `damaged`, when given, receives the positions of records present but unreadable.
    A header decoded before from the very value the store returns is not decoded
    again (`BlockStore.get_parsed`: the hot tier keeps it).
    """
    raws, headers = store.get_parsed(Family.HEADERS, hashes, _decoded)
    if damaged is not None:
        pairs = enumerate(zip(raws, headers, strict=True))
        damaged.update(i for i, (raw, header) in pairs if raw is not None and header is None)
    return cast(list[Header | None], headers)


def _python_decoded(chain_hash: bytes, raw: bytes) -> Header | None:
    """`Header.decode`, None where the record is unreadable."""
    try:
        return Header.decode(chain_hash, raw)
    except CorruptDataError:
        return None


def _native_decoder() -> Callable[[bytes, bytes], Header | None] | None:
    """The C decoder of `cas_bank._chain` (the same headers, or None, as
    `_python_decoded`), told which named tuple to make; None where it is not built."""
    decode = getattr(chain_module, "header", None)
    if decode is None:
        return None
    chain_module.set_header_type(Header)  # type: ignore[union-attr]
    return cast(Callable[[bytes, bytes], "Header | None"], decode)


# A reopened restore decodes a header a block (256 for a 16k-token prompt, read from
# RocksDB and cached in the hot tier with it): ~0.9 us each in Python warm, more cold.
_native_decoded = _native_decoder()
_decoded = _native_decoded or _python_decoded


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


def longest_chain(store: HeaderSource, root: bytes, hashes: Sequence[BlockHash]) -> list[Header]:
    """Headers of the longest stored prefix of the chain `hashes`.

    One multi-get of the chain's headers, up to `WHOLE_CHAIN_READ` blocks (a stored
    chain is prefix-closed, so the first absent one ends it); a longer chain is cut to
    its stored length by `stored_prefix` first. Stops at the first block whose header
    is absent, unreadable or does not link to the block before it: a chain is never
    returned with a hole.
    """
    matched: list[Header] = []
    parent = root
    found = hashes if len(hashes) <= WHOLE_CHAIN_READ else hashes[: stored_prefix(store, hashes)]
    for i, header in enumerate(read_headers(store, found)):
        if header is None or header.parent != parent or header.index != i:
            break
        matched.append(header)
        parent = header.chain_hash
    return matched


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
