"""A chain continued from another tier, and what a namespace asks of such a tier.

The local lookup finds the longest stored chain; a tier behind the bank (the shared
Valkey tier, `cas_bank.remote`) may continue it. The namespace sees it only through
`ChainTier`, so nothing under the API imports the tier's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cas_bank.blocks import codec
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header
from cas_bank.spec import ModelSpec


@dataclass(frozen=True)
class FetchedEnd:
    """An end record from another tier, verified: the plan a restore resumes from, and
    its `ends` family key and value (written locally after the restore)."""

    plan: Any  # an `index.ends.EndPlan` (not imported: `index.ends` needs this module's users)
    key: bytes  # parent || end hash
    value: bytes


@dataclass
class Continuation:
    """The local chain continued from another tier, fetched and verified."""

    start: int  # blocks before it are local
    matched: list[Header]  # the whole chain; the state's block carries its digest
    blocks: dict[bytes, codec.Decoded] = field(default_factory=dict)  # by chain hash
    states: dict[bytes, codec.Decoded] = field(default_factory=dict)
    raw: dict[tuple[Family, bytes], bytes] = field(default_factory=dict, repr=False)
    state_at: int | None = None  # index of the block whose state came from the tier
    # An end record under the chain's last block, from the tier: the restore resumes
    # from it (its blocks' KV, then its tail and state) instead of a boundary state.
    end: FetchedEnd | None = None


class ChainSpace(Protocol):
    """What a tier needs of a namespace: its root, block size and model."""

    @property
    def root(self) -> bytes: ...

    @property
    def block_size(self) -> int: ...

    @property
    def spec(self) -> ModelSpec: ...


class ChainTier(Protocol):
    """A tier that continues chains on restore and takes new blocks after a store."""

    def continue_chain(
        self,
        ns: ChainSpace,
        toks: np.ndarray,
        hashes: Sequence[bytes],
        matched: Sequence[Header],
    ) -> Continuation | None: ...

    def partial_child(
        self, ns: ChainSpace, parent: bytes, index: int, after: bytes
    ) -> tuple[Header, codec.Decoded, int] | None:
        """The stored child of `parent` (block `index - 1`) sharing the most (j >= 1) of
        the prompt's next tokens `after` (>u4): its header, verified payload and j."""
        ...

    def restored(
        self, ns: ChainSpace, cont: Continuation, n_blocks: int, state: bool, *, end: bool = False
    ) -> None: ...

    def publish(
        self, root: bytes, blocks: list[tuple[Header, bytes]], states: list[tuple[bytes, bytes]]
    ) -> None: ...

    def publish_end(self, root: bytes, key: bytes, value: bytes, header_len: int) -> None: ...
