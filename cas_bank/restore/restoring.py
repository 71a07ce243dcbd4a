"""The restore path of a `Namespace`: the longest stored prefix of a prompt as MLX arrays.

Every lookup reads one view of the bank (`index.view.ReadView`, taken as the restore
starts): the stores queued for the background writer in front of the written ones.
The walk: the stored chain of the prompt's full blocks (`index.chain.stored_chain`: its
prefix records, keyed by its tokens; past them its chain hashes and `longest_chain`:
chain records, then headers) -> the shared tier's continuation
(if any) -> an end record under the deepest matched block (`index.ends`) ->
`restore_blocks` (hybrid: deepest boundary with a state) -> one probe of memory (queued
chains and leases: a queued block is always there) ->
`restore.payloads` reads and verifies each payload -> `restore.assemble.Assembler` copies it
once into fresh MLX arrays (payload files straight into them, a hybrid boundary state
in a file with them) -> `Hit`.
docs/design.md, "Restore path", says why each step is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from cas_bank.arrays import HeldArrays
from cas_bank.blocks.hashing import BlockHash, as_token_array
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header, restore_blocks, stored_chain
from cas_bank.index.ends import EndPlan, end_key, plan_end
from cas_bank.index.partial import (
    PartialPlan,
    find_partial,
    remote_partial,
)
from cas_bank.index.view import ReadView, is_queued, read_view
from cas_bank.restore.assemble import Assembler
from cas_bank.restore.tails import end_layers, partial_layers, read_partial
from cas_bank.spec import flat_attention, group_layers, merge_layers
from cas_bank.stats import RestoreTimings

if TYPE_CHECKING:
    from cas_bank.index.continuation import Continuation
    from cas_bank.index.lease import Live
    from cas_bank.owner import Owner
    from cas_bank.restore.payloads import PayloadReader, StateRead
    from cas_bank.spec import ModelSpec

ROOM_STEP = 256  # mlx-lm's KVCache grows its buffers by this many tokens


@dataclass(frozen=True, slots=True)
class Hit:
    """A restore: `tokens` covered and per-layer arrays aligned with `spec.layers`."""

    tokens: int
    layers: list[tuple[Any, ...] | None]
    blocks: list[BlockHash] = field(repr=False)
    # From an end record (`index.ends`; on a live hit, the store that leased it): the
    # logits of token `tokens - 1` and the hidden state stored with them, when it held
    # them; None otherwise.
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


@dataclass(slots=True)
class _Plan:
    """What the lookups found: the prompt's chain, the matched part (local, continued
    from the shared tier), how many blocks a restore takes, and what resumes after
    them (an end record, or a partial block)."""

    view: ReadView
    toks: np.ndarray
    hashes: list[BlockHash]
    matched: list[Header]
    cont: Continuation | None
    asked: bool  # the chain went on past the local part: the shared tier was asked
    n_blocks: int
    end: EndPlan | None = None
    part: PartialPlan | None = None

    def covered(self, block_size: int) -> int:
        """Tokens the restore reaches."""
        if self.end is not None:
            return self.end.tokens
        return self.part.tokens if self.part is not None else self.n_blocks * block_size


@dataclass(slots=True)
class _Filled:
    """The fill of the destination arrays: `good` blocks placed (fewer than planned
    where a payload failed), `hot_hits` of them from memory, the boundary state read
    with them (`along`), and when the arrays were allocated (None: none were)."""

    assembler: Assembler | None = None
    good: int = 0
    hot_hits: int = 0
    along: StateRead | None = None
    allocated: float | None = None


def restore(ns: Restorable, tokens: Any, *, room_for: int = 0) -> Hit | None:
    """`Namespace.restore(tokens, room_for=room_for)` of `ns` (its docstring says what
    comes back)."""
    started = time.perf_counter()
    plan = _plan(ns, as_token_array(tokens))
    live = _live_hit(ns, plan, started, room_for)
    if live is not None:
        return live
    leased, in_memory, capacity = _probe_memory(plan, room_for)
    looked_up = time.perf_counter()
    filling = _fill(ns, plan, leased, in_memory, capacity)
    allocated = filling.allocated if filling.allocated is not None else looked_up
    if filling.good < plan.n_blocks:  # a payload failed: the restore point moves back
        plan.n_blocks = restore_blocks(plan.matched[: filling.good], ns.spec.is_hybrid)
        plan.end = plan.part = None
    # The partial block's first tokens, verified (None: missing or corrupt, counted).
    part = plan.part
    part_arrays = read_partial(ns.spec, part, ns._payloads, ns.bank.counters) if part else None
    if part_arrays is None:
        plan.part = None
    state, state_leased = _read_state(ns, plan, filling.along)
    filled = time.perf_counter()

    covered = plan.covered(ns.block_size)
    _account(ns, plan, covered, filling.hot_hits, state is not None)
    if not covered:
        _clocked(ns, started, looked_up, allocated, filled)
        return None
    finishing = time.perf_counter()  # the copies put off until now count as the fill
    kv = _layers(ns, plan, filling.assembler, in_memory, part_arrays, room_for, capacity)
    if state is not None:
        if ns.bank.leases is not None and not state_leased and plan.end is None:
            # A boundary's state (an end record's is at its own position, not leased).
            ns.bank.leases.put_state(plan.hashes[plan.n_blocks - 1], state)
        kv = merge_layers(kv, group_layers(ns.spec, None, state))
    # Evaluated here: an unevaluated view (bf16, a trimmed slice) is bound to this
    # thread's MLX stream, and runtimes may restore on one thread and prefill on
    # another. Views share their buffers, so this copies nothing, except a lease's
    # blocks joined to an end record's tail (`end_layers`): part of the fill.
    end = plan.end
    exact = end is not None and covered == len(plan.toks)
    logits = end.payload.logits if exact and end is not None else None
    hidden = end.payload.hidden if exact and end is not None else None
    mx.eval(kv, [a for a in (logits, hidden) if a is not None])
    if filling.assembler is not None:
        filling.assembler.handed_out()
    filled += time.perf_counter() - finishing
    timings = _clocked(ns, started, looked_up, allocated, filled)
    return Hit(
        tokens=covered,
        layers=kv,
        blocks=plan.hashes[: plan.n_blocks],
        logits=logits,
        hidden=hidden,
        end=end is not None,
        partial=plan.part.shared if plan.part is not None else 0,
        timings=timings,
    )


def _live_hit(ns: Restorable, plan: _Plan, started: float, room_for: int) -> Hit | None:
    """The conversation's live cache, where the end the plan resumes from was stored
    from it in this process and nothing has taken it since (`_take_live`): handed back
    with no byte copied, room and all where the caller asks for room, else as views of
    exactly its tokens (what `Namespace.restore` promises without room). With that
    store's own state, logits and hidden state."""
    live = _take_live(ns, plan)
    if live is None:
        return None
    looked_up = time.perf_counter()
    n = live.tokens
    kv: list[tuple[Any, ...] | None] = list(live.layers)
    if not room_for:  # views, no copy; evaluated below (bound to no thread's stream)
        kv = group_layers(ns.spec, [a[..., :n, :] for a in flat_attention(ns.spec, kv)], None)
    if ns.spec.is_hybrid:
        kv = merge_layers(kv, group_layers(ns.spec, None, live.state))
    exact = n == len(plan.toks)
    logits = live.logits if exact else None
    hidden = live.hidden if exact else None
    mx.eval(kv, [a for a in (logits, hidden) if a is not None])
    ns.bank.counters.count(live_hits=1)
    n_blocks = n // ns.block_size
    _account(ns, plan, n, n_blocks, ns.spec.is_hybrid)
    timings = _clocked(ns, started, looked_up, looked_up, time.perf_counter())
    return Hit(
        tokens=n,
        layers=kv,
        blocks=plan.hashes[:n_blocks],
        logits=logits,
        hidden=hidden,
        end=plan.end is not None,  # else the lease of a turn ended on the restore point
        timings=timings,
    )


