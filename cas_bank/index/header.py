"""Block headers: the record kept apart from each block's payload, its format and its
decoders (a C one where `cas_bank._chain` is built).

A header is the small record kept apart from the payload (docs/design.md, "Record
families"): lookups, tools and eviction walk headers only. It names the parent, so
chains can be walked up from any block, and it carries the block's token ids, so tools
can show them and a lookup can check them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
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
FIXED = struct.Struct("<BBHIQQ32s32s32s32s")
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
        fixed = FIXED.pack(
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
            (version, flags, n, index, size, state_size, parent, root, pd, sd) = FIXED.unpack_from(
                data
            )
        except struct.error:
            raise CorruptDataError(f"header of {chain_hash.hex()} is truncated") from None
        if version != HEADER_VERSION:
            raise CorruptDataError(f"header of {chain_hash.hex()} has version {version}")
        tokens = data[FIXED.size :]
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
    raws, headers = store.get_parsed(Family.HEADERS, hashes, decoded)
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
native_decoded = _native_decoder()
decoded = native_decoded or _python_decoded
