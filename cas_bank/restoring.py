"""The restore path of a `Namespace`: the longest stored prefix of a prompt as MLX arrays.

The walk: chain hashes of the prompt's full blocks -> `longest_chain` (`stored_prefix`
by binary search, then one multi-get of its headers) -> the shared tier's continuation
(if any) -> an end record under the deepest matched block (`index.ends`) ->
`restore_blocks` (hybrid: deepest boundary with a state) -> one probe of the leases ->
`index.payloads` reads and verifies each payload -> `index.layout.Assembler` copies it
once into fresh MLX arrays (payload files straight into them, a hybrid boundary state
in a file with them) -> `Hit`.
docs/design.md, "Restore path", says why each step is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from cas_bank.blocks.hashing import BlockHash, as_token_array
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import longest_chain
from cas_bank.index.ends import EndPlan, end_layers, plan_end
from cas_bank.index.layout import Assembler, flat_attention, group_layers, merge_layers
from cas_bank.index.partial import (
    PartialPlan,
    find_partial,
    partial_layers,
    read_partial,
    remote_partial,
)
from cas_bank.index.states import restore_blocks
from cas_bank.index.timings import RestoreTimings

if TYPE_CHECKING:
    from cas_bank.index.owner import Owner
    from cas_bank.index.payloads import PayloadReader, StateRead
    from cas_bank.spec import ModelSpec

ROOM_STEP = 256  # mlx-lm's KVCache grows its buffers by this many tokens


@dataclass(frozen=True, slots=True)
class Hit:
    """A restore: `tokens` covered and per-layer arrays aligned with `spec.layers`."""

    tokens: int
    layers: list[tuple[Any, ...] | None]
    blocks: list[BlockHash] = field(repr=False)
    # From an end record (`index.ends`): the logits of token `tokens - 1` and the hidden
    # state stored with them, when it held them; None otherwise.
    logits: mx.array | None = field(default=None, repr=False)
    hidden: mx.array | None = field(default=None, repr=False)
    end: bool = False  # resumed from an end record
    partial: int = 0  # tokens taken from a partial block (`index.partial`), in `tokens`
    timings: RestoreTimings | None = field(default=None, compare=False)

    @property
    def exact(self) -> bool:
        """Whether the logits of the prompt's last token came with it (no prefill left)."""
        return self.logits is not None


class Restorable(Protocol):
    """What a restore needs of a namespace (`cas_bank.namespace.Namespace`)."""

    bank: Owner
    spec: ModelSpec
    root: bytes
    block_size: int
    _payloads: PayloadReader

    def chain(self, tokens: Any) -> list[BlockHash]: ...


def copies_on_cpu() -> bool:
    """Whether MLX's default device is the CPU (where a restore copies a lease into
    arrays with room itself, rather than leave the copy to mlx-lm's first update)."""
    return bool(mx.default_device() == mx.cpu)


def _clocked(
    ns: Restorable, started: float, looked_up: float, allocated: float, filled: float
) -> RestoreTimings:
    """A restore's timings from its clock readings (the total ends now), added to the
    bank's sums."""
    timings = RestoreTimings(
        lookup_s=looked_up - started,
        allocate_s=allocated - looked_up,
        fill_s=filled - allocated,
        total_s=time.perf_counter() - started,
    )
    ns.bank.restore_clock.add(timings)
    return timings


