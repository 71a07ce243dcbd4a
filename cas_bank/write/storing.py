"""The store path of a `Namespace`: a prompt's full blocks and boundary states.

The steps: the input checked -> the chain's headers read, the blocks and states that
are new found (and the tail admission leaves out) -> their payloads cut, outside the
write lock -> one transaction: the headers read again (another thread may have written
or evicted some since; a block evicted below a new one is cut again, so the chain
keeps no hole), the block and state records written with their headers and counters,
the stored part's last uses recorded -> after the commit, the new records queued for
the shared tier and the stored part leased. `Namespace.store` calls `store`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import BlockHash, as_token_array
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header, read_headers
from cas_bank.index.records import block_rewrite, state_write_delta
from cas_bank.spec import BlockCutter, boundary_states, check_layers, encode_state

if TYPE_CHECKING:
    from cas_bank.owner import Owner
    from cas_bank.spec import ModelSpec
    from cas_bank.write.txn import Transaction


@dataclass(frozen=True, slots=True)
class StoreReport:
    """What one `Namespace.store` did."""

    tokens: int  # tokens offered
    blocks: int  # full blocks among them
    blocks_written: int
    blocks_existing: int
    states_written: int
    states_existing: int
    bytes_written: int
    chain: list[BlockHash] = field(repr=False)


class Storable(Protocol):
    """What a store needs of a namespace (`cas_bank.namespace.Namespace`)."""

    bank: Owner
    spec: ModelSpec
    root: bytes
    block_size: int

    def chain(self, tokens: Any) -> list[BlockHash]: ...

    def _lease_stored(
        self,
        hashes: list[BlockHash],
        kept: int,
        flat: list[mx.array],
        states: Mapping[int, Sequence[mx.array]],
    ) -> None: ...


@dataclass(slots=True)
class Offer:
    """A store's input, checked: the tokens, per-layer arrays (`check_layers`: each
    attention layer's arrays, flat), the boundary states offered (by token position,
    `boundary_states`) and the chain hashes of the tokens."""

    toks: np.ndarray
    arrays: list[list[mx.array]]
    states: dict[int, list[mx.array]]
    hashes: list[BlockHash]


@dataclass(slots=True)
class _Written:
    """What the transaction wrote: headers by block position, the positions whose
    block and whose state records were written, and their bytes."""

    headers: dict[int, Header] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    nbytes: int = 0


def store(
    ns: Storable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None = None,
) -> StoreReport:
    """`Namespace.store(tokens, layers, states)` of `ns` (its docstring says what it
    does)."""
    if ns.bank.read_only:
        raise RuntimeError(f"bank at {ns.bank.path} is open read-only: it cannot store")
    return store_offer(ns, _checked_offer(ns, tokens, layers, states))


def store_offer(ns: Storable, offer: Offer) -> StoreReport:
    """`store` of input checked already (a queued store checked it when it was queued,
    and hashed its tokens)."""
    bank = ns.bank
    if bank.read_only:
        raise RuntimeError(f"bank at {bank.path} is open read-only: it cannot store")
    existing = read_headers(bank.store, offer.hashes)
    payloads, deferred = _new_blocks(ns, offer, existing)
    state_payloads = _new_states(ns, offer, existing, set(payloads))
    with bank.transaction() as tx:
        current, done = _write(ns, tx, offer, existing, payloads, state_payloads)
        kept, kept_states = _record_store(ns, tx, offer, current, done, deferred)
    _after_commit(ns, offer, done, payloads, state_payloads, kept, kept_states)
    return _report(offer, done)


def _checked_offer(
    ns: Storable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None,
) -> Offer:
    """The store's input checked against `ns`'s spec, with its chain hashes."""
    toks = as_token_array(tokens)
    n = len(toks)
    return Offer(
        toks,
        check_layers(ns.spec, layers, n),
        boundary_states(ns.spec, states, n, ns.block_size),
        ns.chain(toks),
    )


def _record_store(
    ns: Storable,
    tx: Transaction,
    offer: Offer,
    current: list[Header | None],
    done: _Written,
    deferred: int,
) -> tuple[int, list[int]]:
    """In `tx`: the store's counters, the last uses of the stored part and the suspect
    marks the written records clear. Returns the stored part (`_stored_part`): how many
    leading blocks of the chain are stored, and the offered state boundaries among
    them whose state is."""
    hashes = offer.hashes
    tx.add(
        stores=1,
        logical_tokens=len(hashes) * ns.block_size,
        blocks_written=len(done.blocks),
        blocks_deduplicated=len(hashes) - len(done.blocks),
        states_written=len(done.states),
        bytes_written=done.nbytes,
        blocks_deferred=deferred,
    )
    # The stored part of the chain was used now, its stored states offered too
    # (a block admission left out has no last use: it does not exist).
    kept, kept_states = _stored_part(current, done.headers, offer.states, ns.block_size)
    tx.touch(hashes[:kept], [hashes[b // ns.block_size - 1] for b in kept_states])
    tx.clear_suspect(
        blocks=[hashes[i] for i in done.blocks], states=[hashes[i] for i in done.states]
    )
    return kept, kept_states


def _after_commit(
    ns: Storable,
    offer: Offer,
    done: _Written,
    payloads: dict[int, bytes],
    state_payloads: dict[int, bytes],
    kept: int,
    kept_states: list[int],
) -> None:
    """Once committed: the new records queued for the shared tier, the stored part leased."""
    bank, hashes = ns.bank, offer.hashes
    if bank.remote is not None:  # committed: queue it, the request never waits on the network
        bank.remote.publish(
            ns.root,
            [(done.headers[i], payloads[i]) for i in done.blocks],
            [(hashes[i], state_payloads[i]) for i in done.states],
        )
    if bank.leases is not None:
        # The chain is in memory already: a restore of it hands these out (the cache
        # copies its buffer on its next update: see index.lease).
        flat = [a for layer in offer.arrays for a in layer]
        ns._lease_stored(hashes, kept, flat, {b: offer.states[b] for b in kept_states})


def _report(offer: Offer, done: _Written) -> StoreReport:
    """What the store of `offer` did, `done` being what its transaction wrote."""
    hashes = offer.hashes
    return StoreReport(
        tokens=len(offer.toks),
        blocks=len(hashes),
        blocks_written=len(done.blocks),
        blocks_existing=len(hashes) - len(done.blocks),
        states_written=len(done.states),
        states_existing=len(offer.states) - len(done.states),
        bytes_written=done.nbytes,
        chain=hashes,
    )


def _new_blocks(
    ns: Storable, offer: Offer, existing: Sequence[Header | None]
) -> tuple[dict[int, bytes], int]:
    """The payloads of the blocks not stored yet (or suspect), by position, cut now;
    and how many trailing ones admission leaves out."""
    suspects = ns.bank.suspects
    hashes = offer.hashes
    missing = [i for i, h in enumerate(existing) if h is None or suspects.block(hashes[i])]
    deferred = _admit(ns, hashes, missing)
    if deferred:
        missing = missing[: len(missing) - deferred]
    if not missing:
        return {}, deferred
    return _cut(ns, offer, missing), deferred


def _cut(ns: Storable, offer: Offer, positions: Sequence[int]) -> dict[int, bytes]:
    """The encoded payloads of the blocks at `positions`."""
    bank = ns.bank
    cutter = BlockCutter(ns.spec, offer.arrays, ns.block_size)
    return {i: cutter.payload(i, bank.config.compression, bank.payload_check) for i in positions}


def _new_states(
    ns: Storable, offer: Offer, existing: Sequence[Header | None], admitted: set[int]
) -> dict[int, bytes]:
    """The encoded boundary states to write, by block position: those offered whose
    block is stored or written now and holds no state (or a suspect one)."""
    bank = ns.bank
    out: dict[int, bytes] = {}
    for b, st in offer.states.items():
        i = b // ns.block_size - 1
        h = existing[i]
        if h is None and i not in admitted:
            continue  # its block is not written now (admission): nor is the state
        if h is None or not h.has_state or bank.suspects.state(offer.hashes[i]):
            out[i] = encode_state(st, bank.config.compression, bank.payload_check)
    return out


def _write(
    ns: Storable,
    tx: Transaction,
    offer: Offer,
    existing: list[Header | None],
    payloads: dict[int, bytes],
    state_payloads: dict[int, bytes],
) -> tuple[list[Header | None], _Written]:
    """In the transaction: the headers read again, blocks evicted since the first look
    cut again (into `payloads`), then the block and state records written. Returns the
    headers as read under the lock and what was written."""
    if not (payloads or state_payloads):
        return existing, _Written()
    hashes = offer.hashes
    # Another thread may have written some of these since the first look.
    damaged: set[int] = set()  # header records present but unreadable
    current = read_headers(tx.store, hashes, damaged)
    # Eviction may have removed a block seen at the first look: cut it again, or the
    # new blocks below it would leave a hole in the chain. Blocks beyond the last one
    # written now wait (admission): no hole below it.
    frontier = max([*payloads, *state_payloads])
    lost = [i for i, h in enumerate(current) if h is None and i not in payloads and i <= frontier]
    if lost:
        payloads.update(_cut(ns, offer, lost))
    done = _Written()
    _write_blocks(ns, tx, offer, current, damaged, payloads, done)
    _write_states(ns, tx, hashes, current, state_payloads, done)
    tx.extend((Family.HEADERS, hashes[i], h.encode()) for i, h in done.headers.items())
    return current, done


def _write_blocks(
    ns: Storable,
    tx: Transaction,
    offer: Offer,
    current: Sequence[Header | None],
    damaged: set[int],
    payloads: Mapping[int, bytes],
    done: _Written,
) -> None:
    """The block records of `payloads` not stored meanwhile (or suspect), their headers
    (keeping a state the old header named) and the counters' changes."""
    suspects, bs, hashes = ns.bank.suspects, ns.block_size, offer.hashes
    for i, payload in payloads.items():
        old = current[i]
        if old is not None and not suspects.block(hashes[i]):
            continue
        lo = i * bs
        done.headers[i] = Header(
            chain_hash=hashes[i],
            parent=ns.root if i == 0 else hashes[i - 1],
            index=i,
            root=ns.root,
            payload_digest=codec.embedded_digest(payload),
            payload_size=len(payload),
            tokens=offer.toks[lo : lo + bs].tobytes(),
            state_digest=old.state_digest if old else None,
            state_size=old.state_size if old else 0,
        )
        done.blocks.append(i)
        tx.put(Family.BLOCKS, hashes[i], payload)
        done.nbytes += len(payload)
        deltas, extra = block_rewrite(tx.store, hashes[i], old, i in damaged, len(payload))
        tx.add(**deltas)
        tx.extend(extra)


