"""`Namespace`: one model's view of a bank: store, match, restore.

A store's steps are in `cas_bank.write.storing`, a queued store's and its end record's
(`store_later`, `store_turn_later`, `prepare_end_later`) in `cas_bank.write.queued_turn`
and a restore's in `cas_bank.restore.restoring`: the methods here call them. Inline end
records, the leases of what was stored and lookups are here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from cas_bank.blocks.hashing import BlockHash, as_token_array, chain_hashes
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.evict.eviction import PinReport, pin_prefix, unpin_prefix
from cas_bank.index.chain import Header, longest_chain, plan_boundaries, read_headers, stored_prefix
from cas_bank.index.ends import EndInput, end_place, find_end, prepare_end
from cas_bank.index.lease import Live
from cas_bank.index.partial import find_partial
from cas_bank.index.view import ReadView, read_view
from cas_bank.restore import restoring
from cas_bank.restore.payloads import PayloadReader
from cas_bank.restore.restoring import Hit
from cas_bank.spec import ModelSpec, kind_of
from cas_bank.write import queued_turn, storing
from cas_bank.write.end_records import write_end
from cas_bank.write.queued_turn import EndOf as EndOf  # re-exported: its old home
from cas_bank.write.storing import StoreReport as StoreReport  # re-exported: its old home
from cas_bank.write.writer import PendingStore

if TYPE_CHECKING:
    from cas_bank.owner import Owner


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
        return queued_turn.store_turn_later(
            self,
            tokens,
            layers,
            states,
            end=end,
            skip_when_full=skip_when_full,
            checked=checked,
        )

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
        wrote = write_end(self.bank, self.spec, self.root, hashes, end, place)
        if wrote.stored:  # written, or held already (leased all the same, for the next turn)
            self._lease_live(hashes, end, layers, place[2])
        return wrote.written

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
        return queued_turn.prepare_end_later(
            self,
            tokens,
            layers,
            state,
            logits=logits,
            hidden=hidden,
            skip_when_full=skip_when_full,
            state_copied=state_copied,
        )

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
        return leases.put_live(
            key,
            full,
            layers,
            len(end.tokens),
            end.state,
            released,
            logits=end.logits,
            hidden=end.hidden,
        )

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
