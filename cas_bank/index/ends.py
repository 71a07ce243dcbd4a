"""End records: a whole prompt's exact end (docs/design.md, "End records").

An end record names a prompt of n tokens by `end_hash(parent, tail)`: `parent` is
the chain hash of its last full block (the namespace root when n < block_size) and
`tail` its last n % block_size tokens (possibly none). It holds what a restore needs
to resume at exactly n without a forward pass: the attention layers' KV of the tail
tokens, the recurrent layers' state at n (hybrid models), and optionally the logits
of token n-1 and a hidden state. Records live in the `ends` family under
`parent || end_hash` (64 bytes), so a lookup multi-gets the few candidates under the
deepest matched block, and the records under a block are found by that block's hash.
An end record is a leaf: it goes with its parent block (`evict.eviction`).

Record value, little-endian: the end header (`_FIXED` then the tail tokens as <u4)
followed by the codec payload (`blocks.codec`; its digest is in the header too and
is checked on every read of it, where a lease does not hold its arrays for that digest:
`FoundEnd.lease`, `index.lease`): the tail's attention arrays in spec order, then the
state arrays (flag), the logits (flag), the hidden state (flag).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from cas_bank.arrays import (
    DType,
    copied_rows,
    dtype_named,
    dtype_of,
    from_numpy,
    mlx_backend,
    to_numpy,
)
from cas_bank.blocks import codec
from cas_bank.blocks.codec import Compression
from cas_bank.blocks.files import PayloadFile
from cas_bank.blocks.hashing import (
    END_CONTEXT,
    BlockHash,
    Check,
    as_token_array,
    end_hash,
    end_hashes,
)
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.native import chain_module
from cas_bank.spec import ModelSpec, check_layers, check_state

if TYPE_CHECKING:
    from cas_bank.stats import Counters

log = logging.getLogger("cas_bank")

END_VERSION = 1
FLAG_STATE, FLAG_LOGITS, FLAG_HIDDEN = 1, 2, 4
_FIXED = struct.Struct("<BBHIQ32s32s32s")
KEY_SIZE = 64
_U4 = np.dtype("<u4")
_native_end_keys: Callable[[bytes, np.ndarray, str], list[bytes]] | None = getattr(
    chain_module, "end_keys", None
)


def end_key(parent: bytes, tail: bytes) -> bytes:
    """The `ends` family key of the prompt ending with `tail` (<u4 bytes) after `parent`."""
    return bytes(parent) + end_hash(parent, tail)


@dataclass(frozen=True, slots=True)
class EndHeader:
    """What an end record says of itself; the payload follows it in the value."""

    parent: bytes  # chain hash of the prompt's last full block, or the namespace root
    root: bytes
    n_tokens: int  # the prompt's length
    tail: bytes  # its last n_tokens % block_size tokens, <u4
    payload_digest: bytes
    payload_size: int
    flags: int

    @property
    def tail_len(self) -> int:
        return len(self.tail) // 4

    def parent_blocks(self, block_size: int) -> int:
        """Full blocks below the end (the parent's index + 1; 0 under the root)."""
        return (self.n_tokens - self.tail_len) // block_size

    @property
    def has_logits(self) -> bool:
        return bool(self.flags & FLAG_LOGITS)

    @property
    def has_hidden(self) -> bool:
        return bool(self.flags & FLAG_HIDDEN)

    @property
    def has_state(self) -> bool:
        return bool(self.flags & FLAG_STATE)

    def holds(self, flags: int) -> bool:
        """Whether this record holds everything `flags` asks for (state, logits,
        hidden state)."""
        return self.flags | flags == self.flags

    def key(self) -> bytes:
        return end_key(self.parent, self.tail)

    def encode(self) -> bytes:
        return (
            _FIXED.pack(
                END_VERSION,
                self.flags,
                self.tail_len,
                self.n_tokens,
                self.payload_size,
                self.parent,
                self.root,
                self.payload_digest,
            )
            + self.tail
        )

    def token_ids(self) -> list[int]:
        return [int(t) for t in np.frombuffer(self.tail, dtype="<u4")]


def split_record(key: bytes, value: bytes) -> tuple[EndHeader, memoryview]:
    """The header and payload of an end record; `CorruptDataError` if it is not one
    (bad version or lengths, or a key that is not the hash of what it says). The payload
    is a view of `value`: a hybrid model's record holds its recurrent state (~5 MB for
    the medium one at 1k tokens), and a copy of it cost a restore ~1-2.5 ms here."""
    header, at = _split_header(key, value, len(value))
    return header, memoryview(value)[at:]


def _split_header(key: bytes, head: bytes, size: int) -> tuple[EndHeader, int]:
    """The header of the end record of `size` bytes whose first bytes are `head`, and
    where its payload begins; `CorruptDataError` as `split_record` says (a header
    longer than `head` too)."""
    where = key.hex()[64:80] if len(key) == KEY_SIZE else key.hex()[:16]
    try:
        version, flags, tail_len, n, payload_size, parent, root, pd = _FIXED.unpack_from(head)
    except struct.error:
        raise CorruptDataError(f"end record {where} is truncated") from None
    if version != END_VERSION:
        raise CorruptDataError(f"end record {where} has version {version}")
    at = _FIXED.size + 4 * tail_len
    tail = head[_FIXED.size : at]
    if len(tail) != 4 * tail_len or max(size - at, 0) != payload_size or n < tail_len:
        raise CorruptDataError(f"end record {where} has bad lengths")
    header = EndHeader(parent, root, n, bytes(tail), pd, payload_size, flags)
    if len(key) != KEY_SIZE or key != header.key():
        raise CorruptDataError(f"end record {where} is not stored under its own name")
    return header, at


def header_bytes(head: bytes) -> int:
    """How many first bytes of the end record beginning with `head` its header (fixed
    part and tail tokens) takes; 0 if `head` is not one (`blocks.files` reads that many
    of a record kept as a file for its head)."""
    try:
        tail_len: int = _FIXED.unpack_from(head)[2]
    except struct.error:
        return 0
    return _FIXED.size + 4 * tail_len


def named_digest(value: bytes) -> bytes | None:
    """The payload digest an end record's value names in its header (not checked); None
    if it is not an end record of this version: what the file tier names the file of a
    large one by (`blocks.files`)."""
    try:
        fields = _FIXED.unpack_from(value)
    except struct.error:
        return None
    return bytes(fields[-1]) if fields[0] == END_VERSION else None


def stored_record(key: bytes, value: bytes | None) -> tuple[EndHeader, memoryview] | None:
    """`split_record` of a value read from the store; None if it is absent or is not
    an end record."""
    if value is None:
        return None
    try:
        return split_record(key, value)
    except CorruptDataError:
        return None


LeaseOf = Callable[[bytes, bytes], "EndPayload | None"]  # `Leases.end`: (key, digest)


def stored_end(
    key: bytes, value: bytes | PayloadFile | None, lease_of: LeaseOf | None
) -> FoundEnd | None:
    """The stored end record `value` under `key` (as `blocks.hot.record_heads` reads it:
    its bytes, or its file with its head), with where a lease may hold its arrays
    (`lease_of`, `Leases.end`); None if absent or it does not split. A record kept as a
    file is found by its head alone: its payload is read only when its arrays are
    wanted and no lease holds them (`FoundEnd.arrays`), so the hot tier holds its head
    while a lease holds its arrays decoded."""
    if isinstance(value, PayloadFile):
        try:
            header, _ = _split_header(key, value.head, value.size)
        except CorruptDataError:  # a tail longer than the head read, or damage
            return stored_end(key, value.read(), lease_of) if len(value.head) < value.size else None
        return FoundEnd(header, None, None, _lease(lease_of, key, header), value)
    split = stored_record(key, value)
    if split is None:
        return None
    header, raw = split
    return FoundEnd(header, raw, None, _lease(lease_of, key, header))


def _lease(
    lease_of: LeaseOf | None, key: bytes, header: EndHeader
) -> Callable[[], EndPayload | None] | None:
    return None if lease_of is None else partial(lease_of, key, header.payload_digest)


def with_check(key: bytes, value: bytes, check: Check) -> bytes:
    """An end record's value whose payload carries `check` (re-digested if it does not:
    `codec.with_check`), its header naming the new digest; `CorruptDataError` if it is
    not a record or its payload fails its own check."""
    end, payload = split_record(key, value)
    if codec.embedded_digest(payload) != end.payload_digest:
        raise CorruptDataError(f"end record {key.hex()[64:80]}: payload digest is not the header's")
    checked = codec.with_check(payload, check)
    return replace(end, payload_digest=codec.embedded_digest(checked)).encode() + checked


def encode_end(
    spec: ModelSpec,
    tail: tuple[Sequence[np.ndarray], Sequence[DType]],
    state: Sequence[mx.array] | None,
    logits: mx.array | None,
    hidden: mx.array | None,
    compression: Compression,
    check: Check = "xxh3",
) -> tuple[bytes, int]:
    """The payload of an end record, and its flags. `tail`: the tail's attention arrays
    as numpy views (bf16 as uint16) and their dtypes (`EndInput.tail_views`)."""
    arrays: list[mx.array] = []
    flags = 0
    if state is not None:
        arrays += list(state)
        flags |= FLAG_STATE
    for extra, flag in ((logits, FLAG_LOGITS), (hidden, FLAG_HIDDEN)):
        if extra is not None:
            arrays.append(extra)
            flags |= flag
    mx.eval(*arrays)
    views = [*tail[0], *(to_numpy(a) for a in arrays)]
    dtypes = [*tail[1], *(dtype_of(a) for a in arrays)]
    return codec.encode(views, dtypes, compression, check), flags


@dataclass(frozen=True, slots=True)
class EndPayload:
    """An end record's arrays: the tail's KV as numpy arrays, bf16 as uint16 (views of
    the record's bytes, or a lease's read-only copies: `tail_arrays` copies them into
    MLX), the rest as MLX arrays (copies of the record's, or new objects over a lease's
    buffers)."""

    tail: list[np.ndarray]  # attention arrays of the tail tokens, flat, in spec order
    tail_dtypes: list[DType]
    state: list[mx.array] | None  # recurrent state arrays, flat
    logits: mx.array | None
    hidden: mx.array | None

    def tail_arrays(self) -> list[mx.array]:
        return [from_numpy(a, d) for a, d in zip(self.tail, self.tail_dtypes, strict=True)]

    def mlx_arrays(self) -> list[mx.array]:
        """Its MLX arrays: the state's, then the logits and the hidden state it holds."""
        extra = [a for a in (self.logits, self.hidden) if a is not None]
        return [*(self.state or ()), *extra]

    def over_same_buffers(self, tail: list[np.ndarray] | None = None) -> EndPayload:
        """These arrays as new MLX objects over the same buffers, evaluated (what a
        holder hands out: a taker's in-place writes rebind its own objects, and MLX
        copies a buffer another array holds before writing into it), with `tail` in
        place of its own where given."""

        def view(a: mx.array | None) -> mx.array | None:
            return None if a is None else a.reshape(a.shape)

        state = [a.reshape(a.shape) for a in self.state] if self.state is not None else None
        tail = self.tail if tail is None else tail
        out = EndPayload(tail, self.tail_dtypes, state, view(self.logits), view(self.hidden))
        mx.eval(out.mlx_arrays())
        return out


def decode_end(spec: ModelSpec, header: EndHeader, payload: bytes | memoryview) -> EndPayload:
    """The arrays of an end payload after checking its digest and its fit with `spec`."""
    block = codec.decode(payload, header.payload_digest)
    arrays = block.arrays
    att, rec = spec.block_arrays, spec.state_arrays
    n_state = len(rec) if header.has_state else 0
    want = len(att) + n_state + header.has_logits + header.has_hidden
    if len(arrays) != want or (spec.is_hybrid and not header.has_state):
        raise CorruptDataError("end payload does not fit the spec")
    dtypes = [dtype_named(s.dtype) for s in att]
    for a, s, d in zip(arrays[: len(att)], att, dtypes, strict=True):
        if a.shape != s.with_tokens(header.tail_len) or a.dtype != d.storage:
            raise CorruptDataError("end payload does not fit the spec")
    state: list[mx.array] | None = None
    if n_state:
        state = []
        for a, s in zip(arrays[len(att) : len(att) + n_state], rec, strict=True):
            d = dtype_named(s.dtype)
            if a.shape != s.shape or a.dtype != d.storage:
                raise CorruptDataError("end payload does not fit the spec")
            state.append(from_numpy(a, d))
    rest = list(zip(arrays[len(att) + n_state :], block.dtypes[len(att) + n_state :], strict=True))
    logits = from_numpy(*rest.pop(0)) if header.has_logits else None
    hidden = from_numpy(*rest.pop(0)) if header.has_hidden else None
    return EndPayload(list(arrays[: len(att)]), dtypes, state, logits, hidden)


class EndGone(CorruptDataError):
    """A record kept as a file was found by its head, and its file was gone when its
    payload was read (rewritten or evicted in between): a miss, not damage."""


@dataclass(frozen=True, slots=True)
class FoundEnd:
    """An end record a lookup found: its header, and its payload as the record's bytes
    (written), as the file holding them (`file`: a written one found by its head,
    `stored_end`) or as the arrays a store queued for the background writer (`held`);
    and for a written one, where a lease may hold its arrays decoded (`lease`: asked
    only when its arrays are, since most lookups read a record for its header alone)."""

    header: EndHeader
    raw: bytes | memoryview | None = None
    held: EndInput | None = None
    lease: Callable[[], EndPayload | None] | None = None
    file: PayloadFile | None = None

    @property
    def written(self) -> bool:
        """Whether it is a written record (not a queued store's arrays)."""
        return self.held is None

    def payload(self, spec: ModelSpec) -> EndPayload:
        """Its arrays (`arrays`)."""
        return self.arrays(spec)[0]

    def arrays(self, spec: ModelSpec) -> tuple[EndPayload, bool]:
        """Its arrays, and whether a lease held them: the queued store's own, the
        leased ones, or the record's decoded after checking its digest (a failure
        raises `CorruptDataError`)."""
        if self.held is not None:
            return held_payload(self.held), False
        leased = self.lease() if self.lease is not None else None
        if leased is not None:
            return leased, True
        return decode_end(spec, self.header, self._payload()), False

    def intact(self) -> bool:
        """Whether its payload (a written record's) is there and passes its digest."""
        try:
            return codec.verify(self._payload(), self.header.payload_digest)
        except CorruptDataError:  # its file gone (`EndGone`) or holding another header
            return False

    def _payload(self) -> bytes | memoryview:
        """Its payload's bytes: the record's, or its file's (`EndGone` if it is gone;
        `CorruptDataError` if the file holds another header than the one found)."""
        if self.raw is not None:
            return self.raw
        assert self.file is not None
        value = self.file.read()
        key = self.header.key()
        if value is None:
            raise EndGone(f"end record {key.hex()[64:80]}: its file is gone")
        header, payload = split_record(key, value)
        if header != self.header:
            raise CorruptDataError(f"end record {key.hex()[64:80]}: its file's header changed")
        return payload


class EndRecords(Protocol):
    """Where end records are looked up (`index.view.ReadView`: a queued record, or
    the stored one under the same key where it holds more)."""

    def end_records(self, keys: Sequence[bytes]) -> list[FoundEnd | None]: ...

    def keep_end(self, found: FoundEnd, payload: EndPayload) -> None:
        """Keep a written record's arrays, decoded, for the next restore of it."""


def candidate_keys(parent: bytes, tail: np.ndarray) -> list[bytes]:
    """The `ends` keys under `parent` of the prompts ending with each prefix of `tail`
    (token ids), the whole of it first, none last: a lookup's candidates. One C call
    where `cas_bank._chain` is built (the same keys)."""
    if _native_end_keys is not None:
        return _native_end_keys(bytes(parent), np.ascontiguousarray(tail, _U4), END_CONTEXT)
    data = tail.astype(_U4).tobytes()
    return [bytes(parent) + h for h in reversed(end_hashes(parent, data))]


def find_end(
    view: EndRecords,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray,
    matched: int,
    block_size: int,
) -> FoundEnd | None:
    """The deepest end record under block `matched - 1` (the root when 0) whose tail
    prefixes `tokens` after that block: one multi-get of at most `block_size`
    candidates. Records that do not decode or do not match are skipped."""
    parent = root if matched == 0 else hashes[matched - 1]
    base = matched * block_size
    longest = min(block_size - 1, len(tokens) - base)
    if longest < 0:
        return None
    for found in view.end_records(candidate_keys(parent, tokens[base : base + longest])):
        if found is None:
            continue
        header = found.header
        if header.root == root and header.n_tokens == base + header.tail_len:
            return found
    return None


@dataclass(frozen=True, slots=True)
class EndInput:
    """What a store of an end record writes, checked against the spec."""

    tokens: np.ndarray
    buffers: list[mx.array]  # attention arrays (flat), holding at least the tokens
    base: int  # tokens in full blocks: the tail is rows base:len(tokens) of `buffers`
    state: list[mx.array] | None  # recurrent state arrays (flat) at len(tokens)
    logits: mx.array | None
    hidden: mx.array | None
    _tail: list[list[mx.array]] = field(default_factory=list, repr=False, compare=False)

    @property
    def tail(self) -> list[mx.array]:
        """The attention arrays (flat) of the tokens after the last full block: copies
        of those rows of `buffers`, made once, by whoever asks first (a restore that
        finds the record queued; the writer reads `tail_views`), not by the store's
        caller: `buffers` are evaluated arrays nothing writes into (a cache copies a
        buffer the bank shares before it writes), so any thread may copy from them."""
        if not self._tail:  # two threads at once both copy; either copy is right
            self._tail.append(copied_rows(self.buffers, self.base, len(self.tokens)))
        return self._tail[0]

    def tail_views(self) -> tuple[list[np.ndarray], list[DType]]:
        """The tail as numpy views (bf16 as uint16) and their dtypes, for its payload:
        rows of `buffers`' views, no copy and no MLX op where they are contiguous (the
        writer's thread then runs none). On CUDA views of `tail`'s copies, made on the
        GPU: a CPU pointer to a whole cache buffer moves it into unified memory."""
        if self._tail or mlx_backend() == "cuda":
            return [to_numpy(a) for a in self.tail], [dtype_of(a) for a in self.tail]
        rows = slice(self.base, len(self.tokens))
        views = [to_numpy(a)[..., rows, :] for a in self.buffers]
        return views, [dtype_of(a) for a in self.buffers]

    @property
    def flags(self) -> int:
        return (
            (FLAG_STATE if self.state is not None else 0)
            | (FLAG_LOGITS if self.logits is not None else 0)
            | (FLAG_HIDDEN if self.hidden is not None else 0)
        )


def end_place(
    root: bytes, hashes: Sequence[BlockHash], tokens: np.ndarray, block_size: int
) -> tuple[bytes, bytes, bytes]:
    """Where the end record of `tokens` goes: its parent (the chain hash of its last
    full block, of `hashes`, or `root`), its tail (<u4 bytes) and its key."""
    n = len(tokens)
    base = n - n % block_size
    parent = bytes(root if base == 0 else hashes[base // block_size - 1])
    tail = tokens[base:].astype("<u4").tobytes()
    return parent, tail, end_key(parent, tail)


def held_payload(end: EndInput) -> EndPayload:
    """The arrays of an end record not written yet, as a restore takes them: the tail
    as numpy views (bf16 as uint16), the rest as new MLX arrays on the same buffers."""
    tail = [to_numpy(a) for a in end.tail]
    state = list(end.state) if end.state is not None else None
    held = EndPayload(tail, [dtype_of(a) for a in end.tail], state, end.logits, end.hidden)
    return held.over_same_buffers()


def prepare_end(
    spec: ModelSpec,
    block_size: int,
    tokens: Any,
    layers: Sequence[Any],
    state: Sequence[Any] | None,
    logits: Any,
    hidden: Any,
    *,
    copy: bool = False,
    checked: list[list[mx.array]] | None = None,
    state_copied: bool = False,
) -> EndInput:
    """The checked input of `Namespace.store_end` (bad input raises `InvalidInputError`);
    with `copy`, for a queued store: the recurrent state is copied (unless
    `state_copied`), and the attention arrays are held as new objects over the same
    buffers (what the tail copies from, when it is first asked for: `EndInput.tail`),
    all evaluated now.

    `checked`: `check_layers` of `layers` done already (the store of the same tokens
    checked them), not done again; with `copy`, its arrays are new objects of the
    caller's (a queued store's snapshot), evaluated, held as they are. `state_copied`:
    `state` is the caller's own snapshot, taken for this record (new objects nothing
    writes into: `cache_io.snapshot_states`): not copied."""
    toks = as_token_array(tokens)
    n = len(toks)
    if n == 0:
        raise InvalidInputError("an end record needs at least one token")
    arrays = check_layers(spec, layers, n) if checked is None else checked
    flat = _end_state(spec, state)
    logits = _end_logits(logits, hidden)
    if hidden is not None:  # a new object, as the logits: the caller's may be written
        hidden = hidden.reshape(hidden.shape)
    base = n - n % block_size
    if not copy:
        buffers = [a for layer in arrays for a in layer]
        return EndInput(toks, buffers, base, flat, logits, hidden)
    # New objects: an in-place update rebinds the caller's, never these (`index.lease`).
    buffers = [a if checked else a.reshape(a.shape) for layer in arrays for a in layer]
    if flat is not None and not state_copied:
        flat = [mx.array(a) for a in flat]
    mx.eval(buffers, flat or [], [a for a in (logits, hidden) if a is not None])
    # On CUDA the tail is copied now, on the GPU, on this thread (`EndInput.tail_views`).
    tail = [copied_rows(buffers, base, n)] if mlx_backend() == "cuda" else []
    return EndInput(toks, buffers, base, flat, logits, hidden, tail)


def _end_state(spec: ModelSpec, state: Sequence[Any] | None) -> list[mx.array] | None:
    """An end record's recurrent state, checked and flat (None for an attention-only model)."""
    if spec.is_hybrid:
        if state is None:
            raise InvalidInputError(
                f"{spec.name!r} has recurrent layers: an end record needs their state at its end"
            )
        return check_state(spec, state, "end state")
    if state is not None and any(s is not None for s in state):
        raise InvalidInputError(f"a state given but {spec.name!r} has no recurrent layers")
    return None


def _end_logits(logits: Any, hidden: Any) -> mx.array | None:
    """An end record's logits, checked and flat (`hidden` is checked to be an array)."""
    for name, a in (("logits", logits), ("hidden", hidden)):
        if a is not None and not isinstance(a, mx.array):
            raise InvalidInputError(f"{name} must be an mlx array, got {type(a).__name__}")
    if logits is None:
        return None
    if logits.ndim < 1 or any(d != 1 for d in logits.shape[:-1]):
        raise InvalidInputError(
            f"logits must be the last token's, shape [vocab] (or [1, vocab], [1, 1, "
            f"vocab]); got shape {tuple(logits.shape)}: take logits[0, -1]"
        )
    # A reshape to the shape it has is a new object over the same array (the caller's
    # object is not ours); any other is an MLX op, evaluated later (~20 us).
    flat: mx.array = logits.reshape(logits.shape if logits.ndim == 1 else (-1,))
    return flat


@dataclass(frozen=True, slots=True)
class EndPlan:
    """An end record a restore resumes from: deeper than the chain's restore point."""

    header: EndHeader
    payload: EndPayload
    blocks: int  # full blocks below it (restored from the chain)
    queued: bool = False  # queued for the background writer: not written yet

    @property
    def tokens(self) -> int:
        return self.header.n_tokens


def plan_end(
    view: EndRecords,
    spec: ModelSpec,
    root: bytes,
    hashes: Sequence[BlockHash],
    tokens: np.ndarray,
    matched: int,
    block_size: int,
    floor: int,
    counters: Counters,
) -> EndPlan | None:
    """The end record to restore from, if one under block `matched - 1` prefixes `tokens`
    and reaches past `floor` (the chain's restore point, in tokens) or to the end of
    `tokens` (its logits then spare the last forward pass). Its payload is read and
    verified here (a queued one's arrays are taken from memory); a corrupt one is
    counted and logged, and the restore goes without."""
    try:
        found = find_end(view, root, hashes, tokens, matched, block_size)
    except CorruptDataError as e:  # RocksDB's own checks
        counters.count(corrupt_reads=1)
        log.warning("cas_bank: end records unreadable (%s); served as a miss", e)
        return None
    if found is None:
        return None
    header = found.header
    if header.n_tokens <= floor and header.n_tokens != len(tokens):
        return None
    try:
        payload, leased = found.arrays(spec)
    except EndGone:
        return None
    except CorruptDataError as e:
        counters.count(corrupt_reads=1)
        log.warning(
            "cas_bank: end record %s failed verification (%s); served as a miss",
            header.key().hex()[64:80],
            e,
        )
        return None
    if found.written and not leased:
        view.keep_end(found, payload)
    return EndPlan(header, payload, header.parent_blocks(block_size), found.held is not None)
