"""A queued turn: a prompt's blocks and, with them, its end record, handed to the
background writer (`Namespace.store_turn_later`, `store_later`, `prepare_end_later`,
`store_end_later`).

On the caller's thread the input is checked, hashed and snapshotted once (new objects
over the whole buffers, no copy: `index.lease`), its end record prepared from the same
snapshot and placed, everything put in the read view (`index.view`) and leased, and
only then queued: nothing of the caller's thread runs beside the writer once it has
work. The writer stores the blocks (`write.storing`) and the end record
(`write.end_records`); a store that fails or is skipped keeps leased only what the
bank holds. With no background writer, each is stored now, on the caller's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from cas_bank.blocks.hashing import BlockHash, as_token_array
from cas_bank.errors import BankFullError
from cas_bank.index.chain import stored_prefix
from cas_bank.index.ends import EndInput, prepare_end
from cas_bank.index.lease import Live
from cas_bank.index.view import QueuedChain, QueuedEnd
from cas_bank.spec import LayerKind, boundary_states, check_layers
from cas_bank.write import storing
from cas_bank.write.end_records import write_end
from cas_bank.write.storing import Storable, StoreReport
from cas_bank.write.writer import PendingStore

log = logging.getLogger("cas_bank")

T = TypeVar("T")
_NOTHING_STORED = StoreReport(0, 0, 0, 0, 0, 0, 0, chain=[])


class Queueable(Storable, Protocol):
    """What a queued turn needs of a namespace (`cas_bank.namespace.Namespace`): a
    `Storable`, its per-block layers' kinds, its inline stores (used with no background
    writer) and the live lease of an end record."""

    block_kinds: list[tuple[int, LayerKind]]

    def store(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None = None,
    ) -> StoreReport: ...

    def store_end(
        self,
        tokens: Any,
        layers: Sequence[Any],
        state: Sequence[Any] | None = None,
        *,
        logits: Any = None,
        hidden: Any = None,
    ) -> int: ...

    def _lease_live(
        self,
        hashes: list[BlockHash],
        end: EndInput,
        layers: Sequence[Any],
        key: bytes,
        released: list[object] | None = None,
    ) -> Live | None: ...


@dataclass(frozen=True, slots=True)
class EndOf:
    """The end record a queued store keeps of its own tokens (`store_turn_later`): the
    recurrent `state` at their end (per layer, None for attention layers; required for
    a hybrid model), the last token's `logits` and a `hidden` state, where known.
    `state_copied`: the state is the caller's own snapshot, taken for this record (new
    objects nothing writes into: `cache_io.snapshot_states`), not copied."""

    state: Sequence[Any] | None = None
    logits: Any = None
    hidden: Any = None
    state_copied: bool = False


@dataclass(frozen=True, slots=True)
class _Turn:
    """A queued store as `store_turn_later` prepared it: the checked input, its
    attention arrays flat, and the records the read view shows until written."""

    offer: storing.Offer
    flat: list[mx.array]
    queued_chain: QueuedChain | None
    queued_end: QueuedEnd | None
    # What its leases replaced, freed by the writer once it has written the turn.
    released: list[object] = field(default_factory=list)


def _own(a: mx.array) -> mx.array:
    """A new object over the same array (no copy, no MLX op): an in-place update rebinds
    the object it is applied to, so a snapshot never holds the caller's objects."""
    return a.reshape(a.shape)


def _own_layers(
    block_kinds: Sequence[tuple[int, LayerKind]], layers: Sequence[Any]
) -> list[list[mx.array]]:
    """`check_layers` of layers checked already (each attention layer's arrays, flat),
    as new objects (`_own`). `block_kinds`: `Namespace.block_kinds`."""
    return [[_own(a) for a in kind.flat(layers[i])] for i, kind in block_kinds]


def _bytes_written(report: StoreReport) -> int:
    return report.bytes_written


def _nbytes(nbytes: int) -> int:
    return nbytes


def _skipping_full(store: Callable[[], T], skip: bool, nothing: T) -> Callable[[], T]:
    """`store`, or (`skip`) `store` that logs a full disk and returns `nothing`."""
    if not skip:
        return store

    def skipping() -> T:
        try:
            return store()
        except BankFullError as e:
            log.warning("cas_bank: not stored: %s", e)
            return nothing

    return skipping


