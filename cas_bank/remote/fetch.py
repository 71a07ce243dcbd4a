"""Continuing a chain from the shared tier, on the restoring thread.

After the local lookup found `L` of the prompt's `N` blocks:

1. One pipelined round trip: the headers of blocks `L..N-1`; for a hybrid model also
   whether a state exists at each block from the deepest local state on. The
   continuation is the run of headers that pass their MAC, link to the local chain's
   end (parent, index, root) and carry the prompt's own tokens. A hybrid model then
   stops at the deepest block with a state (a local block's, when the cluster has a
   state deeper than any local one but no further blocks).
2. One round trip per `remote_fetch_bytes` of payloads: the payloads it needs and the
   state at its end, each checked (MAC over its digest, then the codec's digest
   against its header) before use.

An entry that is absent is a miss; one that fails a check is a rejected miss
(`remote_rejected`). Either way the chain stops before it, never with a hole, and a
hybrid continuation without its state is dropped whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from cas_bank.blocks import codec
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header
from cas_bank.index.continuation import ChainSpace, Continuation, FetchedEnd
from cas_bank.owner import Owner
from cas_bank.remote import ends, keys
from cas_bank.remote.client import RemoteClient


class FetchingTier(Protocol):
    """What fetching needs of `RemoteTier`: its client, MAC key, limits, counters."""

    client: RemoteClient
    mkey: bytes
    fetch_bytes: int
    bank: Owner

    def reject(self, chain_hash: bytes, why: str) -> None: ...


def fetch_continuation(
    tier: FetchingTier,
    ns: ChainSpace,
    toks: np.ndarray,
    hashes: Sequence[bytes],
    matched: Sequence[Header],
) -> Continuation | None:
    """The local chain `matched` continued from the shared tier, its payloads (and a
    hybrid model's state or end record) fetched and checked (see the module); None when
    the cluster adds nothing usable or cannot be asked."""
    start, root, hybrid = len(matched), ns.root, ns.spec.is_hybrid
    rest = list(hashes[start:])
    # A hybrid model: a state from the cluster is worth asking for past the local one.
    local_state = next((i + 1 for i in range(start - 1, -1, -1) if matched[i].has_state), 0)
    # The end records under the prompt's last full block, asked at once: an exact
    # repeat finds its own there (the chain continues to that block).
    whole = ends.candidates(root, hashes[-1] if hashes else root, toks, len(hashes), ns.block_size)
    answers = _ask_chain(tier, root, rest, hashes[local_state:] if hybrid else [], whole)
    if answers is None:
        return None
    fetched = sum(len(a) for a in answers if isinstance(a, bytes))
    remote = _linked(tier, ns, toks, rest, answers[: len(rest)], matched)
    end = start + len(remote)  # blocks the chain now covers
    found: list[int] = []
    if hybrid:
        exists = answers[len(rest) : len(answers) - len(whole)]
        found = [local_state + j for j in range(end - local_state) if exists[j]]
    floor = (found[-1] + 1 if found else local_state) if hybrid else end
    rend = _end_record(tier, ns, toks, hashes, end, whole, answers[len(answers) - len(whole) :])
    if rend is not None and rend.plan.tokens <= floor * ns.block_size:
        rend = None if rend.plan.tokens != len(toks) else rend
    state_at: int | None = None
    if hybrid and rend is None:
        if not found:
            tier.bank.counters.count(remote_bytes_fetched=fetched)
            return None
        state_at = found[-1]
        remote = remote[: max(0, state_at + 1 - start)]
    cont = Continuation(start, list(matched) + remote)
    cont.end = rend
    fetched += _fetch_payloads(tier, root, hashes, remote, state_at, cont)
    tier.bank.counters.count(remote_bytes_fetched=fetched)
    return _verified(cont, remote, start, hybrid)


def _ask_chain(
    tier: FetchingTier,
    root: bytes,
    rest: Sequence[bytes],
    state_blocks: Sequence[bytes],
    whole: Sequence[tuple[bytes, bytes]],
) -> list[Any] | None:
    """One pipelined round trip: the headers of `rest`, whether a state exists at each
    of `state_blocks`, and the end records `whole`; None when no node could be asked."""
    cmds: list[tuple[Any, ...]] = [("GET", keys.key(root, h, "h")) for h in rest]
    cmds += [("EXISTS", keys.key(root, h, "s")) for h in state_blocks]
    cmds += [("GET", k) for _, k in whole]
    return tier.client.run(cmds)


def _fetch_payloads(
    tier: FetchingTier,
    root: bytes,
    hashes: Sequence[bytes],
    remote: list[Header],
    state_at: int | None,
    cont: Continuation,
) -> int:
    """Fetch `remote`'s payloads into `cont`, a window of `tier.fetch_bytes` a round
    trip, with the state at block `state_at` (if any) in the last one; stops at the
    first that is missing or fails its check. Returns the bytes fetched."""
    fetched, b, ok = 0, 0, True
    while ok and (b < len(remote) or (b == 0 and state_at is not None)):
        e, size = b, 0  # a window of payloads, one round trip
        while e < len(remote) and (e == b or size + remote[e].payload_size <= tier.fetch_bytes):
            size += remote[e].payload_size
            e += 1
        window = remote[b:e]
        cmds = [("GET", keys.key(root, h.chain_hash, "p")) for h in window]
        last = e == len(remote)
        if last and state_at is not None:
            cmds.append(("GET", keys.key(root, hashes[state_at], "s")))
        got = tier.client.run(cmds)
        if got is None:
            break
        fetched += sum(len(a) for a in got if isinstance(a, bytes))
        ok = _take_blocks(tier, root, window, got, cont) == len(window)
        if ok and last and state_at is not None:
            ok = _take_state(tier, root, state_at, got[-1], cont)
        b = e
        if last:
            break
    return fetched


def _verified(
    cont: Continuation, remote: list[Header], start: int, hybrid: bool
) -> Continuation | None:
    """`cont` cut to the blocks whose payloads arrived and checked out (a hybrid one
    whole or not at all), or None when that adds nothing."""
    n_ok = sum(1 for h in remote if h.chain_hash in cont.blocks)  # a verified prefix
    if n_ok < len(remote):
        cont.end = None  # its blocks are not all there
    if hybrid:  # KV without the state (or end record) at its end restores nothing more
        whole_kv = n_ok == len(remote)
        return cont if whole_kv and (cont.state_at is not None or cont.end) else None
    cont.matched = cont.matched[: start + n_ok]
    return cont if n_ok or cont.end else None


def _end_record(
    tier: FetchingTier,
    ns: ChainSpace,
    toks: np.ndarray,
    hashes: Sequence[bytes],
    end: int,
    whole: Sequence[tuple[bytes, bytes]],
    whole_answers: Sequence[object],
) -> FetchedEnd | None:
    """The deepest verified end record under block `end - 1` of the chain: from the
    answers already there when the chain reached the prompt's last block, else (a
    hybrid model, whose next turn resumes only from one) one more round trip."""
    root, bs = ns.root, ns.block_size
    if end == len(hashes):
        return ends.pick(tier, ns.spec, root, whole, whole_answers, bs)
    if not ns.spec.is_hybrid:
        return None
    cands = ends.candidates(root, hashes[end - 1] if end else root, toks, end, bs)
    got = tier.client.run([("GET", k) for _, k in cands]) if cands else None
    if got is None:
        return None
    tier.bank.counters.count(remote_bytes_fetched=sum(len(a) for a in got if isinstance(a, bytes)))
    return ends.pick(tier, ns.spec, root, cands, got, bs)


def _linked(
    tier: FetchingTier,
    ns: ChainSpace,
    toks: np.ndarray,
    rest: list[bytes],
    answers: Sequence[object],
    matched: Sequence[Header],
) -> list[Header]:
    """The leading headers that pass their MAC and continue the local chain."""
    bs, root, start = ns.block_size, ns.root, len(matched)
    parent = matched[-1].chain_hash if matched else root
    out: list[Header] = []
    for j, (h, raw) in enumerate(zip(rest, answers, strict=True)):
        if not isinstance(raw, bytes):
            break  # absent (never published, or evicted): a miss
        i = start + j
        try:
            header = Header.decode(h, keys.open_header(tier.mkey, keys.key(root, h, "h"), raw))
        except CorruptDataError as e:
            tier.reject(h, str(e))
            break
        if (
            header.parent != parent
            or header.index != i
            or header.root != root
            or header.tokens != toks[i * bs : (i + 1) * bs].tobytes()
            or header.has_state
        ):
            tier.reject(h, "header does not continue this chain")
            break
        out.append(header)
        parent = h
    return out


def _take_blocks(
    tier: FetchingTier, root: bytes, window: list[Header], got: Sequence[object], cont: Continuation
) -> int:
    for n, (header, raw) in enumerate(zip(window, got, strict=False)):
        h = header.chain_hash
        if not isinstance(raw, bytes):
            return n  # evicted since its header was read: the chain stops here
        try:
            payload = keys.open_payload(tier.mkey, keys.key(root, h, "p"), raw)
            if len(payload) != header.payload_size:
                raise CorruptDataError("payload size differs from its header")
            cont.blocks[h] = codec.decode(payload, header.payload_digest)
        except CorruptDataError as e:
            tier.reject(h, str(e))
            return n
        cont.raw[(Family.BLOCKS, h)] = payload
    return len(window)


def _take_state(tier: FetchingTier, root: bytes, at: int, raw: object, cont: Continuation) -> bool:
    header = cont.matched[at]
    h = header.chain_hash
    if not isinstance(raw, bytes):
        return False
    try:
        payload = keys.open_payload(tier.mkey, keys.key(root, h, "s"), raw)
        digest = codec.embedded_digest(payload)
        cont.states[h] = codec.decode(payload, digest)
    except CorruptDataError as e:
        tier.reject(h, str(e))
        return False
    cont.raw[(Family.STATES, h)] = payload
    cont.matched[at] = header.with_state(digest, len(payload))
    cont.state_at = at
    return True
