"""`Namespace`: one model's view of a bank: store, match, restore.

A store's steps are in `cas_bank.write.storing` and a restore's in `cas_bank.restore.restoring`
(`Namespace.store` and `Namespace.restore` call them); background stores, end
records and lookups are here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import numpy as np

from cas_bank.blocks.hashing import BlockHash, as_token_array, chain_hashes
from cas_bank.blocks.store import Family
from cas_bank.errors import BankFullError, CorruptDataError
from cas_bank.evict.eviction import PinReport, pin_prefix, unpin_prefix
from cas_bank.index.chain import Header, longest_chain, plan_boundaries, read_headers, stored_prefix
from cas_bank.index.ends import EndInput, end_place, find_end, prepare_end
from cas_bank.index.partial import find_partial
from cas_bank.index.view import QueuedChain, QueuedEnd, ReadView, read_view
from cas_bank.restore import restoring
from cas_bank.restore.payloads import PayloadReader
from cas_bank.restore.restoring import Hit
from cas_bank.spec import (
    ModelSpec,
    boundary_states,
    check_layers,
    group_layers,
)
from cas_bank.write import storing
from cas_bank.write.end_records import write_end
from cas_bank.write.storing import StoreReport as StoreReport  # re-exported: its old home
from cas_bank.write.writer import PendingStore

log = logging.getLogger("cas_bank")

if TYPE_CHECKING:
    from cas_bank.owner import Owner


T = TypeVar("T")
_NOTHING_STORED = StoreReport(0, 0, 0, 0, 0, 0, 0, chain=[])


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
        writer = self.bank.writer
        if writer is None:
            return self._store_now(tokens, layers, states, skip_when_full)
        if self.bank.read_only:
            raise RuntimeError(f"bank at {self.bank.path} is open read-only: it cannot store")
        if writer.closed:  # as `store` says it: nobody would write this one
            raise RuntimeError(f"bank at {self.bank.path} is closed")
        toks = as_token_array(tokens)
        flat, kept = self._snapshot(toks, layers, states)
        snapshot = group_layers(self.spec, flat, None)
        by_layer = {b: group_layers(self.spec, None, st) for b, st in kept.items()}
        hashes = self.chain(toks)
        # In the read view until written (`index.view`), unless admission will write none.
        admitted = len(hashes) * self.block_size >= self.bank.config.admit_min_tokens
        queued = (
            QueuedChain(self.root, hashes, toks, self.block_size, flat, kept) if admitted else None
        )
        store = _skipping_full(
            lambda: self.store(toks, snapshot, by_layer), skip_when_full, _NOTHING_STORED
        )
        if self.bank.leases is None:
            return writer.submit(store, lambda report: report.bytes_written, queued)
        self.bank.leases.put_chain(hashes, flat, kept)
        write = self._unleasing_unstored(store, hashes, flat)
        try:
            return writer.submit(write, lambda report: report.bytes_written, queued)
        except BaseException:  # not queued (closed since, or interrupted): never written
            self.bank.leases.forget(hashes)
            raise

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

    def _snapshot(
        self, toks: np.ndarray, layers: Sequence[Any], states: Mapping[int, Sequence[Any]] | None
    ) -> tuple[list[mx.array], dict[int, list[mx.array]]]:
        """The input checked and evaluated, without a copy: the attention arrays flat (cut
        to the tokens) and the boundary states, as new array objects of our own."""
        n = len(toks)
        flat = [a[..., :n, :] for layer in check_layers(self.spec, layers, n) for a in layer]
        kept = {
            b: [a.reshape(a.shape) for a in st]  # new objects: the caller's are not ours
            for b, st in boundary_states(self.spec, states, n, self.block_size).items()
        }
        mx.eval(flat, list(kept.values()))
        return flat, kept

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
        written = write_end(self.bank, self.spec, self.root, hashes, end)
        self._lease_live(hashes, end, layers)
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
        before it (their blocks are its parents); the arrays are copied now.
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
    ) -> Callable[[], PendingStore[int]]:
        """`store_end_later` in two steps: the input is checked and copied now, and the
        function returned queues it (in the read view from then on, as `store_later`'s
        blocks; if queueing raises, not in it) or, with no writer, writes it. A runtime
        storing a prompt's blocks and its end record prepares the end first, then queues
        both: nothing of its own then runs while the writer works on the blocks."""
        writer = self.bank.writer
        if writer is None or self.bank.read_only:

            def now() -> PendingStore[int]:
                done: PendingStore[int] = PendingStore()
                store = _skipping_full(
                    lambda: self.store_end(tokens, layers, state, logits=logits, hidden=hidden),
                    skip_when_full,
                    0,
                )
                done._set(store(), None)
                return done

            return now
        if writer.closed:
            raise RuntimeError(f"bank at {self.bank.path} is closed")
        end = prepare_end(
            self.spec, self.block_size, tokens, layers, state, logits, hidden, copy=True
        )
        hashes = self.chain(end.tokens)
        job = _skipping_full(
            lambda: write_end(self.bank, self.spec, self.root, hashes, end), skip_when_full, 0
        )
        # In the read view from the moment it is queued (`index.view`).
        queued = QueuedEnd(self.root, hashes, end, self.block_size)

        def submit() -> PendingStore[int]:
            pending = writer.submit(job, lambda nbytes: nbytes, queued)
            self._lease_live(hashes, end, layers)
            return pending

        return submit

    def _lease_live(self, hashes: list[BlockHash], end: EndInput, layers: Sequence[Any]) -> None:
        """Keep the caller's own arrays (`layers`, whole buffers and all) as the live
        lease of the end record of `end.tokens` (`index.lease`): the next turn of the
        conversation takes them back without a copy, once a restore finds that record."""
        leases = self.bank.leases
        if leases is None:
            return
        key = end_place(self.root, hashes, end.tokens, self.block_size)[2]
        kept = [None if layer is None else tuple(layer) for layer in layers]
        full = hashes[: len(end.tokens) // self.block_size]
        leases.put_live(key, full, kept, len(end.tokens), end.state)

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