def store_turn_later(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None = None,
    *,
    end: EndOf | None = None,
    skip_when_full: bool = False,
    checked: bool = False,
) -> tuple[PendingStore[StoreReport], PendingStore[int] | None]:
    """`Namespace.store_turn_later(tokens, layers, states, ...)` of `ns` (its docstring
    says what it does)."""
    writer = ns.bank.writer
    if writer is None:
        return _store_turn_now(ns, tokens, layers, states, end, skip_when_full)
    if ns.bank.read_only:
        raise RuntimeError(f"bank at {ns.bank.path} is open read-only: it cannot store")
    if writer.closed:  # as `store` says it: nobody would write this one
        raise RuntimeError(f"bank at {ns.bank.path} is closed")
    turn = _turn(ns, tokens, layers, states, end, checked)
    live = _lease_turn(ns, turn, layers)
    try:
        pending = writer.submit(
            _chain_job(ns, turn, skip_when_full), _bytes_written, turn.queued_chain
        )
    except BaseException:  # not queued (closed since, or interrupted): never written
        _unlease_turn(ns, turn, live, chain=True)
        raise
    if turn.queued_end is None:
        return pending, None
    try:
        job = _end_job(ns, turn.offer.hashes, turn.queued_end, skip_when_full, turn.released, live)
        end_pending = writer.submit(job, _nbytes, turn.queued_end)
    except BaseException:
        _unlease_turn(ns, turn, live, chain=False)
        raise
    return pending, end_pending


def _turn(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None,
    end: EndOf | None,
    checked: bool = False,
) -> _Turn:
    """A queued store's input checked and hashed once, its arrays snapshotted
    without a copy (new objects over the whole buffers: the cache's next update
    copies its buffer instead of writing into them; `index.lease`) and evaluated,
    its end record prepared from the same snapshot (`prepare_end`: its state copied
    unless `end.state_copied`, its tail copied only when asked for), with the records
    the read view shows until written."""
    # Our own copy: the writer reads the tokens later (its headers', under the chain
    # hashes made here from them), and the caller's array (or the MLX array numpy
    # views) may be written meanwhile.
    toks = as_token_array(tokens).copy()
    n = len(toks)
    if checked:
        snapshot = _own_layers(ns.block_kinds, layers)
    else:
        snapshot = [[_own(a) for a in layer] for layer in check_layers(ns.spec, layers, n)]
    hashes = ns.chain(toks)
    flat = [a for layer in snapshot for a in layer]
    kept = {  # new objects: the caller's are not ours
        b: [_own(a) for a in st]
        for b, st in boundary_states(ns.spec, states, n, ns.block_size).items()
    }
    mx.eval(flat, list(kept.values()))
    offer = storing.Offer(toks, snapshot, kept, hashes)
    # In the read view until written (`index.view`), unless admission will write none.
    admitted = len(hashes) * ns.block_size >= ns.bank.config.admit_min_tokens
    chain = None
    if admitted:
        chain = QueuedChain(ns.root, hashes, toks, ns.block_size, flat, kept)
    if end is None:
        return _Turn(offer, flat, chain, None)
    record = prepare_end(
        ns.spec,
        ns.block_size,
        toks,
        layers,
        end.state,
        end.logits,
        end.hidden,
        copy=True,
        checked=snapshot,
        state_copied=end.state_copied,
    )
    return _Turn(offer, flat, chain, QueuedEnd(ns.root, hashes, record, ns.block_size))


def _lease_turn(ns: Queueable, turn: _Turn, layers: Sequence[Any]) -> Live | None:
    """Lease a queued turn: the caller's cache as the live lease of its end record
    (which is also the lease of its blocks), else its blocks; its states. The live
    lease kept, if one was."""
    leases = ns.bank.leases
    if leases is None:
        return None
    offer, end = turn.offer, turn.queued_end
    live = None
    if end is not None:
        live = ns._lease_live(offer.hashes, end.end, layers, end.key, turn.released)
    if live is None:
        leases.put(offer.hashes, turn.flat)
    leases.put_states(offer.hashes, offer.states)
    return live


def _unlease_turn(ns: Queueable, turn: _Turn, live: Live | None, *, chain: bool) -> None:
    """Undo `_lease_turn` of a turn not queued (`chain`: nor its blocks)."""
    leases = ns.bank.leases
    if leases is None:
        return
    if chain:
        leases.forget(turn.offer.hashes)
    if live is not None and turn.queued_end is not None:
        leases.drop_live(turn.queued_end.key, live)


def _chain_job(ns: Queueable, turn: _Turn, skip_when_full: bool) -> Callable[[], StoreReport]:
    """What the writer does for a queued turn's blocks: they are stored, and only what
    the bank then holds stays leased."""
    offer = turn.offer
    store = _skipping_full(lambda: storing.store_offer(ns, offer), skip_when_full, _NOTHING_STORED)
    if ns.bank.leases is None:
        return store
    return _unleasing_unstored(ns, store, offer.hashes, turn.flat)


