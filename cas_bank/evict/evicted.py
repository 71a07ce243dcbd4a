"""The eviction memory: which blocks (and states) the bank removed, when and why.

`explain` asks it about the first block of a prompt that is not stored: evicted at
a time by a cause, or never stored (or removed before the memory's horizon).

Records live in the `evicted` family, written in the same batch as the removal they
describe (so they are exact: a removal that did not commit left no record) and
cleared in the same batch as a store that writes the block again (`Transaction`
does both; see `writes`). Keys:

- `b"r" + chain hash` (a block), `b"r" + chain hash + b"s"` (a state removed on its
  own): `time <f8 | reason u8 | seq <u8`;
- `b"q" + seq % cap (>u8)`: the `r` key that took that slot (a ring of `cap` slots);
- `b"m" + name`: `next` (<u8, the next seq), `cap` (<u8, the cap the ring was laid
  out for), `dropped` (<f8, the time of the newest record dropped for the cap),
  `since` (<f8, when this bank began recording) and `before` (<u8, blocks the
  bank had evicted by then, without records).

Bounded exactly: the removal numbered `seq` takes slot `seq % cap` and deletes the
record that held it (numbered `seq - cap`, unless a store cleared it), so at most
`cap` records live, the newest `cap` removals less those stored again. Every write
is a point read and a put, never a scan (no walk over tombstones). A changed cap
lays the ring out again at the next writer open (one walk of the family), keeping
the newest records that fit. The horizon explain reports is the time before which
a missing block may have been removed without a record: the newest dropped
record's time, or `since` if the bank had evicted blocks before recording began.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from cas_bank.blocks.store import BlockStore, Family, Write
from cas_bank.index.records import STATE_SUFFIX

Reason = Literal["budget", "gc", "damaged", "unreachable"]
"""Why a record went: `budget` (eviction to `BankConfig.max_bytes` after a store, or
`BankPromptCache.trim_to`), `gc` (`cas-bank gc --max-bytes`), `damaged` (`verify
--fix`: it failed a check), `unreachable` (`verify --fix`: below a damaged block)."""
REASONS: tuple[Reason, ...] = get_args(Reason)

_RECORD = struct.Struct("<dBQ")
_U64 = struct.Struct("<Q")
_SLOT = struct.Struct(">Q")
_F64 = struct.Struct("<d")
_NEXT, _CAP, _DROPPED, _SINCE, _BEFORE = (b"mnext", b"mcap", b"mdropped", b"msince", b"mbefore")


def record_key(chain_hash: bytes, state: bool = False) -> bytes:
    """The `evicted`-family key of a block's removal record (or of its state's)."""
    return b"r" + bytes(chain_hash) + (STATE_SUFFIX if state else b"")


def _slot_key(seq: int, cap: int) -> bytes:
    return b"q" + _SLOT.pack(seq % cap)


@dataclass(frozen=True, slots=True)
class Removal:
    """One recorded removal."""

    time: float  # seconds since the epoch (the bank's clock)
    reason: Reason
    seq: int

    def encode(self) -> bytes:
        return _RECORD.pack(self.time, REASONS.index(self.reason), self.seq)

    @classmethod
    def decode(cls, raw: bytes) -> Removal | None:
        if len(raw) != _RECORD.size:
            return None
        t, code, seq = _RECORD.unpack(raw)
        if code >= len(REASONS):
            return None
        return cls(t, REASONS[code], seq)


@dataclass(frozen=True, slots=True)
class Horizon:
    """How far back the memory reaches."""

    since: float | None  # when recording began (None: no writer of this version yet)
    before: int  # blocks evicted before that, without records
    dropped: float | None  # time of the newest record dropped for the cap

    @property
    def complete(self) -> bool:
        """Every removal since the bank was made has its record (none dropped)."""
        return self.dropped is None and self.before == 0

    @property
    def time(self) -> float | None:
        """Removals before this time may have left no record (None: complete)."""
        if self.complete:
            return None
        times = [t for t in (self.dropped, self.since if self.before else None) if t is not None]
        return max(times) if times else None


def lookup(store: BlockStore, keys: Sequence[bytes]) -> list[Removal | None]:
    """The removal records of `keys` (`record_key`), None where there is none."""
    return [
        None if raw is None else Removal.decode(raw) for raw in store.get_many(Family.EVICTED, keys)
    ]


def horizon(store: BlockStore, blocks_evicted: int) -> Horizon:
    """The memory's horizon; `blocks_evicted` stands for `before` in a bank no writer
    of this version has opened (it has recorded nothing)."""
    since, before, dropped = store.get_many(Family.EVICTED, [_SINCE, _BEFORE, _DROPPED])
    if since is None:
        return Horizon(None, blocks_evicted, None)
    return Horizon(
        _F64.unpack(since)[0],
        _U64.unpack(before)[0] if before else 0,
        _F64.unpack(dropped)[0] if dropped else None,
    )


class EvictionMemory:
    """The writer's side: the writes that record removals and clear stored blocks.

    Used under the bank's write lock only (by `Transaction.commit`); `writes` reads
    the store and returns the batch's extra writes and the state to `commit` once
    the batch is written.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._next = 0  # the next seq; 0 also means no record was ever written
        self._dropped: float | None = None

    def start(self, store: BlockStore, blocks_evicted: int, now: float) -> None:
        """At a writer open: read the ring's state; begin recording (a bank new to it),
        or lay the ring out again for a changed cap."""
        nxt, cap, dropped, since = store.get_many(Family.EVICTED, [_NEXT, _CAP, _DROPPED, _SINCE])
        self._next = _U64.unpack(nxt)[0] if nxt else 0
        self._dropped = _F64.unpack(dropped)[0] if dropped else None
        writes: list[Write] = []
        if since is None:
            writes += [
                (Family.EVICTED, _SINCE, _F64.pack(now)),
                (Family.EVICTED, _BEFORE, _U64.pack(blocks_evicted)),
            ]
        old_cap = _U64.unpack(cap)[0] if cap else self.cap
        if old_cap != self.cap and self._next > 0:
            writes += self._relayout(store)
        if cap is None or old_cap != self.cap:
            writes.append((Family.EVICTED, _CAP, _U64.pack(self.cap)))
        if writes:
            store.put_batch(writes)

    def _relayout(self, store: BlockStore) -> list[Write]:
        """Keep the newest records that fit the new cap, renumbered 0..k-1."""
        live: list[tuple[int, bytes, Removal]] = []
        writes: list[Write] = []
        for key, raw in store.iterate(Family.EVICTED):
            if key[:1] == b"q":
                writes.append((Family.EVICTED, key, None))
            elif key[:1] == b"r":
                r = Removal.decode(raw)
                if r is None:
                    writes.append((Family.EVICTED, key, None))
                else:
                    live.append((r.seq, key, r))
        live.sort()
        keep = live[len(live) - self.cap :] if self.cap else []
        for _, key, r in live[: len(live) - len(keep)]:
            writes.append((Family.EVICTED, key, None))
            self._dropped = max(self._dropped or r.time, r.time)
        for seq, (_, key, r) in enumerate(keep):
            writes.append((Family.EVICTED, key, Removal(r.time, r.reason, seq).encode()))
            writes.append((Family.EVICTED, _slot_key(seq, self.cap), key))
        self._next = len(keep)
        writes.append((Family.EVICTED, _NEXT, _U64.pack(self._next)))
        if self._dropped is not None:
            writes.append((Family.EVICTED, _DROPPED, _F64.pack(self._dropped)))
        return writes

    def writes(
        self,
        store: BlockStore,
        batch: Sequence[Write],
        removed: Sequence[tuple[bytes, Reason]],
        now: Callable[[], float],
    ) -> tuple[list[Write], Callable[[], None]]:
        """The writes that record `removed` (record keys, with their reasons) and clear
        the records of blocks (and states) `batch` writes again; and the step that
        makes them this memory's state once the batch is written."""
        out = self._clears(store, batch, {k for k, _ in removed})
        seq, dropped = self._next, self._dropped
        if removed:
            t = now()
            if self.cap == 0:
                dropped = max(dropped or t, t)  # nothing is kept: all of it is past
            else:
                seq, dropped = self._record(store, removed, t, out)
                out.append((Family.EVICTED, _NEXT, _U64.pack(seq)))
            if dropped is not None and dropped != self._dropped:
                out.append((Family.EVICTED, _DROPPED, _F64.pack(dropped)))

        def commit() -> None:
            self._next, self._dropped = seq, dropped

        return out, commit

    def _clears(self, store: BlockStore, batch: Sequence[Write], skip: set[bytes]) -> list[Write]:
        """Deletes of the records of what `batch` stores: a header written clears its
        block's record, and its state's when the header announces one."""
        if self._next == 0:
            return []  # nothing was ever recorded: nothing to clear
        keys: dict[bytes, None] = {}
        for family, key, value in batch:
            if family is not Family.HEADERS or value is None:
                continue
            keys[record_key(key)] = None
            if len(value) > 1 and value[1] & 1:  # the header's has-state flag
                keys[record_key(key, True)] = None
        wanted = [k for k in keys if k not in skip]
        if not wanted:
            return []
        found = store.get_many(Family.EVICTED, wanted)
        return [(Family.EVICTED, k, None) for k, v in zip(wanted, found, strict=True) if v]

    def _record(
        self, store: BlockStore, removed: Sequence[tuple[bytes, Reason]], t: float, out: list[Write]
    ) -> tuple[int, float | None]:
        cap, first, dropped = self.cap, self._next, self._dropped
        # The slots these removals take that records from before this batch hold.
        old_seqs = [s for s in range(first, first + len(removed)) if 0 <= s - cap < first]
        slot_keys = [_slot_key(s, cap) for s in old_seqs]
        occupants = dict(zip(old_seqs, store.get_many(Family.EVICTED, slot_keys), strict=True))
        held = [k for k in occupants.values() if k is not None]
        records = dict(zip(held, store.get_many(Family.EVICTED, held), strict=True))
        overlay: dict[bytes, bytes | None] = {}  # writes of this batch, read back
        seq = first
        for key, reason in removed:
            if seq >= cap:
                old = overlay.get(_slot_key(seq, cap)) if seq - cap >= first else occupants[seq]
                if old is not None:
                    raw = overlay[old] if old in overlay else records.get(old)
                    r = Removal.decode(raw) if raw else None
                    if r is not None and r.seq == seq - cap:
                        overlay[old] = None
                        dropped = max(dropped or r.time, r.time)
            overlay[_slot_key(seq, cap)] = key
            overlay[key] = Removal(t, reason, seq).encode()
            seq += 1
        out.extend((Family.EVICTED, k, v) for k, v in overlay.items())
        return seq, dropped


def removals(
    pairs: Iterable[bytes], reason: Reason, *, state: bool = False
) -> list[tuple[bytes, Reason]]:
    """(record key, reason) for each chain hash in `pairs`."""
    return [(record_key(h, state), reason) for h in pairs]