def _write_states(
    ns: Storable,
    tx: Transaction,
    hashes: Sequence[BlockHash],
    current: Sequence[Header | None],
    state_payloads: Mapping[int, bytes],
    done: _Written,
) -> None:
    """The state records of `state_payloads` whose block holds none yet (or a suspect
    one), and the headers that now name them."""
    suspects = ns.bank.suspects
    for i, payload in state_payloads.items():
        base = done.headers.get(i) or current[i]
        assert base is not None, "a state's block is stored with it or before it"
        if base.has_state and not suspects.state(hashes[i]):
            continue
        done.headers[i] = base.with_state(codec.embedded_digest(payload), len(payload))
        done.states.append(i)
        tx.put(Family.STATES, hashes[i], payload)
        done.nbytes += len(payload)
        tx.add(**state_write_delta(base, len(payload)))


def _admit(ns: Storable, hashes: Sequence[bytes], missing: list[int]) -> int:
    """How many of the trailing `missing` blocks this store leaves out (BankConfig.admit
    and admit_min_tokens); the chain stays prefix-closed: only a tail is left out."""
    config = ns.bank.config
    if not missing:
        return 0
    if len(hashes) * ns.block_size < config.admit_min_tokens:
        return len(missing)
    if config.admit != "second_use":
        return 0
    seen = ns.bank.seen
    keep = 0
    for i in missing:
        if hashes[i] not in seen:
            break
        keep += 1
    seen.update(hashes[i] for i in missing)
    return len(missing) - keep


def _stored_part(
    current: Sequence[Header | None],
    written: Mapping[int, Header],
    states: Mapping[int, Any],
    block_size: int,
) -> tuple[int, list[int]]:
    """After a store: how many leading blocks of its chain are stored (`current` read
    under the write lock, `written` by the store), and the offered state boundaries
    among them whose state is stored."""
    kept = 0
    while kept < len(current) and (current[kept] is not None or kept in written):
        kept += 1
    stored: list[int] = []
    for b in states:
        i = b // block_size - 1
        header = written.get(i) or (current[i] if i < kept else None)
        if i < kept and header is not None and header.has_state:
            stored.append(b)
    return kept, stored