def _end_job(
    ns: Queueable,
    hashes: list[BlockHash],
    queued: QueuedEnd,
    skip_when_full: bool,
    released: list[object],
    live: Live | None,
) -> Callable[[], int]:
    """What the writer does for a queued end record (`hashes`: of its tokens). The
    job holds `released` (the leases its live lease replaced) and frees them on the
    writer's thread, not the caller's. A record not written (it failed, a full disk
    skipped it, or its blocks are not stored) takes its `live` lease with it, unless
    the same record is held already: no restore would find it."""
    leases = ns.bank.leases

    def write() -> int:
        try:
            wrote = write_end(ns.bank, ns.spec, ns.root, hashes, queued.end, place)
        except BaseException:
            if live is not None and leases is not None:
                leases.drop_live(queued.key, live)
            raise
        finally:
            released.clear()  # freed here, on the writer's thread
        if not wrote.stored and live is not None and leases is not None:
            leases.drop_live(queued.key, live)  # for want of its blocks
        return wrote.written

    header = queued.header
    place = (header.parent, header.tail, queued.key)
    return _skipping_full(write, skip_when_full, 0)


def _store_turn_now(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None,
    end: EndOf | None,
    skip_when_full: bool,
) -> tuple[PendingStore[StoreReport], PendingStore[int] | None]:
    """`store_turn_later` with no background writer: stored now, on this thread."""
    pending = _store_now(ns, tokens, layers, states, skip_when_full)
    if end is None:
        return pending, None
    args = (end.state, end.logits, end.hidden, skip_when_full)
    return pending, _end_now(ns, tokens, layers, *args)


def _store_now(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    states: Mapping[int, Sequence[Any]] | None,
    skip_when_full: bool,
) -> PendingStore[StoreReport]:
    """`store_later` with no background writer: stored now, on this thread."""
    done: PendingStore[StoreReport] = PendingStore()
    store = _skipping_full(
        lambda: ns.store(tokens, layers, states), skip_when_full, _NOTHING_STORED
    )
    done._set(store(), None)
    return done


def _unleasing_unstored(
    ns: Queueable,
    store: Callable[[], StoreReport],
    hashes: list[BlockHash],
    flat: list[mx.array],
) -> Callable[[], StoreReport]:
    """`store`, which (failed or skipped) then keeps leased only what the bank holds."""

    def write() -> StoreReport:
        # A store that failed or was skipped leases nothing the bank does not hold.
        try:
            report = store()
        except BaseException:
            _unlease_unstored(ns, hashes, flat)
            raise
        if report is _NOTHING_STORED:
            _unlease_unstored(ns, hashes, flat)
        return report

    return write


def _unlease_unstored(ns: Queueable, hashes: list[BlockHash], flat: list[mx.array]) -> None:
    """Keep leased only the leading blocks of `hashes` the bank holds (no states)."""
    ns._lease_stored(hashes, stored_prefix(ns.bank.store, hashes), flat, {})


def prepare_end_later(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    state: Sequence[Any] | None = None,
    *,
    logits: Any = None,
    hidden: Any = None,
    skip_when_full: bool = False,
    state_copied: bool = False,
) -> Callable[[], PendingStore[int]]:
    """`Namespace.prepare_end_later(tokens, layers, state, ...)` of `ns` (its docstring
    says what it does)."""
    writer = ns.bank.writer
    if writer is None or ns.bank.read_only:
        return lambda: _end_now(ns, tokens, layers, state, logits, hidden, skip_when_full)
    if writer.closed:
        raise RuntimeError(f"bank at {ns.bank.path} is closed")
    end = prepare_end(
        ns.spec,
        ns.block_size,
        tokens,
        layers,
        state,
        logits,
        hidden,
        copy=True,
        state_copied=state_copied,
    )
    hashes = ns.chain(end.tokens)
    # In the read view from the moment it is queued (`index.view`).
    queued = QueuedEnd(ns.root, hashes, end, ns.block_size)

    def submit() -> PendingStore[int]:
        # Leased first: nothing of this thread runs beside the writer once queued.
        released: list[object] = []
        live = ns._lease_live(hashes, end, layers, queued.key, released)
        job = _end_job(ns, hashes, queued, skip_when_full, released, live)
        try:
            return writer.submit(job, _nbytes, queued)
        except BaseException:  # not queued: nor leased
            if live is not None and ns.bank.leases is not None:
                ns.bank.leases.drop_live(queued.key, live)
            raise

    return submit


def _end_now(
    ns: Queueable,
    tokens: Any,
    layers: Sequence[Any],
    state: Sequence[Any] | None,
    logits: Any,
    hidden: Any,
    skip_when_full: bool,
) -> PendingStore[int]:
    """`store_end` now, on this thread (no background writer), as a `PendingStore`."""
    done: PendingStore[int] = PendingStore()
    store = _skipping_full(
        lambda: ns.store_end(tokens, layers, state, logits=logits, hidden=hidden),
        skip_when_full,
        0,
    )
    done._set(store(), None)
    return done