def _take_live(ns: Restorable, plan: _Plan) -> Live | None:
    """The live lease of the end the plan resumes from (`Leases.take_live`): its end
    record's, or, where no record reaches past the chain's restore point and no partial
    block follows it, that of an end stored exactly there (a turn that ended on a block
    boundary). An exact repeat takes it only where it holds the logits and hidden state
    its record does (the one holding more is found), and a restore hands out the
    lease's own: never one store's logits beside another's state (`index.lease.Live`)."""
    leases, end = ns.bank.leases, plan.end
    if leases is None or plan.cont is not None:
        return None
    if end is not None:
        exact = end.tokens == len(plan.toks)
        header = end.header
        live = leases.take_live(
            header.key(),
            end.tokens,
            logits=exact and header.has_logits,
            hidden=exact and header.has_hidden,
        )
    elif plan.part is None and 0 < plan.n_blocks * ns.block_size < len(plan.toks):
        # (An exact repeat resumes from its record or not at all: its logits' rule.)
        boundary = end_key(plan.hashes[plan.n_blocks - 1], b"")
        live = leases.take_live(boundary, plan.n_blocks * ns.block_size)
    else:
        return None
    if live is None or (ns.spec.is_hybrid and live.state is None):
        return None
    return live


def _plan(ns: Restorable, toks: np.ndarray) -> _Plan:
    """The lookups: the longest stored chain of `toks`' blocks (continued from the
    shared tier where it ends locally), then an end record under its deepest block or
    a partial block after it."""
    view = read_view(ns.bank)
    try:  # the prefix records name a stored chain's blocks: no block hashed for them
        hashes, matched = stored_chain(view, ns.root, toks, ns.block_size)
    except CorruptDataError as e:  # a damaged headers table: a counted miss
        ns._payloads.damaged_headers(str(e))
        hashes, matched = ns.chain(toks), []
    # A chain ending in a queued block is not continued from the shared tier: what it
    # fetched would be written locally below a block that is not written yet.
    remote = ns.bank.remote if not (matched and is_queued(matched[-1])) else None
    hybrid = ns.spec.is_hybrid
    # The shared tier continues the local chain where it ends (verified, in memory).
    asked = remote is not None and len(matched) < len(hashes)  # the chain goes on there
    cont = remote.continue_chain(ns, toks, hashes, matched) if asked and remote else None
    if cont is not None:
        matched = cont.matched
    plan = _Plan(view, toks, hashes, matched, cont, asked, restore_blocks(matched, hybrid))
    if cont is None:
        # An end record under the deepest matched block (index.ends): an exact repeat,
        # or a prompt that extends a stored one past the chain's restore point.
        plan.end = plan_end(
            view,
            ns.spec,
            ns.root,
            hashes,
            toks,
            len(matched),
            ns.block_size,
            plan.n_blocks * ns.block_size,
            ns.bank.counters,
        )
        if plan.end is not None:
            plan.n_blocks = plan.end.blocks
        elif remote is not None and (plan.n_blocks < len(matched) or len(matched) == len(hashes)):
            # A hybrid model whose local blocks go past its deepest local state, or a
            # chain all local (and no local end record reaches further): the shared
            # tier may hold a deeper state over them, or the end record another host
            # stored.
            cont = remote.continue_chain(ns, toks, hashes, matched)
            if cont is not None:
                plan.cont, plan.matched = cont, cont.matched
                plan.n_blocks = restore_blocks(cont.matched, hybrid)
    if cont is not None and cont.end is not None:  # an end record from the shared tier
        plan.end = cont.end.plan
        plan.n_blocks = plan.end.blocks
    if not hybrid and plan.n_blocks == len(plan.matched) and ns.bank.config.partial_blocks:
        _add_partial(ns, plan)
    return plan


