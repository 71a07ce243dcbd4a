"""Pin records: the prefixes eviction keeps (`Namespace.pin`, `cas-bank pin`).

A pin names a prefix, a namespace root and its tokens, and holds what the bank
stored of it when it was pinned: every full block of the prefix (a chain has no
hole, so these are the last block and all its ancestors), the states on those
blocks (stored then or later), and the end records under the last block when the
prefix's own end record was among them (the whole group: an end-record group is
evicted together). Eviction skips all of it (`LeafIndex.pop_victim`).

Records live in the `meta` family, so a bank without pins opens as it is and an
older cas_bank ignores them (it evicts pinned blocks as any others). Key
`b"pin/" + root + a 16-byte digest of the tokens`; value, little-endian:
`version u8 (1) | flags u8 (bit 0: the end records under the last block are held) |
n_blocks u32 | n_tokens u32 | pinned at <f8 | root 32 | blocks (n_blocks x 32) |
tokens (n_tokens x <u4)`. A record of another version is skipped with a warning,
never rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cas_bank.blocks.store import BlockStore, Family, Write

log = logging.getLogger("cas_bank")

PREFIX = b"pin/"
VERSION = 1
_HEAD = struct.Struct("<BBIId")
_HASH = 32


def pin_key(root: bytes, tokens: np.ndarray) -> bytes:
    """The `meta` key of the pin of `tokens` (a uint32 array) under `root`."""
    digest = hashlib.blake2b(tokens.astype("<u4").tobytes(), digest_size=16).digest()
    return PREFIX + bytes(root) + digest


@dataclass(frozen=True, slots=True)
class Pin:
    """One pinned prefix."""

    root: bytes
    tokens: tuple[int, ...]
    blocks: tuple[bytes, ...]  # chain hashes, first to last
    ends: bool  # the end records under the last block are held too
    time: float  # when it was pinned (the bank's clock)

    @property
    def key(self) -> bytes:
        return pin_key(self.root, np.asarray(self.tokens, dtype=np.uint32))

    @property
    def end_parent(self) -> bytes | None:
        """The parent of the end records this pin holds, or None."""
        return self.blocks[-1] if self.ends and self.blocks else None

    def encode(self) -> bytes:
        head = _HEAD.pack(VERSION, int(self.ends), len(self.blocks), len(self.tokens), self.time)
        toks = np.asarray(self.tokens, dtype="<u4").tobytes()
        return head + self.root + b"".join(self.blocks) + toks

    @classmethod
    def decode(cls, raw: bytes) -> Pin | None:
        """The pin in `raw`, or None for a record this version cannot read."""
        if len(raw) < _HEAD.size + _HASH or raw[0] != VERSION:
            return None
        _, flags, n_blocks, n_tokens, t = _HEAD.unpack_from(raw)
        at = _HEAD.size
        if len(raw) != at + _HASH * (1 + n_blocks) + 4 * n_tokens:
            return None
        root = raw[at : at + _HASH]
        at += _HASH
        blocks = tuple(raw[at + _HASH * i : at + _HASH * (i + 1)] for i in range(n_blocks))
        at += _HASH * n_blocks
        tokens = tuple(int(x) for x in np.frombuffer(raw[at:], dtype="<u4"))
        return cls(root, tokens, blocks, bool(flags & 1), t)


def read_pins(store: BlockStore) -> list[Pin]:
    """Every pin the bank holds (a walk of the small `meta` family)."""
    out: list[Pin] = []
    for key, raw in store.iterate(Family.META):
        if not key.startswith(PREFIX):
            continue
        pin = Pin.decode(raw)
        if pin is None:
            log.warning("cas_bank: a pin record this version cannot read is skipped: %s", key)
            continue
        out.append(pin)
    return out


def pin_writes(pins: Sequence[Pin]) -> list[Write]:
    return [(Family.META, p.key, p.encode()) for p in pins]
