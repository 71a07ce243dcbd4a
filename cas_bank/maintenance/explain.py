"""Why a prompt did (not) hit: how far its chain matched, and what stopped a restore.

`explain(bank, root, tokens)` walks the chain of `tokens` in namespace `root` the
way `Namespace.restore(tokens)` does, and says for each thing that can end a
restore where it happened:

- `matched_blocks`: leading full blocks whose headers are stored (or queued for the
  background writer: `index.view`, as a restore sees them);
- at the first block that is not: `diverged_at`, the first token where the prompt
  leaves a stored sibling block (the stored block under the same parent that shares
  the most leading tokens with the prompt's block, and the token ids on each side),
  or, when no stored block continues the chain there, "absent"; either way
  `missing` says what became of the prompt's own block there: `evicted` (at
  `evicted_at`, by `evicted_by`: the byte budget, `cas-bank gc`, or `verify --fix`
  as damaged or below a damaged block), `never_stored`, or `not_recorded` (never
  stored, or removed before `memory_horizon`: the bank remembers a bounded number of
  removals, `cas_bank.evict.evicted`);
- the tail: tokens after the last full block are never a block (`tail_tokens`);
- for a hybrid model, `state_at`: the deepest matched boundary with a stored state
  (a restore stops there, unless it resumes from an end record's state past the
  matched chain) and `boundaries_without_state`: the matched boundaries
  below the chain's end that hold none, and of those `states_evicted`: the ones
  whose state was removed on its own (when, why);
- `corrupt`: matched blocks (and the state a restore would use) whose payload fails
  its digest or cannot be read; a restore stops before the first one.

- `end_record_tokens`: an end record (docs/design.md, "End records") under the
  deepest matched block whose tail prefixes the prompt: an exact repeat, or a finished
  request the prompt extends, and the tokens it covers; `end_record_logits`: whether
  it holds its last token's logits.

`restorable_tokens` is what `Namespace.restore(tokens)` would return now. A runtime
restores `tokens[:-1]` of a prompt (`PrefixCache.restore`), so explain a prompt by
its tokens less the last one to see what a request gets; the server's first try is
the whole prompt (`PrefixCache.restore_exact`: an exact repeat whose end record holds
the logits needs no forward pass), which `/v1/explain` follows. Reads every header once to
find sibling blocks (as `cas-bank tree` does): a diagnostic, not a hot-path call.

Here: the walk; the answer's records (`Explanation`, `Divergence`, `CorruptRecord`,
`StateEviction`) and their sentences are `cas_bank.maintenance.explanation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import BlockHash, as_token_array, chain_hashes
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError
from cas_bank.evict.evicted import Reason, horizon, lookup, record_key
from cas_bank.index.chain import Header, longest_chain
from cas_bank.index.ends import EndHeader, find_end
from cas_bank.index.partial import find_partial
from cas_bank.index.tree import HeaderIndex
from cas_bank.index.view import QUEUED_DIGEST, ReadView, read_view
from cas_bank.maintenance.explanation import (
    CorruptRecord,
    Divergence,
    Explanation,
    Missing,
    StateEviction,
    StopReason,
)
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.bank import Bank

# The records of an explanation live in `explanation`; importable from here as before.
__all__ = [
    "CorruptRecord",
    "Divergence",
    "Explanation",
    "Missing",
    "StateEviction",
    "StopReason",
    "explain",
]


def explain(bank: Bank, root: bytes, tokens: Any, index: HeaderIndex | None = None) -> Explanation:
    """Explain `Namespace.restore(tokens)` in namespace `root` (see the module)."""
    toks = as_token_array(tokens)
    bs = bank.config.block_size
    store = bank.store
    view = read_view(bank)  # what the bank accepted: queued stores too, as a restore sees
    hashes = chain_hashes(root, toks, bs)
    matched = longest_chain(view, root, hashes)
    k = len(matched)
    raw_spec = store.get(Family.NAMESPACES, root)
    hybrid = raw_spec is not None and ModelSpec.model_validate_json(raw_spec).is_hybrid
    missing = hashes[k].hex() if k < len(hashes) else None
    divergence = None
    if missing is not None:
        parent = matched[-1].chain_hash if matched else root
        index = index or HeaderIndex.load(store)
        divergence = _divergence(index.children_of(parent), toks[k * bs : (k + 1) * bs], k, bs)
    corrupt, good = _payloads_checked(bank, matched)
    states = _states_checked(bank, matched, good, corrupt) if hybrid else _States(usable=good)
    blocks_evicted = bank.counters.values()["blocks_evicted"]
    fate = _fate(store, hashes[k], blocks_evicted) if missing is not None else _Fate()
    end = _end_record(view, root, hashes, toks, k, bs, corrupt)
    end_tokens = end.n_tokens if end is not None else None
    partial = _partial(bank, view, root, hashes, toks, k, hybrid, corrupt, end_tokens)
    return Explanation(
        tokens=len(toks),
        block_size=bs,
        full_blocks=len(hashes),
        tail_tokens=len(toks) - len(hashes) * bs,
        matched_blocks=k,
        restorable_tokens=max(
            states.usable * bs, end_tokens or 0, k * bs + partial.shared if partial.used else 0
        ),
        # An end record lies past every matched block: a hybrid restore resumes from its
        # state, so the boundaries without one do not end it.
        stop=_stop(corrupt, hybrid and states.usable < good and end is None, divergence, missing),
        hybrid=hybrid,
        divergence=divergence,
        missing_block=missing,
        state_at=states.state_at,
        boundaries_without_state=states.without,
        corrupt=corrupt,
        blocks_evicted=blocks_evicted,
        missing=fate.fate,
        evicted_at=fate.at,
        evicted_by=fate.by,
        memory_horizon=fate.horizon,
        states_evicted=_states_evicted(store, states.stateless),
        end_record_tokens=end_tokens,
        end_record_logits=end is not None and end.has_logits,
        partial_child=partial.child,
        partial_kind=partial.kind,
        partial_tokens=partial.shared,
        partial_used=partial.used,
        partial_refused=partial.refused,
    )


def _end_record(
    view: ReadView,
    root: bytes,
    hashes: list[BlockHash],
    toks: Any,
    k: int,
    bs: int,
    corrupt: list[CorruptRecord],
) -> EndHeader | None:
    """The end record under the deepest matched block, as a restore looks for one: used
    when no payload on the way is corrupt (a restore then stops before it)."""
    if corrupt:
        return None
    try:
        found = find_end(view, root, hashes, toks, k, bs)
    except CorruptDataError:  # the ends family unreadable: a restore reads no record either
        return None
    return found.header if found is not None else None


def _stop(
    corrupt: list[CorruptRecord],
    no_state: bool,
    divergence: Divergence | None,
    missing: str | None,
) -> StopReason:
    """What ended the restore, the first of: a corrupt record, a missing state, the
    prompt leaving a stored block, its block absent."""
    if corrupt:
        return "corrupt"
    if no_state:
        return "no_state"
    if divergence is not None:
        return "diverged"
    if missing is not None:
        return "absent"
    return "complete"


def _payloads_checked(bank: Bank, matched: list[Header]) -> tuple[list[CorruptRecord], int]:
    """The first matched block whose payload fails its check (as a restore stops
    there), and how many blocks before it are good."""
    for i, h in enumerate(matched):
        why = _check(bank, Family.BLOCKS, h.chain_hash, h.payload_digest)
        if why is not None:
            return [CorruptRecord(i, h.chain_hash.hex(), "payload", why)], i
    return [], len(matched)


@dataclass(slots=True)
class _States:
    """A hybrid chain's states: the deepest good one (`state_at`, the blocks a restore
    can use up to it), the boundaries without one, and their chain hashes."""

    usable: int
    state_at: int | None = None
    without: list[int] = field(default_factory=list)
    stateless: dict[int, bytes] = field(default_factory=dict)  # boundary -> chain hash


def _states_checked(
    bank: Bank, matched: list[Header], good: int, corrupt: list[CorruptRecord]
) -> _States:
    """From the last good block back: the deepest boundary whose state checks out;
    corrupt states are added to `corrupt`."""
    out = _States(usable=0)
    for i in range(good - 1, -1, -1):
        h = matched[i]
        if not h.has_state:
            out.without.append(h.end)
            out.stateless[h.end] = h.chain_hash
            continue
        assert h.state_digest is not None
        why = _check(bank, Family.STATES, h.chain_hash, h.state_digest)
        if why is None:
            out.state_at, out.usable = h.end, i + 1
            break
        corrupt.append(CorruptRecord(i, h.chain_hash.hex(), "state", why))
        out.without.append(h.end)
    out.without.sort()
    return out


def _states_evicted(store: BlockStore, stateless: dict[int, bytes]) -> list[StateEviction]:
    """Which of the boundaries without a state had one that was evicted (and when)."""
    ends = sorted(stateless)
    records = lookup(store, [record_key(stateless[e], True) for e in ends]) if ends else []
    return [
        StateEviction(end, r.time, r.reason)
        for end, r in zip(ends, records, strict=True)
        if r is not None
    ]


@dataclass(frozen=True, slots=True)
class _Fate:
    """What became of the first missing block: evicted (when, by what), never stored,
    or not known (eviction records reach back to `horizon` only)."""

    fate: Missing | None = None
    at: float | None = None
    by: Reason | None = None
    horizon: float | None = None


def _fate(store: BlockStore, block: bytes, blocks_evicted: int) -> _Fate:
    record = lookup(store, [record_key(block)])[0]
    reach = horizon(store, blocks_evicted)
    if record is not None:
        return _Fate("evicted", record.time, record.reason, reach.time)
    return _Fate("never_stored" if reach.complete else "not_recorded", None, None, reach.time)


@dataclass(frozen=True, slots=True)
class _Partial:
    child: str | None = None
    kind: Literal["block", "end"] | None = None
    shared: int = 0
    used: bool = False
    refused: str | None = None


def _partial(
    bank: Bank,
    view: ReadView,
    root: bytes,
    hashes: list[Any],
    toks: Any,
    k: int,
    hybrid: bool,
    corrupt: list[CorruptRecord],
    end_tokens: int | None,
) -> _Partial:
    """The partial block after the `k` matched blocks, as a restore weighs it (in the
    same view of the bank the chain was matched in)."""
    if corrupt:
        return _Partial()  # a restore stops before the corrupt block
    bs = bank.config.block_size
    plan = find_partial(view, root, hashes, toks, k, bs)
    if plan is None:
        return _Partial()
    child = plan.child
    kind: Literal["block", "end"] = "block" if child.is_block else "end"
    why = None
    if hybrid:
        why = (
            f"the model has recurrent layers, and a state exists only where it was captured: "
            f"none at token {plan.tokens}"
        )
    elif not bank.config.partial_blocks:
        why = "partial blocks are off (BankConfig.partial_blocks)"
    elif end_tokens is not None and end_tokens >= plan.tokens:
        why = f"the end record covers as much ({end_tokens} tokens)"
    elif plan.header is not None:
        bad = _check(bank, Family.BLOCKS, plan.header.chain_hash, plan.header.payload_digest)
        why = None if bad is None else f"its payload {bad}"
    return _Partial(child.name.hex(), kind, plan.shared, why is None, why)


def _divergence(siblings: list[Header], block: Any, index: int, bs: int) -> Divergence | None:
    """The first differing token against the sibling sharing the most leading tokens."""
    best: tuple[int, Header] | None = None
    ids = [int(t) for t in block]
    for h in siblings:
        theirs = h.token_ids()
        same = next((j for j, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b), None)
        if same is None:
            continue  # same tokens, other hash: not a divergence in the tokens
        if best is None or same > best[0]:
            best = (same, h)
    if best is None:
        return None
    j, h = best
    return Divergence(
        block=index,
        token=index * bs + j,
        prompt_token=ids[j],
        stored_token=h.token_ids()[j],
        sibling=h.chain_hash.hex(),
    )


def _check(bank: Bank, family: Family, key: bytes, digest: bytes) -> str | None:
    """Why the record fails (missing, unreadable, digest mismatch), or None if it is good
    (a queued one's arrays are in memory: nothing to check)."""
    if digest == QUEUED_DIGEST:
        return None
    try:
        raw = bank.store.get(family, key)
    except CorruptDataError as e:
        return f"is unreadable ({e})"
    if raw is None:
        return "is missing"
    if not codec.verify(raw, digest):
        return "fails its digest"
    return None
