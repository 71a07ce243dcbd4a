"""What `verify` reports: each problem it finds (`Problem`, of a `ProblemKind`) and
what it checked and removed (`VerifyReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ProblemKind = Literal[
    "bad_header",  # the header record does not decode
    "hash_mismatch",  # the chain hash does not recompute from parent and tokens
    "bad_link",  # the parent link is inconsistent (index, namespace, root)
    "dangling",  # the parent block is not stored
    "unknown_namespace",  # block 0 of a namespace that is not recorded (or unreadable)
    "payload_missing",
    "payload_corrupt",
    "state_missing",
    "state_corrupt",
    "unreachable",  # intact, but below a bad block: no lookup can reach it
    "orphan_payload",  # a payload no header claims
    "orphan_state",  # a state no header announces
    "bad_namespace",  # a namespace record that does not parse
    "bad_end",  # an end record that does not parse, not under its own name, or its file gone
    "corrupt_end",  # an end record whose payload fails its digest
    "dangling_end",  # an end record whose parent block is not stored (or is bad)
    "bad_access",  # the last-use records cannot all be read (a damaged file)
    "orphan_access",  # a last use of a block, state or end records that is not stored
    "bad_child",  # a children-index entry naming no stored block or end record
    "unindexed",  # a stored block or end record missing from the children index
    "bad_chain_record",  # a chain record a lookup could take for other than the headers
    "bad_prefix_record",  # a prefix record not kept with its chain record, or misnamed
]


@dataclass(frozen=True, slots=True)
class Problem:
    kind: ProblemKind
    chain_hash: bytes  # the block (or record key) concerned
    detail: str
    index: int | None = None  # block index, where the header is readable
    root: bytes | None = None  # namespace root, where the header is readable


@dataclass(slots=True)
class VerifyReport:
    """What `verify` checked and found (and, with `fix`, removed)."""

    blocks_checked: int = 0
    states_checked: int = 0
    ends_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    fixed: bool = False
    removed_blocks: list[bytes] = field(default_factory=list)
    removed_states: list[bytes] = field(default_factory=list)  # states dropped, blocks kept
    removed_orphans: int = 0
    removed_ends: int = 0
    # Records missing from the children index of a bank made before it (not problems:
    # they only miss partial-block reuse; `fix` indexes them), and entries `fix` wrote.
    unindexed: int = 0
    indexed: int = 0
    # Stored-content counters that disagree with what was found: name -> (counter, found).
    counter_drift: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems
