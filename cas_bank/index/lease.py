"""Leases: prefixes stored (or restored) in this process, kept as MLX arrays and handed
out again without a copy.

MLX arrays are values: a slice shares its buffer, and an in-place update of an
array (mlx-lm's `cache.keys[..., a:b, :] = k`) writes into its buffer only when
nothing else holds that buffer; otherwise it copies first. So the bank may keep a
cache's buffer (new array objects over it, whole: a slice would cost an evaluation)
and hand out slices of it: whatever a runtime later does
to its cache (prefill, decode, trim then overwrite) copies before it writes, and the
bank's bytes never change (tests/test_lease.py shows it). The price is paid once, by
the cache: its next update after a store copies the buffer it shares with the bank.
A restore that asks for room after the prefix (a runtime's, which prefills next) gets
a copy into buffers of its own instead (`cas_bank.restore.restoring`): made on two cores, where
mlx-lm's first update would make it on one.

Entries are chains: block i of an entry is the block named `hashes[i]`, and a chain
hash names its whole prefix, so an entry that holds block k of a prompt holds blocks
0..k as well. A restore probes once: the deepest of its matched blocks that some
entry holds. A hybrid model's recurrent state at a boundary is leased the same way,
by the chain hash of the block that ends there (`put_state`, `state`), and an end
record's decoded arrays by its key and payload digest (`put_end`, `end`): a restore
of the same end again decodes, checks and copies none of its payload (a hybrid model's
record holds its recurrent state, ~5 MB for the medium one at 1k tokens); it reads the
record still (the hot tier's copy, or RocksDB's), for the digest its header claims, so
a record damaged since under an intact header restores its leased arrays. Bounded by
bytes (the buffers held, chains and states together), least recently used first out:
the bank's leases share one budget with its hot tier (`blocks.hot.MemoryBudget`,
`BankConfig.hot_bytes`), so the two together stay within it.

A live lease (`put_live`, `take_live`) is a conversation's cache as its runtime left
it: every layer's whole buffers (room included) at the exact end of what it stored,
with a hybrid model's recurrent state there, under the key of that end's record. The
next turn of the conversation takes it whole (the seed's live-reference lease): no
byte is copied, and once the lease has let go of it (a take removes it, with any
lease of whole blocks over the same buffers), the new cache is the buffers' only
holder, so mlx-lm's next update writes into them in place. Where anything else
still holds them (the runtime's own cache object, a restore handed the same
blocks), MLX copies before it writes: two requests never see each other's tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count, repeat
from operator import attrgetter
from typing import Any

import mlx.core as mx
import numpy as np

from cas_bank.arrays import HeldArrays
from cas_bank.blocks.hot import MemoryBudget
from cas_bank.index.ends import EndPayload

_NBYTES = attrgetter("nbytes")  # an array's bytes, read by a C-level map


@dataclass(slots=True)
class _Entry:
    hashes: list[bytes]  # empty for a state
    arrays: HeldArrays  # flat attention arrays, each holding len(hashes) blocks
    nbytes: int
    tick: int = 0  # the budget's clock at its last use (`blocks.hot.MemoryBudget`)
    live: Live | None = None  # a live lease's cache (`put_live`)
    end: tuple[bytes, EndPayload] | None = None  # an end record's: (payload digest, arrays)


@dataclass(frozen=True, slots=True)
class Live:
    """A live lease taken (`Leases.take_live`): per layer, the cache's whole arrays (new
    objects over its buffers; None for a recurrent layer), the tokens they hold, the
    recurrent state at exactly that end (flat, None without recurrent layers), and the
    last token's logits and hidden state the same store was given (None if not). A
    restore hands out these, not the record's: a record kept from another store of
    the same tokens (its write found it held) may hold other numerics."""

    layers: list[tuple[mx.array, ...] | None]
    tokens: int
    state: list[mx.array] | None
    logits: mx.array | None = None
    hidden: mx.array | None = None


def _live_key(end_key: bytes) -> bytes:
    """A live lease's entry key: never a chain's nor a state's."""
    return b"l" + bytes(end_key)


def _end_entry_key(end_key: bytes) -> bytes:
    """An end record's entry key: never a chain's, a state's nor a live lease's."""
    return b"e" + bytes(end_key)


def _buffers(entry: _Entry) -> set[int]:
    """Where the buffers of a live lease's arrays begin (a chain's lease over them
    begins where they do: its arrays are their first tokens)."""
    return {int(a) for a in entry.arrays.addresses()}


def _state_key(chain_hash: bytes) -> bytes:
    """A state's entry key: never a chain's (those are 32-byte chain hashes)."""
    return b"s" + bytes(chain_hash)


class Leases:
    """At most `max_bytes` of recently used chains' arrays, by chain hash. `budget`: a
    `MemoryBudget` of `max_bytes` shared with the hot tier; its own by default."""

    def __init__(
        self, max_bytes: int, block_size: int, *, budget: MemoryBudget | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.budget = budget if budget is not None else MemoryBudget(max_bytes)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # by last chain hash
        self._blocks: dict[bytes, tuple[bytes, int]] = {}  # chain hash -> (entry, index)
        self._bytes = 0
        self._lock = threading.Lock()
        self.budget.join(self)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def put(self, hashes: Sequence[bytes], arrays: Sequence[mx.array]) -> None:
        """Keep `arrays` (each holding at least `len(hashes)` blocks on axis -2) as the
        chain `hashes`: new objects over the same buffers (no copy), evaluated here.
        Whoever reads them slices them to the blocks it takes (`probe`)."""
        if not hashes or self.max_bytes <= 0:
            return
        last = bytes(hashes[-1])
        if self._used(last, len(hashes) - 1):
            return  # already leased (a live lease of the same cache, say): just used
        # New array objects over the whole buffers (no slice: one would have to be
        # evaluated, ~8 us an array): an in-place update rebinds the object it is
        # applied to, so the bank must not hold the very objects the cache holds, nor
        # hand out its own; and a cache never writes into a buffer the bank shares.
        kept = [_view(a) for a in arrays]
        mx.eval(kept)
        # Charged for the whole buffers they keep alive (a padded cache buffer too).
        nbytes = sum(map(_NBYTES, kept))
        if not self.budget.fits(nbytes):
            return
        with self._lock:
            if self._used(last, len(hashes) - 1, locked=True):
                return
            self._insert(last, _Entry([bytes(h) for h in hashes], HeldArrays(kept), nbytes))
        self.budget.balance()

    def _used(self, last: bytes, index: int, *, locked: bool = False) -> bool:
        """Whether block `last` is leased at `index` of its chain (then it was used now)."""
        if not locked:
            with self._lock:
                return self._used(last, index, locked=True)
        held = self._blocks.get(last)
        if held is None or held[1] != index or held[0] not in self._entries:
            return False
        self._use(held[0])
        return True

    def put_chain(
        self,
        hashes: Sequence[bytes],
        arrays: Sequence[mx.array],
        states: Mapping[int, Sequence[mx.array]],
    ) -> None:
        """`put` of a stored chain and `put_states` of its boundary states."""
        self.put(hashes, arrays)
        self.put_states(hashes, states)

    def put_states(self, hashes: Sequence[bytes], states: Mapping[int, Sequence[mx.array]]) -> None:
        """`put_state` of a chain's boundary states (by token position, a multiple of
        the block size)."""
        for boundary, state in states.items():
            self.put_state(hashes[boundary // self.block_size - 1], state)

    def probe(self, hashes: Sequence[bytes]) -> tuple[int, HeldArrays]:
        """(k, arrays): the leased arrays of the deepest block k-1 of the chain `hashes`
        that an entry holds; (0, no arrays) if none. The arrays are the bank's own and may
        hold more than k blocks: a caller slices them to its tokens before it hands
        anything out (a new object: the cache must never hold the bank's), as every
        restore path does anyway; slicing and evaluating 24-48 of them here cost a hot
        restore ~0.1 ms for views a copy never used. A copy takes their numpy views
        (`HeldArrays.numpy_views`), made once per entry.

        A binary search: the blocks an entry holds are a prefix of every chain that
        reaches them, so "block i is held" only turns false going deeper.
        """
        with self._lock:
            if not self._blocks or not hashes:
                return 0, HeldArrays(())
            lo, hi = 0, len(hashes)  # blocks below lo are held; from hi on, not
            if hashes[-1] in self._blocks:
                lo = hi
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] in self._blocks:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == 0:
                return 0, HeldArrays(())
            last, index = self._blocks[hashes[lo - 1]]
            entry = self._entries[last]
            self._use(last)
        assert index == lo - 1, "a chain hash names its position"
        return lo, entry.arrays

    def put_state(self, chain_hash: bytes, arrays: Sequence[mx.array]) -> None:
        """Keep the recurrent state (flat arrays) at the end of block `chain_hash`."""
        if self.max_bytes <= 0:
            return
        kept = [a.reshape(a.shape) for a in arrays]  # new objects, the same buffers
        mx.eval(kept)
        nbytes = sum(map(_NBYTES, kept))
        if not self.budget.fits(nbytes):
            return
        with self._lock:
            self._insert(_state_key(chain_hash), _Entry([], HeldArrays(kept), nbytes))
        self.budget.balance()

    def has_state(self, chain_hash: bytes) -> bool:
        """Whether a state at the end of block `chain_hash` is leased now."""
        with self._lock:
            return _state_key(chain_hash) in self._entries

    def state(self, chain_hash: bytes) -> list[mx.array] | None:
        """The leased state at the end of block `chain_hash` (new array objects sharing
        the leased buffers), or None."""
        key = _state_key(chain_hash)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._use(key)
        out = [a.reshape(a.shape) for a in entry.arrays]
        mx.eval(out)
        return out

    def put_end(self, end_key: bytes, digest: bytes, payload: EndPayload) -> None:
        """Keep the decoded arrays of the end record `end_key` whose payload has digest
        `digest` (checked when it was decoded). Its tail is copied out of the record's
        bytes (a view would hold the whole record, state and all)."""
        if self.max_bytes <= 0:
            return
        tail = [np.array(t) for t in payload.tail]
        for t in tail:
            t.flags.writeable = False
        kept = payload.over_same_buffers(tail)
        arrays = kept.mlx_arrays()
        nbytes = sum(map(_NBYTES, arrays)) + sum(t.nbytes for t in tail)
        if not self.budget.fits(nbytes):
            return
        entry = _Entry([], HeldArrays(arrays), nbytes, end=(bytes(digest), kept))
        with self._lock:
            self._insert(_end_entry_key(end_key), entry)
        self.budget.balance()

    def end(self, end_key: bytes, digest: bytes) -> EndPayload | None:
        """The decoded arrays of the end record `end_key` if they are leased for a
        payload of digest `digest` (a record rewritten since has another digest): the
        MLX arrays as new objects on the leased buffers, the tail as read-only numpy
        arrays. None if not."""
        key = _end_entry_key(end_key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.end is None or entry.end[0] != digest:
                return None
            self._use(key)
        return entry.end[1].over_same_buffers()

    def put_live(
        self,
        end_key: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[tuple[mx.array, ...] | None],
        tokens: int,
        state: Sequence[mx.array] | None,
        released: list[object] | None = None,
        *,
        logits: mx.array | None = None,
        hidden: mx.array | None = None,
    ) -> Live | None:
        """Keep a conversation's cache (`layers`: per layer its whole arrays, None for a
        recurrent one; `state`: the recurrent state, flat; `logits`, `hidden`: its last
        token's, if stored, copied) holding `tokens` tokens, as the live lease of the end
        record `end_key`. New array objects over the same buffers: no copy, and the
        runtime's objects are never the bank's. The entry is also the lease of its whole
        blocks (`hashes`), in place of one over the same buffers: the memory is charged
        once. The live lease kept (None: over the budget, or no attention layer).

        `released`: where the live lease this one replaces goes once out of the leases
        (uncharged at once), so that its buffers are freed by whoever lets go of that
        list: a queued store's job, off this thread (~15 us, the buffers and the copy
        plans made from them, of a store a prefill's caller waits for)."""
        if self.max_bytes <= 0:
            return None
        kept: list[tuple[mx.array, ...] | None] = []
        flat: list[mx.array] = []
        for layer in layers:  # one pass: this runs before a prefill returns its logits
            views = None if layer is None else tuple([_view(a) for a in layer])
            kept.append(views)
            if views is not None:
                flat.extend(_flat(views))
        flat_state = [a.reshape(a.shape) for a in state] if state is not None else None
        # Copies of their own: the last token's logits are mostly a slice of a whole
        # chunk's (512 x a 152k vocabulary: ~150 MB a slice would keep alive, uncounted).
        logits, hidden = (None if a is None else mx.contiguous(a) for a in (logits, hidden))
        extras = [a for a in (logits, hidden) if a is not None]
        mx.eval(flat, flat_state or [], extras)
        nbytes = sum(map(_NBYTES, [*flat, *(flat_state or []), *extras]))
        if not flat or not self.budget.fits(nbytes):
            return None  # no attention layer: nothing a copy would cost (the state is leased)
        entry = _Entry(list(map(bytes, hashes)), HeldArrays(flat), nbytes)
        entry.live = live = Live(kept, tokens, flat_state, logits, hidden)
        key = _live_key(end_key)
        with self._lock:
            self._drop_over(entry, lives=False)
            replaced = self._entries.get(key)
            self._insert(key, entry)
        if released is not None and replaced is not None:
            released.append(replaced)
        self.budget.balance()
        return live

    def drop_live(self, end_key: bytes, live: Live | None = None) -> None:
        """Let the live lease of the end record `end_key` go (its store was not queued,
        or failed: no restore finds that record); with `live`, only if it is that one
        (`put_live`'s: a later store of the same end may have replaced it)."""
        key = _live_key(end_key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and (live is None or entry.live is live):
                self._drop(key)

    def take_live(
        self, end_key: bytes, tokens: int, *, logits: bool = False, hidden: bool = False
    ) -> Live | None:
        """The live lease of the end record `end_key` if it holds exactly `tokens`
        tokens (and the last token's `logits` and `hidden` state, where those are asked
        for), removed from the leases with every other lease over the same buffers
        (whole blocks, another end of the same cache), so that the taker holds them
        alone; None if there is none (one holding less is left where it is).

        As new objects over its arrays: the taker's cache rebinds the objects it holds
        when it writes in place, and the lease's own may still be read where it was
        handed out as the lease of its blocks (`probe`: a restore on another thread
        copying them from their numpy views, which hold the objects, not the buffers).
        MLX then copies a buffer before the taker writes into it, until that lets go."""
        with self._lock:
            entry = self._entries.get(_live_key(end_key))
            if entry is None or (live := entry.live) is None or live.tokens != tokens:
                return None
            if (logits and live.logits is None) or (hidden and live.hidden is None):
                return None
            self._drop(_live_key(end_key))
            self._drop_over(entry, lives=True)
        layers = [None if layer is None else tuple(map(_view, layer)) for layer in live.layers]
        state = None if live.state is None else [_view(a) for a in live.state]
        extras = [None if a is None else _view(a) for a in (live.logits, live.hidden)]
        return Live(layers, live.tokens, state, *extras)

    def _drop_over(self, live: _Entry, *, lives: bool) -> None:
        """Drop the leases of chains (and, with `lives`, the live leases) over any of
        the buffers of `live` (a live lease's entry, not among them). Under the lock.
        Its buffers' addresses are found only when there is a lease to compare."""
        over = [
            k
            for k, e in self._entries.items()
            if e is not live
            and e.arrays
            and (e.hashes or e.live is not None)
            and (lives or e.live is None)
        ]
        if not over:
            return
        buffers = _buffers(live)
        for key in over:
            if self._entries[key].arrays.addresses()[0] in buffers:
                self._drop(key)

    @property
    def live_bytes(self) -> int:
        """The bytes live leases hold now (in `used_bytes` too)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.live is not None)

    def forget(self, hashes: Sequence[bytes]) -> None:
        """Drop every entry holding any of these blocks, and their states (evicted or
        rewritten)."""
        with self._lock:
            for h in hashes:
                held = self._blocks.get(bytes(h))
                if held is not None:
                    self._drop(held[0])
                self._drop(_state_key(h))

    def forget_states(self, hashes: Sequence[bytes]) -> None:
        """Drop the states at the end of these blocks (their records were removed)."""
        with self._lock:
            for h in hashes:
                self._drop(_state_key(h))

    def forget_ends(self, end_keys: Sequence[bytes]) -> None:
        """Drop the decoded arrays and the live leases of these end records (removed:
        evicted, revoked or replaced by a fix); no restore would find them again."""
        with self._lock:
            for k in end_keys:
                self._drop(_end_entry_key(k))
                self._drop(_live_key(k))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._blocks.clear()
            self._bytes = 0

    def _insert(self, key: bytes, entry: _Entry) -> None:
        """Hold `entry` under `key` (replacing one there), most recently used. Under the
        lock; the caller balances the budget after releasing it."""
        self._drop(key)
        entry.tick = self.budget.tick()
        self._entries[key] = entry
        # h -> (key, i) for each block, at C speed (the hashes end; the others do not).
        self._blocks.update(zip(entry.hashes, zip(repeat(key), count()), strict=False))
        self._bytes += entry.nbytes

    def _use(self, key: bytes) -> None:
        """The entry under `key` was used now. Under the lock."""
        self._entries.move_to_end(key)
        self._entries[key].tick = self.budget.tick()

    # -- a tenant of the budget (`blocks.hot.MemoryBudget`) -------------------------------------
    def oldest_tick(self) -> int | None:
        with self._lock:
            return next(iter(self._entries.values())).tick if self._entries else None

    def evict_oldest(self) -> bool:
        with self._lock:
            if not self._entries:
                return False
            self._drop(next(iter(self._entries)))
            return True

    def _drop(self, last: bytes) -> None:
        entry = self._entries.pop(last, None)
        if entry is None:
            return
        self._bytes -= entry.nbytes
        for h in entry.hashes:
            if self._blocks.get(h, (None,))[0] == last:
                del self._blocks[h]


def _view(a: mx.array | tuple[mx.array, ...]) -> Any:
    """A new object over the same buffer (a quantized layer's parts each)."""
    if isinstance(a, tuple):
        return tuple(x.reshape(x.shape) for x in a)
    return a.reshape(a.shape)


def _flat(layer: tuple[Any, ...]) -> list[mx.array]:
    """A layer's arrays, a quantized layer's parts flattened."""
    return [x for a in layer for x in (a if isinstance(a, tuple) else (a,))]
