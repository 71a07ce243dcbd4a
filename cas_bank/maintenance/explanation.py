"""What `explain` answers: why a prompt did (not) hit, as fields (`Explanation`, with
the records it holds: `Divergence`, `CorruptRecord`, `StateEviction`) and as sentences
(`Explanation.summary`). What each field means, and how `explain` finds it, is said in
`cas_bank.maintenance.explain`'s docstring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from cas_bank.evict.evicted import Reason

StopReason = Literal["complete", "diverged", "absent", "no_state", "corrupt"]
Missing = Literal["evicted", "never_stored", "not_recorded"]

_BY: dict[Reason, str] = {
    "budget": "by the byte budget (max_bytes)",
    "gc": "by cas-bank gc",
    "damaged": "by verify --fix, as damaged",
    "unreachable": "by verify --fix, below a damaged block",
}


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the prompt's block leaves the stored block most like it."""

    block: int  # index of the prompt's block that is not stored
    token: int  # absolute position of the first differing token
    prompt_token: int
    stored_token: int
    sibling: str  # hex chain hash of the stored block it left


@dataclass(frozen=True, slots=True)
class CorruptRecord:
    block: int
    chain_hash: str
    record: Literal["payload", "state"]
    why: str


@dataclass(frozen=True, slots=True)
class StateEviction:
    boundary: int  # the token position of the state that was removed on its own
    at: float  # seconds since the epoch
    by: Reason


