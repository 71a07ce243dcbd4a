"""`Namespace`: one model's view of a bank: store, match, restore.

A store's steps are in `cas_bank.write.storing` and a restore's in `cas_bank.restore.restoring`
(`Namespace.store` and `Namespace.restore` call them); background stores, end
records and lookups are here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx

from cas_bank.blocks.hashing import BlockHash, as_token_array, chain_hashes
from cas_bank.blocks.store import Family
from cas_bank.errors import BankFullError, CorruptDataError
from cas_bank.evict.eviction import PinReport, pin_prefix, unpin_prefix
from cas_bank.index.chain import Header, longest_chain, plan_boundaries, read_headers, stored_prefix
from cas_bank.index.ends import EndInput, end_place, find_end, prepare_end
from cas_bank.index.lease import Live
from cas_bank.index.partial import find_partial
from cas_bank.index.view import QueuedChain, QueuedEnd, ReadView, read_view
from cas_bank.restore import restoring
from cas_bank.restore.payloads import PayloadReader
from cas_bank.restore.restoring import Hit
from cas_bank.spec import LayerKind, ModelSpec, boundary_states, check_layers, kind_of
from cas_bank.write import storing
from cas_bank.write.end_records import write_end
from cas_bank.write.storing import StoreReport as StoreReport  # re-exported: its old home
from cas_bank.write.writer import PendingStore

log = logging.getLogger("cas_bank")

if TYPE_CHECKING:
    from cas_bank.owner import Owner


T = TypeVar("T")
_NOTHING_STORED = StoreReport(0, 0, 0, 0, 0, 0, 0, chain=[])


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


class Namespace:
    """The blocks of one model (one `ModelSpec`) in a bank."""

    def __init__(self, bank: Owner, spec: ModelSpec, root: bytes) -> None:
        self.bank = bank
        self.spec = spec
        self.root = root
        self._payloads = PayloadReader(
            spec,
            bank.store,
            bank.hot,
            bank.counters,
            bank.suspects,
            bank.files,
            resources=bank.resources,
        )
        self.block_size = bank.config.block_size
        # The layers stored per block and their kinds (`spec.kind_of`), found once.
        self.block_kinds = [(i, kind_of(ls)) for i, ls in enumerate(spec.layers) if ls.per_block]

    def chain(self, tokens: Any) -> list[BlockHash]:
        """Chain hashes of the full blocks of `tokens` (validates the ids)."""
        return chain_hashes(self.root, tokens, self.block_size)

    # -- store ---------------------------------------------------------------------
    def store(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None = None,
    ) -> StoreReport:
        """Store the full blocks of `tokens` and the given boundary states.

        Blocks already present are not written again. Everything new goes in one
        atomic batch. Bad input raises `InvalidInputError` before anything is written.
        (The steps: `cas_bank.write.storing`.)
        """
        return storing.store(self, tokens, layers, states)

    def _lease_stored(
        self,
        hashes: list[BlockHash],
        kept: int,
        flat: list[mx.array],
        states: Mapping[int, Sequence[mx.array]],
    ) -> None:
        """Lease the stored part `hashes[:kept]` of a chain just stored, and drop the rest
        from the leases (`store_later` leased it all when it queued the store): a block
        admission left out, or that eviction took since, is never handed out."""
        leases = self.bank.leases
        assert leases is not None
        with self.bank.write_lock:  # evictions hold it: what is checked here stays true
            if kept and self.bank.store.get(Family.HEADERS, hashes[kept - 1]) is None:
                leases.forget(hashes[kept - 1 :])  # evicted right after (the budget)
                return
            if kept < len(hashes):
                leases.forget(hashes[kept:])
            leases.put_chain(hashes[:kept], flat, states)

    def store_later(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None = None,
        *,
        skip_when_full: bool = False,
    ) -> PendingStore[StoreReport]:
        """`store`, written by the bank's background writer (`BankConfig.write_behind`
        stores may wait; 0: written now, on this thread).

        On this thread: the input is checked (bad input raises here, nothing is queued)
        and the arrays are snapshotted without a copy (see `write.writer`), queued in the
        bank's read view (`index.view`: every lookup right after sees the blocks and
        states, from memory, until the write commits or fails) and leased (kept in
        memory after the write too, within `hot_bytes`). `Bank.flush()` waits for the
        writer. If queueing fails (the bank closed meanwhile, or a `KeyboardInterrupt`
        while the queue is full), it raises with the store out of the view and unleased.
        `skip_when_full`: a full disk (`BankFullError`) skips the store with a warning
        (its report says nothing was written) instead of failing it.
        """
        return self.store_turn_later(tokens, layers, states, skip_when_full=skip_when_full)[0]

    def store_turn_later(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None = None,
        *,
        end: EndOf | None = None,
        skip_when_full: bool = False,
        checked: bool = False,
    ) -> tuple[PendingStore[StoreReport], PendingStore[int] | None]:
        """`store_later`, and with `end` the end record of the same `tokens` (a turn of
        a conversation: `store_end_later`, the caller's arrays kept as its live lease).
        The input is checked, hashed and snapshotted once for both, everything is in the
        read view and leased before either is queued, and both are queued last, back to
        back: nothing of this thread runs beside the writer once it has work. Returns
        the store's `PendingStore` and the end record's (None without `end`).

        `checked`: `layers` are a cache this namespace's model has just written, and the
        caller checked it (`PrefixCache.prefill` checks its cache before the forward
        pass): its arrays are not checked against the spec again (~2 us an array)."""
        writer = self.bank.writer
        if writer is None:
            return self._store_turn_now(tokens, layers, states, end, skip_when_full)
        if self.bank.read_only:
            raise RuntimeError(f"bank at {self.bank.path} is open read-only: it cannot store")
        if writer.closed:  # as `store` says it: nobody would write this one
            raise RuntimeError(f"bank at {self.bank.path} is closed")
        turn = self._turn(tokens, layers, states, end, checked)
        live = self._lease_turn(turn, layers)
        try:
            pending = writer.submit(
                self._chain_job(turn, skip_when_full), _bytes_written, turn.queued_chain
            )
        except BaseException:  # not queued (closed since, or interrupted): never written
            self._unlease_turn(turn, live, chain=True)
            raise
        if turn.queued_end is None:
            return pending, None
        try:
            job = self._end_job(
                turn.offer.hashes, turn.queued_end, skip_when_full, turn.released, live
            )
            end_pending = writer.submit(job, _nbytes, turn.queued_end)
        except BaseException:
            self._unlease_turn(turn, live, chain=False)
            raise
        return pending, end_pending

    def _turn(
        self,
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
            snapshot = _own_layers(self.block_kinds, layers)
        else:
            snapshot = [[_own(a) for a in layer] for layer in check_layers(self.spec, layers, n)]
        hashes = self.chain(toks)
        flat = [a for layer in snapshot for a in layer]
        kept = {  # new objects: the caller's are not ours
            b: [_own(a) for a in st]
            for b, st in boundary_states(self.spec, states, n, self.block_size).items()
        }
        mx.eval(flat, list(kept.values()))
        offer = storing.Offer(toks, snapshot, kept, hashes)
        # In the read view until written (`index.view`), unless admission will write none.
        admitted = len(hashes) * self.block_size >= self.bank.config.admit_min_tokens
        chain = None
        if admitted:
            chain = QueuedChain(self.root, hashes, toks, self.block_size, flat, kept)
        if end is None:
            return _Turn(offer, flat, chain, None)
        record = prepare_end(
            self.spec,
            self.block_size,
            toks,
            layers,
            end.state,
            end.logits,
            end.hidden,
            copy=True,
            checked=snapshot,
            state_copied=end.state_copied,
        )
        return _Turn(offer, flat, chain, QueuedEnd(self.root, hashes, record, self.block_size))

    def _lease_turn(self, turn: _Turn, layers: Sequence[Any]) -> Live | None:
        """Lease a queued turn: the caller's cache as the live lease of its end record
        (which is also the lease of its blocks), else its blocks; its states. The live
        lease kept, if one was."""
        leases = self.bank.leases
        if leases is None:
            return None
        offer, end = turn.offer, turn.queued_end
        live = None
        if end is not None:
            live = self._lease_live(offer.hashes, end.end, layers, end.key, turn.released)
        if live is None:
            leases.put(offer.hashes, turn.flat)
        leases.put_states(offer.hashes, offer.states)
        return live

    def _unlease_turn(self, turn: _Turn, live: Live | None, *, chain: bool) -> None:
        """Undo `_lease_turn` of a turn not queued (`chain`: nor its blocks)."""
        leases = self.bank.leases
        if leases is None:
            return
        if chain:
            leases.forget(turn.offer.hashes)
        if live is not None and turn.queued_end is not None:
            leases.drop_live(turn.queued_end.key, live)

    def _chain_job(self, turn: _Turn, skip_when_full: bool) -> Callable[[], StoreReport]:
        """What the writer does for a queued turn's blocks: they are stored, and only what
        the bank then holds stays leased."""
        offer = turn.offer
        store = _skipping_full(
            lambda: storing.store_offer(self, offer), skip_when_full, _NOTHING_STORED
        )
        if self.bank.leases is None:
            return store
        return self._unleasing_unstored(store, offer.hashes, turn.flat)

    def _end_job(
        self,
        hashes: list[BlockHash],
        queued: QueuedEnd,
        skip_when_full: bool,
        released: list[object],
        live: Live | None,
    ) -> Callable[[], int]:
        """What the writer does for a queued end record (`hashes`: of its tokens). The
        job holds `released` (the leases its live lease replaced) and frees them on the
        writer's thread, not the caller's. A record not written (it failed, or a full
        disk skipped it) takes its `live` lease with it: no restore would find it."""
        leases = self.bank.leases

        def write() -> int:
            try:
                return write_end(self.bank, self.spec, self.root, hashes, queued.end, place)
            except BaseException:
                if live is not None and leases is not None:
                    leases.drop_live(queued.key, live)
                raise
            finally:
                released.clear()  # freed here, on the writer's thread

        header = queued.header
        place = (header.parent, header.tail, queued.key)
        return _skipping_full(write, skip_when_full, 0)

    def _store_turn_now(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None,
        end: EndOf | None,
        skip_when_full: bool,
    ) -> tuple[PendingStore[StoreReport], PendingStore[int] | None]:
        """`store_turn_later` with no background writer: stored now, on this thread."""
        pending = self._store_now(tokens, layers, states, skip_when_full)
        if end is None:
            return pending, None
        args = (end.state, end.logits, end.hidden, skip_when_full)
        return pending, self._end_now(tokens, layers, *args)

    def _store_now(
        self,
        tokens: Any,
        layers: Sequence[Any],
        states: Mapping[int, Sequence[Any]] | None,
        skip_when_full: bool,
    ) -> PendingStore[StoreReport]:
        """`store_later` with no background writer: stored now, on this thread."""
        done: PendingStore[StoreReport] = PendingStore()
        store = _skipping_full(
            lambda: self.store(tokens, layers, states), skip_when_full, _NOTHING_STORED
        )
        done._set(store(), None)
        return done

    def _unleasing_unstored(
        self, store: Callable[[], StoreReport], hashes: list[BlockHash], flat: list[mx.array]
    ) -> Callable[[], StoreReport]:
        """`store`, which (failed or skipped) then keeps leased only what the bank holds."""

        def write() -> StoreReport:
            # A store that failed or was skipped leases nothing the bank does not hold.
            try:
                report = store()
            except BaseException:
                self._unlease_unstored(hashes, flat)
                raise
            if report is _NOTHING_STORED:
                self._unlease_unstored(hashes, flat)
            return report

        return write

    def _unlease_unstored(self, hashes: list[BlockHash], flat: list[mx.array]) -> None:
        """Keep leased only the leading blocks of `hashes` the bank holds (no states)."""
        self._lease_stored(hashes, stored_prefix(self.bank.store, hashes), flat, {})

    def store_end(
        self,
        tokens: Any,
        layers: Sequence[Any],
        state: Sequence[Any] | None = None,
        *,
        logits: Any = None,
        hidden: Any = None,
    ) -> int:
        """Store the end record of `tokens` (docs/design.md, "End records"): the KV of its
        partial last block (`layers` as for `store`, holding at least the tokens), the
        recurrent layers' `state` at exactly `len(tokens)` (required for a hybrid model;
        per-layer, None for attention layers), and optionally the `logits` of the last
        token and a `hidden` state. Its full blocks must be stored already (`store`
        first); else nothing is written. Returns the bytes written (0: nothing new).
        """
        if self.bank.read_only:
            raise RuntimeError(f"bank at {self.bank.path} is open read-only: it cannot store")
        end = prepare_end(self.spec, self.block_size, tokens, layers, state, logits, hidden)
        hashes = self.chain(end.tokens)
        place = end_place(self.root, hashes, end.tokens, self.block_size)
        written = write_end(self.bank, self.spec, self.root, hashes, end, place)
        self._lease_live(hashes, end, layers, place[2])
        return written

    def store_end_later(
        self,
        tokens: Any,
        layers: Sequence[Any],
        state: Sequence[Any] | None = None,
        *,
        logits: Any = None,
        hidden: Any = None,
        skip_when_full: bool = False,
    ) -> PendingStore[int]:
        """`store_end` through the bank's background writer, after the stores queued
        before it (their blocks are its parents); the input is checked and snapshotted
        now (`prepare_end_later`).
        `skip_when_full` as for `store_later` (0 bytes written)."""
        return self.prepare_end_later(
            tokens, layers, state, logits=logits, hidden=hidden, skip_when_full=skip_when_full
        )()

    def prepare_end_later(
        self,
        tokens: Any,
        layers: Sequence[Any],
        state: Sequence[Any] | None = None,
        *,
        logits: Any = None,
        hidden: Any = None,
        skip_when_full: bool = False,
        state_copied: bool = False,
    ) -> Callable[[], PendingStore[int]]:
        """`store_end_later` in two steps: the input is checked and snapshotted now (new
        objects over the attention arrays, the state copied unless `state_copied`), and the
        function returned queues it (in the read view from then on, as `store_later`'s
        blocks; if queueing raises, not in it) or, with no writer, writes it. (A store
        of a prompt's blocks and its end record together: `store_turn_later`.)
        `state_copied`: `state` is the caller's own snapshot, taken for this record."""
        writer = self.bank.writer
        if writer is None or self.bank.read_only:
            return lambda: self._end_now(tokens, layers, state, logits, hidden, skip_when_full)
        if writer.closed:
            raise RuntimeError(f"bank at {self.bank.path} is closed")
        end = prepare_end(
            self.spec,
            self.block_size,
            tokens,
            layers,
            state,
            logits,
            hidden,
            copy=True,
            state_copied=state_copied,
        )
        hashes = self.chain(end.tokens)
        # In the read view from the moment it is queued (`index.view`).
        queued = QueuedEnd(self.root, hashes, end, self.block_size)

        def submit() -> PendingStore[int]:
            # Leased first: nothing of this thread runs beside the writer once queued.
            released: list[object] = []
            live = self._lease_live(hashes, end, layers, queued.key, released)
            job = self._end_job(hashes, queued, skip_when_full, released, live)
            try:
                return writer.submit(job, _nbytes, queued)
            except BaseException:  # not queued: nor leased
                if live is not None and self.bank.leases is not None:
                    self.bank.leases.drop_live(queued.key, live)
                raise

        return submit

    def _end_now(
        self,
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
            lambda: self.store_end(tokens, layers, state, logits=logits, hidden=hidden),
            skip_when_full,
            0,
        )
        done._set(store(), None)
        return done

    def _lease_live(
        self,
        hashes: list[BlockHash],
        end: EndInput,
        layers: Sequence[Any],
        key: bytes,
        released: list[object] | None = None,
    ) -> Live | None:
        """Keep the caller's own arrays (`layers`, whole buffers and all) as the live
        lease of the end record of `end.tokens` under `key` (`index.lease`): the next
        turn of the conversation takes them back without a copy, once a restore finds
        that record. The live lease kept (None: none)."""
        leases = self.bank.leases
        if leases is None:
            return None
        full = hashes[: len(end.tokens) // self.block_size]
        return leases.put_live(key, full, layers, len(end.tokens), end.state, released)

    # -- pins ----------------------------------------------------------------------
    def pin(self, tokens: Any) -> PinReport:
        """Keep the stored prefix `tokens` (a system prompt, say) through every eviction:
        its blocks, their states and its end record with those beside it, until `unpin`.
        Queued stores are written first; every full block must then be stored. Pins
        count against `max_bytes`: one that would take them past `pin_share` of it is
        refused (`InvalidInputError`, with the numbers). Survives restarts
        (`evict.pins`)."""
        toks = as_token_array(tokens)
        if self.bank.writer is not None:
            self.bank.writer.flush()
        config = self.bank.config
        return pin_prefix(
            self.bank,
            self.root,
            toks,
            self.chain(toks),
            block_size=self.block_size,
            max_bytes=config.max_bytes,
            share=config.pin_share,
        )

    def unpin(self, tokens: Any) -> bool:
        """Let the pin of `tokens` go (False if there was none): evicted as any other
        prefix from now on."""
        return unpin_prefix(self.bank, self.root, as_token_array(tokens))

    # -- lookup --------------------------------------------------------------------
    def view(self) -> ReadView:
        """The bank as a lookup sees it now: queued stores in front of written ones
        (`index.view`)."""
        return read_view(self.bank)

    def matched(self, tokens: Any) -> list[Header]:
        """Headers of the longest chain accepted (written or queued) that prefixes
        `tokens` (no payload reads; a queued block's digests are placeholders)."""
        return longest_chain(self.view(), self.root, self.chain(tokens))

    def match(self, tokens: Any) -> int:
        """Tokens a restore would cover, without reading payloads: what the bank has
        accepted, queued for its background writer or written (`index.view`).

        Reads only what it needs: the chain's stored length by binary search and, for a
        hybrid model, headers from its end back to the deepest one with a state; for an
        attention-only model, the partial block after it (one seek and its header).
        """
        toks = as_token_array(tokens)
        hashes = self.chain(toks)
        view = self.view()
        stored = stored_prefix(view, hashes)
        try:  # an end record under the deepest stored block (no payload is decoded)
            found = find_end(view, self.root, hashes, toks, stored, self.block_size)
        except CorruptDataError:
            found = None
        at_end = found.header.n_tokens if found is not None else 0
        partial = 0
        if not self.spec.is_hybrid and self.bank.config.partial_blocks:  # index.partial
            part = find_partial(view, self.root, hashes, toks, stored, self.block_size)
            partial = part.tokens if part is not None else 0
        return max(at_end, partial, self._chain_match(view, hashes, stored))

    def _chain_match(self, view: ReadView, hashes: list[BlockHash], end: int) -> int:
        if not self.spec.is_hybrid:
            return end * self.block_size
        window = 8  # states sit near chain ends (the policy puts them there)
        while end > 0:
            lo = max(0, end - window)
            headers = read_headers(view, hashes[lo:end])
            for i in range(end - lo - 1, -1, -1):
                header = headers[i]
                if header is not None and header.has_state:
                    return (lo + i + 1) * self.block_size
            end = lo
        return 0

    def plan_states(
        self,
        tokens: Any,
        start: int,
        stride: int | None = None,
        hints: Sequence[int] | None = (),
    ) -> list[int]:
        """Boundaries where a prefill of `tokens` from `start` should capture states.

        `hints`: token positions where later prompts are likely to branch (e.g. the end
        of a system prompt; None: none). Empty for attention-only models. See
        `index.chain`.
        """
        if not self.spec.is_hybrid:
            return []
        hints = () if hints is None else hints
        toks = as_token_array(tokens)
        matched = self.matched(toks)
        return plan_boundaries(
            len(toks),
            self.block_size,
            start=start,
            matched_blocks=len(matched),
            stored_states={h.end for h in matched if h.has_state},
            stride=stride if stride is not None else self.bank.config.state_stride,
            hints=hints,
        )

    # -- restore -------------------------------------------------------------------
    def restore(self, tokens: Any, *, room_for: int = 0) -> Hit | None:
        """The longest stored prefix of `tokens` as MLX arrays, or None on a miss.

        `room_for`: the tokens the caller's cache will hold in all (its prompt's
        length). Attention arrays then come with room for them, rounded up to mlx-lm's
        step of 256 (`Hit.tokens` of them hold the prefix, the rest is undefined), so
        that prefilling the rest writes in place instead of copying the restored
        cache. 0: arrays of exactly `Hit.tokens` tokens.

        A payload that fails its digest ends the restore before it (counted as a
        corrupt read, never raised); a hybrid restore then steps back to the deepest
        boundary below it that has an intact state.
        """
        hit = restoring.restore(self, tokens, room_for=room_for)
        self.bank.counters.root_hit(self.root, hit.tokens if hit is not None else 0)
        return hit