def restore(ns: Restorable, tokens: Any, *, room_for: int = 0) -> Hit | None:
    """`Namespace.restore(tokens, room_for=room_for)` of `ns` (its docstring says what
    comes back)."""
    started = time.perf_counter()
    toks = as_token_array(tokens)
    hashes = ns.chain(toks)
    try:
        matched = longest_chain(ns.bank.store, ns.root, hashes)
    except CorruptDataError as e:  # a damaged headers table: a counted miss
        ns._payloads.damaged_headers(str(e))
        matched = []
    remote = ns.bank.remote
    hybrid = ns.spec.is_hybrid
    # The shared tier continues the local chain where it ends (verified, in memory).
    asked = remote is not None and len(matched) < len(hashes)  # the chain goes on there
    cont = remote.continue_chain(ns, toks, hashes, matched) if asked and remote else None
    if cont is not None:
        matched = cont.matched
    n_blocks = restore_blocks(matched, hybrid)
    bs = ns.block_size
    # An end record under the deepest matched block (index.ends): an exact repeat,
    # or a prompt that extends a stored one past the chain's restore point.
    end: EndPlan | None = None
    if cont is None:
        end = plan_end(
            ns.bank.store,
            ns.spec,
            ns.root,
            hashes,
            toks,
            len(matched),
            bs,
            n_blocks * bs,
            ns.bank.counters,
        )
        if end is not None:
            n_blocks = end.blocks
    if (
        cont is None
        and end is None
        and remote is not None
        and (n_blocks < len(matched) or len(matched) == len(hashes))
    ):
        # A hybrid model whose local blocks go past its deepest local state, or a chain
        # all local (and no local end record reaches further): the shared tier may hold
        # a deeper state over them, or the end record another host stored.
        cont = remote.continue_chain(ns, toks, hashes, matched)
        if cont is not None:
            matched = cont.matched
            n_blocks = restore_blocks(matched, hybrid)
    if cont is not None and cont.end is not None:  # an end record from the shared tier
        end = cont.end.plan
        n_blocks = end.blocks
    # A partial block: the stored child of the last matched block sharing the most of
    # the prompt's next tokens (attention-only: a state exists only where captured).
    part: PartialPlan | None = None
    if not hybrid and n_blocks == len(matched) and ns.bank.config.partial_blocks:
        at_home = cont is None or cont.start == n_blocks  # the chain's last block is local
        part = find_partial(ns.bank.store, ns.root, hashes, toks, n_blocks, bs) if at_home else None
        if part is None and asked and remote is not None:  # fetched with the rest of the chain
            part = remote_partial(remote, ns, hashes, toks, n_blocks)
        if part is not None and end is not None and end.tokens >= part.tokens:
            part = None  # the end record covers as much (and may hold the logits)
        if part is not None:
            end = None
    capacity = -(-room_for // ROOM_STEP) * ROOM_STEP if room_for else 0
    # The one probe of memory: the deepest matched block a lease holds.
    leases = ns.bank.leases
    # A chain queued for the background writer counts too (attention-only models).
    queued = ns.bank.writer is not None and not hybrid and cont is None
    probed = hashes if queued else hashes[:n_blocks]
    leased, in_memory = leases.probe(probed) if leases and probed else (0, [])
    if end is not None and leased > end.blocks:
        end, n_blocks = None, restore_blocks(matched, hybrid)  # the chain goes deeper
    if part is not None and leased > part.blocks:
        part = None  # the chain goes deeper (queued for the writer)
    n_blocks = max(n_blocks, leased)
    if end is not None:
        capacity = max(capacity, end.tokens)
    if part is not None:
        capacity = max(capacity, part.tokens)
    assembler: Assembler | None = None
    along: StateRead | None = None
    looked_up = allocated = time.perf_counter()
    # All in memory: handed out as they are (no copy), unless the caller wants room
    # after them and MLX computes on the CPU. Then its cache must own its buffers, and
    # mlx-lm's first update would copy the prefix whole to write after it, on one core
    # (~4x slower than `np.copyto` on two): copied here on two. A GPU makes that copy
    # faster than two CPU threads can, so there the lease is handed out.
    full = leased > 0 and leased == n_blocks
    reach = end.tokens if end is not None else part.tokens if part is not None else n_blocks * bs
    roomy = capacity > reach and copies_on_cpu()
    if full and not roomy:
        good, hot_hits = n_blocks, n_blocks
    elif full:
        assembler = Assembler(ns.spec, n_blocks, bs, capacity)
        allocated = time.perf_counter()
        assembler.put_arrays(in_memory, leased)
        good, hot_hits = n_blocks, n_blocks
    elif n_blocks:
        # The boundary state this restore ends on, read along with the blocks (a
        # state in memory or from an end record or the shared tier is not read).
        wanted = matched[n_blocks - 1] if hybrid and end is None and cont is None else None
        if wanted is not None and (
            not ns._payloads.state_in_file(wanted)
            or (leases is not None and leases.has_state(wanted.chain_hash))
        ):
            wanted = None
        assembler = Assembler(ns.spec, n_blocks, ns.block_size, capacity, state=wanted is not None)
        allocated = time.perf_counter()
        if leased:
            assembler.put_arrays(in_memory, leased)
        good, hot_hits, along = ns._payloads.assemble(
            matched[:n_blocks],
            assembler,
            leased,
            cont.blocks if cont is not None else None,
            state=wanted,
        )
        hot_hits += leased
    else:
        good, hot_hits = 0, 0
    if good < n_blocks:  # a payload failed: the restore point moves back
        n_blocks = restore_blocks(matched[:good], hybrid)
        end = part = None
    # The partial block's first tokens, verified (None: missing or corrupt, counted).
    part_arrays = read_partial(ns.spec, part, ns._payloads, ns.bank.counters) if part else None
    if part_arrays is None:
        part = None
    state: list[mx.array] | None = None
    state_leased = False
    if end is not None and hybrid:
        state = end.payload.state
    while hybrid and n_blocks and end is None:
        h = matched[n_blocks - 1]
        state = leases.state(h.chain_hash) if leases is not None else None
        if state is not None:
            state_leased = True
            break
        state = ns._payloads.read_state(h, cont.states if cont is not None else None, along)
        if state is not None:
            break
        n_blocks = restore_blocks(matched[: n_blocks - 1], hybrid)
    filled = time.perf_counter()

    covered = end.tokens if end is not None else part.tokens if part is not None else n_blocks * bs
    exact = end is not None and covered == len(toks)
    ns.bank.counters.count(
        restores=1,
        queried_tokens=len(toks),
        hit_tokens=covered,
        hits=1 if covered else 0,
        misses=0 if covered else 1,
        hot_hits=hot_hits,
        exact_hits=1 if exact else 0,
        end_hits=1 if end is not None and not exact else 0,
        partial_hits=1 if part is not None else 0,
        partial_tokens=part.shared if part is not None else 0,
    )
    end_remote = end is not None and cont is not None and cont.end is not None
    if cont is not None and remote is not None:  # counts it, writes it locally later
        remote.restored(ns, cont, n_blocks, state is not None, end=end_remote)
    if n_blocks:
        # Last uses stay in memory; written at most every access_flush_interval.
        # Blocks from the shared tier are not local yet: their local write records them;
        # a queued store's blocks (leased past the stored chain) are recorded by its write.
        local = min(n_blocks, len(matched) if cont is None else cont.start)
        state_at = (
            [hashes[n_blocks - 1]]
            if state is not None and local == n_blocks and end is None
            else []
        )
        ns.bank.access.touch(hashes[:local], state_at)
    if end is not None and not end_remote:  # a remote one: its local write records it
        ns.bank.access.touch((), ends=[end.header.parent])
    if part is not None and part.fetched is None:  # a local child was used (block or ends)
        child = part.child
        ns.bank.access.touch(*(([child.name],) if child.is_block else ((), (), [child.parent])))
    if covered and ns.bank.access.due():
        ns.bank.flush(wait=False)
    if not covered:
        _clocked(ns, started, looked_up, allocated, filled)
        return None
    n = n_blocks * bs
    finishing = time.perf_counter()  # the copies put off until now count as the fill
    if end is not None:
        kv = end_layers(ns.spec, end, assembler, in_memory, room=room_for > 0)
    elif part is not None and part_arrays is not None:
        kv = partial_layers(ns.spec, part, part_arrays, assembler, in_memory, room=room_for > 0)
    elif assembler is not None:
        kv = assembler.layers(n_blocks, room=room_for > 0)
        if leases is not None and not capacity:
            # Exact arrays: the first update copies them anyway, so keep them too.
            leases.put(hashes[:n_blocks], flat_attention(kv))
    else:
        kv = group_layers(ns.spec, [a[..., :n, :] for a in in_memory], None)
    if state is not None and leases is not None and not state_leased and end is None:
        # A boundary's state (an end record's is at its own position, not leased).
        leases.put_state(hashes[n_blocks - 1], state)
    if state is not None:
        kv = merge_layers(kv, group_layers(ns.spec, None, state))
    # Evaluated here: an unevaluated view (bf16, a trimmed slice) is bound to this
    # thread's MLX stream, and runtimes may restore on one thread and prefill on
    # another. Views share their buffers, so this copies nothing, except a lease's
    # blocks joined to an end record's tail (`end_layers`): part of the fill.
    logits = end.payload.logits if exact and end is not None else None
    hidden = end.payload.hidden if exact and end is not None else None
    mx.eval(kv, [a for a in (logits, hidden) if a is not None])
    filled += time.perf_counter() - finishing
    timings = _clocked(ns, started, looked_up, allocated, filled)
    return Hit(
        tokens=covered,
        layers=kv,
        blocks=hashes[:n_blocks],
        logits=logits,
        hidden=hidden,
        end=end is not None,
        partial=part.shared if part is not None else 0,
        timings=timings,
    )