@dataclass(frozen=True, slots=True)
class Explanation:
    tokens: int
    block_size: int
    full_blocks: int
    tail_tokens: int  # tokens after the last full block: never stored as a block
    matched_blocks: int
    restorable_tokens: int
    stop: StopReason  # what ended the restore
    hybrid: bool
    divergence: Divergence | None = None
    missing_block: str | None = None  # hex chain hash of the first unstored block
    state_at: int | None = None  # hybrid: deepest matched boundary with a state
    boundaries_without_state: list[int] = field(default_factory=list)
    corrupt: list[CorruptRecord] = field(default_factory=list)
    blocks_evicted: int = 0  # by this bank so far
    missing: Missing | None = None  # what became of the first block not stored
    evicted_at: float | None = None  # when it was removed (missing == "evicted")
    evicted_by: Reason | None = None  # why
    memory_horizon: float | None = None  # removals then or before may lack records (None: none)
    states_evicted: list[StateEviction] = field(default_factory=list)
    end_record_tokens: int | None = None  # an end record under the matched chain covers these
    end_record_logits: bool = False  # it holds its last token's logits (no forward needed)
    # The stored child of the matched chain sharing the prompt's next tokens (a partial
    # block, docs/design.md "Partial blocks"): its hex name, kind, the tokens it shares,
    # and whether the restore takes them (else why not).
    partial_child: str | None = None
    partial_kind: Literal["block", "end"] | None = None
    partial_tokens: int = 0
    partial_used: bool = False
    partial_refused: str | None = None

    def as_dict(self, *, stored_tokens: bool = True) -> dict[str, Any]:
        """The fields and the summary. `stored_tokens=False` (the server's answer to any
        client): without the stored block's token and name where the prompt diverges,
        which would let a client rebuild another user's prompt a token per call."""
        out = asdict(self)
        out["summary"] = self.summary(stored_tokens=stored_tokens)
        if not stored_tokens and out["divergence"] is not None:
            del out["divergence"]["stored_token"], out["divergence"]["sibling"]
        return out

    def summary(self, *, stored_tokens: bool = True) -> list[str]:
        """The explanation in sentences (`stored_tokens`: as in `as_dict`)."""
        bs = self.block_size
        lines = [
            f"{self.matched_blocks} of {self.full_blocks} full blocks matched "
            f"({self.matched_blocks * bs} of {self.tokens} tokens); a restore covers "
            f"{self.restorable_tokens}.",
            *self._missing_lines(stored_tokens),
            *self._state_lines(),
            *self._end_lines(),
            *self._partial_lines(),
        ]
        for c in self.corrupt:
            lines.append(f"block {c.block} ({c.chain_hash[:16]}): {c.record} {c.why}.")
        if self.tail_tokens:
            lines.append(f"the last {self.tail_tokens} tokens fill no whole block.")
        return lines

    def _missing_lines(self, stored_tokens: bool) -> list[str]:
        """Where the chain leaves what is stored, and what became of the prompt's block."""
        lines = []
        d = self.divergence
        if d is not None:
            theirs = (
                f"the stored block {d.sibling[:16]} has {d.stored_token}"
                if stored_tokens
                else "a stored block has another"
            )
            lines.append(
                f"the chain diverges in block {d.block} at token {d.token}: the prompt has "
                f"id {d.prompt_token}, {theirs}."
            )
        elif self.missing_block is not None:
            lines.append(
                f"block {self.matched_blocks} ({self.missing_block[:16]}) is absent and no "
                "stored block continues the chain there."
            )
        if self.missing_block is not None:
            lines.append(f"the prompt's block {self.matched_blocks} {self._history()}.")
        return lines

    def _state_lines(self) -> list[str]:
        """A hybrid chain's states: the deepest one a restore uses (or the end record it
        resumes from instead), the boundaries without one, and the ones evicted."""
        if not (self.hybrid and self.matched_blocks):
            return []
        lines = []
        if self.state_at is None:
            where = (
                "no boundary before the first corrupt block holds a recurrent state"
                if any(c.record == "payload" for c in self.corrupt)
                else "no matched boundary holds a recurrent state"
            )
            then = (
                "nothing to restore"
                if self.end_record_tokens is None
                else f"the restore resumes from the end record at token {self.end_record_tokens}"
            )
            lines.append(f"{where}: {then}.")
        elif self.boundaries_without_state:
            lines.append(
                f"the deepest matched boundary with a state is token {self.state_at}; "
                f"boundaries {_ranges(self.boundaries_without_state)} hold none."
            )
        for s in self.states_evicted:
            lines.append(f"the state at token {s.boundary} was removed {_when(s.at)} {_BY[s.by]}.")
        return lines

    def _end_lines(self) -> list[str]:
        if self.end_record_tokens is None:
            return []
        how = "."
        if self.end_record_tokens == self.tokens:
            how = (
                ": an exact repeat, restored with no prefill."
                if self.end_record_logits
                else ": an exact repeat, but without its logits (a runtime runs the "
                "last token again)."
            )
        return [f"an end record covers {self.end_record_tokens} tokens{how}"]

    def _partial_lines(self) -> list[str]:
        if self.partial_child is None:
            return []
        what = "stored block" if self.partial_kind == "block" else "end record"
        return [
            f"a partial block: the {what} {self.partial_child[:16]} after the matched "
            f"chain shares the next {self.partial_tokens} tokens; "
            + (
                "a restore takes them."
                if self.partial_used
                else f"not used: {self.partial_refused}."
            )
        ]

    def _history(self) -> str:
        if self.missing == "evicted":
            assert self.evicted_at is not None and self.evicted_by is not None
            return f"was evicted {_when(self.evicted_at)} {_BY[self.evicted_by]}"
        if self.missing == "never_stored":
            return "was never stored here (the bank remembers every block it removed)"
        if self.memory_horizon is None:
            return "was never stored here, or removed before this bank recorded removals"
        return (
            f"was never stored here, or removed {_when(self.memory_horizon)} or before "
            "(removals until then may have left no record)"
        )


def _when(t: float) -> str:
    return "at " + datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace(
        "+00:00", "Z"
    )


def _ranges(values: list[int]) -> str:
    if len(values) <= 4:
        return ", ".join(map(str, values))
    return f"{values[0]}, {values[1]}, ..., {values[-1]} ({len(values)} of them)"