def _add_partial(ns: Restorable, plan: _Plan) -> None:
    """A partial block: the stored child of the last matched block sharing the most of
    the prompt's next tokens (attention-only: a state exists only where captured),
    where it reaches further than the end record found."""
    remote = ns.bank.remote
    n = plan.n_blocks
    at_home = plan.cont is None or plan.cont.start == n  # the chain's last block is local
    part = (
        find_partial(plan.view, ns.root, plan.hashes, plan.toks, n, ns.block_size)
        if at_home
        else None
    )
    if part is None and plan.asked and remote is not None:  # fetched with the rest
        part = remote_partial(remote, ns, plan.hashes, plan.toks, n)
    if part is not None and plan.end is not None and plan.end.tokens >= part.tokens:
        part = None  # the end record covers as much (and may hold the logits)
    if part is not None:
        plan.end = None
    plan.part = part


def _probe_memory(plan: _Plan, room_for: int) -> tuple[int, HeldArrays, int]:
    """The one probe of memory: how many of the planned blocks a queued chain or a
    lease holds and their arrays (every queued block among them: `index.view`), and
    the tokens the destination arrays hold (`room_for` rounded up to `ROOM_STEP`)."""
    capacity = -(-room_for // ROOM_STEP) * ROOM_STEP if room_for else 0
    probed = plan.hashes[: plan.n_blocks]
    leased, in_memory = plan.view.held_blocks(probed) if probed else (0, HeldArrays(()))
    if plan.end is not None:
        capacity = max(capacity, plan.end.tokens)
    if plan.part is not None:
        capacity = max(capacity, plan.part.tokens)
    return leased, in_memory, capacity


def _fill(
    ns: Restorable, plan: _Plan, leased: int, in_memory: HeldArrays, capacity: int
) -> _Filled:
    """The planned blocks into destination arrays of `capacity` tokens: leased ones
    copied, the rest read and verified (with the boundary state a hybrid restore ends
    on, where it is in a file)."""
    n_blocks, bs = plan.n_blocks, ns.block_size
    # All in memory: handed out as they are (no copy), unless the caller wants room
    # after them and MLX computes on the CPU. Then its cache must own its buffers, and
    # mlx-lm's first update would copy the prefix whole to write after it, on one core
    # (~4x slower than `np.copyto` on two): copied here on two. A GPU makes that copy
    # faster than two CPU threads can, so there the lease is handed out.
    full = leased > 0 and leased == n_blocks
    roomy = capacity > plan.covered(bs) and copies_on_cpu()
    if full and not roomy:
        return _Filled(good=n_blocks, hot_hits=n_blocks)
    if full:
        assembler = Assembler(
            ns.spec, n_blocks, bs, capacity, lease=in_memory, resources=ns.bank.resources
        )
        allocated = time.perf_counter()
        assembler.put_arrays(in_memory, leased)
        return _Filled(assembler, n_blocks, n_blocks, None, allocated)
    if not n_blocks:
        return _Filled()
    # The boundary state this restore ends on, read along with the blocks (a state in
    # memory or from an end record or the shared tier is not read).
    cont = plan.cont
    hybrid_end = ns.spec.is_hybrid and plan.end is None and cont is None
    wanted = plan.matched[n_blocks - 1] if hybrid_end else None
    if wanted is not None and (
        plan.view.holds_state(wanted.chain_hash) or not ns._payloads.state_in_file(wanted)
    ):
        wanted = None
    assembler = Assembler(
        ns.spec, n_blocks, bs, capacity, state=wanted is not None, resources=ns.bank.resources
    )
    allocated = time.perf_counter()
    if leased:
        assembler.put_arrays(in_memory, leased)
    good, hot_hits, along = ns._payloads.assemble(
        plan.matched[:n_blocks],
        assembler,
        leased,
        cont.blocks if cont is not None else None,
        state=wanted,
    )
    return _Filled(assembler, good, hot_hits + leased, along, allocated)


def _read_state(
    ns: Restorable, plan: _Plan, along: StateRead | None
) -> tuple[list[mx.array] | None, bool]:
    """A hybrid model's recurrent state where the restore ends, and whether memory held
    it: an end record's own, else the deepest boundary's (queued or leased, read along
    with the blocks, or read now; a missing one moves the restore point back)."""
    if not ns.spec.is_hybrid:
        return None, False
    if plan.end is not None:
        return plan.end.payload.state, False
    cont = plan.cont
    while plan.n_blocks:
        h = plan.matched[plan.n_blocks - 1]
        state = plan.view.held_state(h.chain_hash)
        if state is not None:
            return state, True
        if is_queued(h):  # its state is queued with it: never read from a file
            plan.n_blocks = restore_blocks(plan.matched[: plan.n_blocks - 1], True)
            continue
        state = ns._payloads.read_state(h, cont.states if cont is not None else None, along)
        if state is not None:
            return state, False
        plan.n_blocks = restore_blocks(plan.matched[: plan.n_blocks - 1], True)
    return None, False


def _account(ns: Restorable, plan: _Plan, covered: int, hot_hits: int, state: bool) -> None:
    """Count the restore, tell the shared tier what of its continuation was used, and
    record the last uses of the local blocks, state, end record or partial child."""
    end, part, cont, n_blocks = plan.end, plan.part, plan.cont, plan.n_blocks
    exact = end is not None and covered == len(plan.toks)
    ns.bank.counters.count(
        restores=1,
        queried_tokens=len(plan.toks),
        hit_tokens=covered,
        hits=1 if covered else 0,
        misses=0 if covered else 1,
        hot_hits=hot_hits,
        exact_hits=1 if exact else 0,
        end_hits=1 if end is not None and not exact else 0,
        partial_hits=1 if part is not None else 0,
        partial_tokens=part.shared if part is not None else 0,
    )
    remote = ns.bank.remote
    end_remote = end is not None and cont is not None and cont.end is not None
    if cont is not None and remote is not None:  # counts it, writes it locally later
        remote.restored(ns, cont, n_blocks, state, end=end_remote)
    access = ns.bank.access
    if n_blocks:
        # Last uses stay in memory; written at most every access_flush_interval.
        # Blocks from the shared tier are not local yet: their local write records them;
        # a queued store's blocks are recorded by its write.
        local = min(n_blocks, len(plan.matched) if cont is None else cont.start)
        if local and is_queued(plan.matched[local - 1]):  # queued headers end a chain
            local = next(i for i, h in enumerate(plan.matched[:local]) if is_queued(h))
        at_state = state and local == n_blocks and end is None
        access.touch(plan.hashes[:local], [plan.hashes[n_blocks - 1]] if at_state else [])
    if end is not None and not end_remote and not end.queued:  # else its write records it
        access.touch((), ends=[end.header.parent])
    if part is not None and part.fetched is None and not part.queued:  # a local child used
        child = part.child
        access.touch(*(([child.name],) if child.is_block else ((), (), [child.parent])))
    if covered and access.due():
        ns.bank.flush(wait=False)


def _layers(
    ns: Restorable,
    plan: _Plan,
    assembler: Assembler | None,
    in_memory: list[mx.array],
    part_arrays: list[np.ndarray] | None,
    room_for: int,
    capacity: int,
) -> list[tuple[Any, ...] | None]:
    """The restored attention layers: the blocks, with an end record's or a partial
    block's tail after them; exact arrays of blocks read are leased too."""
    room = room_for > 0
    if plan.end is not None:
        return end_layers(ns.spec, plan.end, assembler, in_memory, room=room)
    if plan.part is not None and part_arrays is not None:
        return partial_layers(ns.spec, plan.part, part_arrays, assembler, in_memory, room=room)
    n_blocks = plan.n_blocks
    if assembler is None:
        n = n_blocks * ns.block_size
        return group_layers(ns.spec, [a[..., :n, :] for a in in_memory], None)
    kv = assembler.layers(n_blocks, room=room)
    if ns.bank.leases is not None and not capacity:
        # Exact arrays: the first update copies them anyway, so keep them too.
        ns.bank.leases.put(plan.hashes[:n_blocks], flat_attention(ns.spec, kv))
    return kv
