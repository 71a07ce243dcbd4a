"""`RemoteTier`: the shared Valkey tier behind a bank's local RocksDB.

Three things, each off the request's path where it can be:

- `continue_chain` (on the restoring thread): after the local lookup found `L` of the
  prompt's `N` blocks, continue the same chain from the cluster. Step 1, one
  pipelined round trip: the headers of blocks `L..N-1` (and, for a hybrid model,
  whether each has a state). The continuation is the run of headers that link to the
  local chain's end, carry the prompt's own tokens and pass their MAC; a hybrid model
  cuts it at the deepest block with a state. Step 2, one round trip per
  `remote_fetch_bytes` of payloads: the payloads (and the one state) it needs, each
  checked (MAC, then the codec's digest against its header) before it is used. Any
  entry that fails is a rejected miss: the chain stops before it, never with a hole.
- `publish` (from `Namespace.store`, after the local commit): queue the new blocks and
  states; a worker asks the cluster which are missing (one round trip) and writes
  those (one more). A full queue drops the publish and counts it.
- `restored` (after a restore used a continuation): count the hit, and queue the
  fetched blocks for a background write into the local bank, so the next restore of
  them is local.

And `purge` (from `Bank.revoke`, on the revoking thread): remove every key of some
namespaces from the cluster.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import numpy as np

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.store import Family
from cas_bank.errors import InvalidInputError
from cas_bank.index.chain import Header, longest_chain, read_headers
from cas_bank.index.continuation import ChainSpace, Continuation
from cas_bank.index.ends import with_check as end_with_check
from cas_bank.owner import Owner
from cas_bank.remote import ends, keys
from cas_bank.remote.children import child_entry, fetch_child
from cas_bank.remote.client import Purge, RemoteClient, tls_options
from cas_bank.remote.fetch import fetch_continuation
from cas_bank.remote.queue import WorkQueue

_REJECTED_KEPT = 4096  # chain hashes remembered as rejected (see `RemoteTier.reject`)

log = logging.getLogger("cas_bank.remote")

CLOSE_TIMEOUT = 10.0  # seconds `close` waits for queued publishes


@dataclass
class _Publish:
    root: bytes
    blocks: list[tuple[Header, bytes]]
    states: list[tuple[bytes, bytes]]
    ends: list[tuple[bytes, bytes, int]] = field(default_factory=list)  # key, value, header


@dataclass(slots=True)
class _Writes:
    """The commands of one publish; for each, the chain hash it writes for and whether
    it is the write that makes an entry (a header's, a state's, an end record's)."""

    cmds: list[tuple[Any, ...]] = field(default_factory=list)
    owners: list[bytes] = field(default_factory=list)
    counted: list[bool] = field(default_factory=list)

    def add(self, owner: bytes, cmd: tuple[Any, ...], counted: bool) -> None:
        self.cmds.append(cmd)
        self.owners.append(owner)
        self.counted.append(counted)


@dataclass
class _Adopt:
    continuation: Continuation
    n_blocks: int  # blocks the restore covered (local ones included)
    state: bool  # whether it used the continuation's state
    end: bool = False  # whether it resumed from the continuation's end record


def fleet_key(secret: str | None) -> bytes:
    """The MAC key: from the fleet secret alone (`BankConfig` refuses a shared tier
    without one; nothing of the cluster's URL or credentials enters the key)."""
    if not secret:
        raise InvalidInputError(
            "the shared tier needs remote_secret (cas-bank serve: $CAS_BANK_REMOTE_SECRET)"
        )
    return keys.mac_key(secret.encode())


def redact(url: str) -> str:
    """`url` without its password (in its user part or its query)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    hidden = [(k, "***" if k == "password" else v) for k, v in query]
    if parts.password is None and hidden == query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        netloc = f"{unquote(parts.username or '')}:***@{host}{port}"
    tail = f"?{urlencode(hidden, safe='*')}" if query else ""
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


class RemoteTier:
    def __init__(self, bank: Owner) -> None:
        cfg = bank.config
        assert cfg.remote is not None
        self.mkey = fleet_key(cfg.remote_secret)  # first: a refusal leaves nothing open
        self.bank = bank
        self.url = redact(cfg.remote)
        self.client = RemoteClient(
            cfg.remote,
            connect_timeout=cfg.remote_connect_timeout,
            timeout=cfg.remote_timeout,
            retry_after=cfg.remote_retry_after,
            count=bank.counters.count,
            tls=tls_options(cfg),
        )
        self.fetch_bytes = cfg.remote_fetch_bytes
        self.client_run = self.client.run
        self.publishes: WorkQueue[_Publish] = WorkQueue(
            "cas-bank-publish", self._publish, cfg.remote_queue_bytes
        )
        self.adoptions: WorkQueue[_Adopt] = WorkQueue(
            "cas-bank-adopt", self._adopt, cfg.remote_queue_bytes
        )
        # Chain hashes whose cluster entries this host rejected: its next publish of
        # them writes over what is there (a damaged entry is otherwise never replaced:
        # a publish skips what exists). The newest `_REJECTED_KEPT`; a stale one costs
        # one rewrite.
        self._rejected: OrderedDict[bytes, None] = OrderedDict()
        self._rejected_lock = threading.Lock()
        self.prefetched_blocks = 0  # written locally by `prefetch`

    # -- restore -------------------------------------------------------------------
    def continue_chain(
        self,
        ns: ChainSpace,
        toks: np.ndarray,
        hashes: Sequence[bytes],
        matched: Sequence[Header],
    ) -> Continuation | None:
        """The cluster's continuation of the local chain `matched`, verified, or None."""
        return fetch_continuation(self, ns, toks, hashes, matched)

    def partial_child(
        self, ns: ChainSpace, parent: bytes, index: int, after: bytes
    ) -> tuple[Header, codec.Decoded, int] | None:
        """The cluster's child of `parent` sharing the most of `after` (`remote.children`)."""
        return fetch_child(self, ns.root, parent, index, after)

    def reject(self, h: bytes, why: str) -> None:
        self.bank.counters.count(remote_rejected=1)
        log.warning("cas_bank remote entry %s rejected (%s): served as a miss", h.hex()[:16], why)
        with self._rejected_lock:
            self._rejected[bytes(h)] = None
            self._rejected.move_to_end(bytes(h))
            if len(self._rejected) > _REJECTED_KEPT:
                self._rejected.popitem(last=False)

    def restored(
        self, ns: ChainSpace, cont: Continuation, n_blocks: int, state: bool, *, end: bool = False
    ) -> None:
        """A restore covered `n_blocks` blocks using `cont` (and, `end`, resumed from its
        end record): count what came from the cluster and queue it for a background
        write into the local bank."""
        used = max(0, n_blocks - cont.start)
        used_state = state and cont.state_at is not None and cont.state_at == n_blocks - 1
        end = end and cont.end is not None
        if not used and not used_state and not end:
            return
        tail = cont.end.plan.header.tail_len if end and cont.end is not None else 0
        self.bank.counters.count(
            remote_hits=1, remote_hit_blocks=used, remote_hit_tokens=used * ns.block_size + tail
        )
        if self.bank.read_only:
            return
        nbytes = sum(len(v) for v in cont.raw.values())
        if not self.adoptions.submit(_Adopt(cont, n_blocks, used_state and not end, end), nbytes):
            self.bank.counters.count(remote_adopt_dropped=1)

    def prefetch(self, ns: ChainSpace, toks: np.ndarray, hashes: Sequence[BlockHash]) -> int:
        """Fetch the cluster's continuation of the local chain of `toks` (and its end
        record) and write it into the local bank now, on this thread, so that a restore
        of `toks` later is local: what a server does for a queued request while its
        worker serves another. The blocks written (0: nothing to fetch or none found).
        Nothing counts as a hit: the restore that follows is a local one."""
        if self.bank.read_only:
            return 0
        matched = longest_chain(self.bank.store, ns.root, hashes)
        cont = self.continue_chain(ns, toks, hashes, matched)
        if cont is None:
            return 0
        if cont.end is not None:
            n_blocks, state, end = cont.end.plan.blocks, False, True
        elif cont.state_at is not None:
            n_blocks, state, end = cont.state_at + 1, True, False
        else:
            n_blocks, state, end = len(cont.matched), False, False
        got = self._adopt(_Adopt(cont, n_blocks, state, end))
        self.prefetched_blocks += got
        return got

    def _adopt(self, job: _Adopt) -> int:
        """Write a continuation's used blocks (and state, or end record) into the local
        bank: one transaction, and only on top of a local chain still there (never a
        hole). The blocks written."""
        bank, cont = self.bank, job.continuation
        chain = cont.matched[: job.n_blocks]
        lo = min(cont.start, cont.state_at if job.state and cont.state_at is not None else 1 << 62)
        with bank.transaction() as tx:
            wanted = [h.chain_hash for h in chain[max(0, lo - 1) :]]
            current = read_headers(tx.store, wanted)
            if lo > 0 and current.pop(0) is None:
                tx.abort()  # the local chain below it was evicted since
                return 0
            adopted = 0
            whole = True  # every block of the chain is local now
            check = bank.payload_check  # another host's check may not be this bank's
            for header, old in zip(chain[lo:], current, strict=True):
                h = header.chain_hash
                take_state = job.state and header.index == cont.state_at
                state = None
                if take_state and (old is None or not old.has_state):
                    state = codec.with_check(cont.raw[(Family.STATES, h)], check)
                if old is None:
                    if (Family.BLOCKS, h) not in cont.raw:
                        whole = False
                        break  # a local block evicted since the restore: stop, no hole
                    payload = codec.with_check(cont.raw[(Family.BLOCKS, h)], check)
                    tx.put(Family.BLOCKS, h, payload)
                    tx.add(blocks=1, payload_bytes=header.payload_size)
                    adopted += 1
                    new = header._replace(payload_digest=codec.embedded_digest(payload))
                    new = new.with_state(None)
                elif state is None:
                    continue
                else:
                    new = old
                if state is not None:
                    new = new.with_state(codec.embedded_digest(state), len(state))
                    tx.put(Family.STATES, h, state)
                    tx.add(states=1, state_bytes=header.state_size)
                tx.put(Family.HEADERS, h, new.encode())
            if job.end and whole and cont.end is not None:
                _adopt_end(tx, cont.end.key, end_with_check(cont.end.key, cont.end.value, check))
            if not tx.writes:
                tx.abort()
                return 0
            tx.add(remote_adopted_blocks=adopted)
            tx.touch(
                [h.chain_hash for h in chain[lo:]], [chain[-1].chain_hash] if job.state else []
            )
        return adopted

    # -- store ---------------------------------------------------------------------
    def publish_end(self, root: bytes, key: bytes, value: bytes, header_len: int) -> None:
        """Queue an end record (its `ends` key and value; the end header's length)."""
        job = _Publish(root, [], [], [(key, value, header_len)])
        if not self.publishes.submit(job, len(value)):
            self.bank.counters.count(remote_dropped=1)

    def publish(
        self, root: bytes, blocks: list[tuple[Header, bytes]], states: list[tuple[bytes, bytes]]
    ) -> None:
        """Queue new blocks (header, payload) and states (chain hash, payload)."""
        if not blocks and not states:
            return
        nbytes = sum(len(p) for _, p in blocks) + sum(len(p) for _, p in states)
        job = _Publish(root, [(h.with_state(None), p) for h, p in blocks], states)
        if not self.publishes.submit(job, nbytes):
            self.bank.counters.count(remote_dropped=1)

    def _publish(self, job: _Publish) -> None:
        """Write what of `job` the cluster lacks (or holds where this host rejected it),
        in one round trip after one probe, and count what was written."""
        root = job.root
        block_keys = [
            (keys.key(root, h.chain_hash, "h"), keys.key(root, h.chain_hash, "p"))
            for h, _ in job.blocks
        ]
        state_keys = [keys.key(root, h, "s") for h, _ in job.states]
        end_keys = [ends.remote_key(root, k) for k, _, _ in job.ends]
        probe: list[tuple[object, ...]] = [("EXISTS", hk, pk) for hk, pk in block_keys]
        probe += [("EXISTS", sk) for sk in [*state_keys, *end_keys]]
        present = self.client.run(probe)
        if present is None:
            return
        # SET ... NX: two hosts that store the same block at once both see it absent, and
        # only the first write of each key lands (same key, same bytes: content-addressed).
        # An entry this host rejected is written over (no NX): these bytes are good.
        redo = self._to_redo(job)
        writes = _Writes()
        self._block_writes(job, block_keys, present, redo, writes)
        self._single_writes(job, state_keys, end_keys, present[len(block_keys) :], redo, writes)
        if not writes.cmds:
            return
        done = self.client.run(writes.cmds)
        if done is None:
            return
        self._published(redo, writes, done)

    def _to_redo(self, job: _Publish) -> set[bytes]:
        """The entries of `job` this host rejected from the cluster: written over."""
        with self._rejected_lock:
            redo = {h.chain_hash for h, _ in job.blocks} | {h for h, _ in job.states}
            redo |= {k[32:] for k, _, _ in job.ends}  # an end record's name
            redo &= self._rejected.keys()
        return redo

    def _block_writes(
        self,
        job: _Publish,
        block_keys: list[tuple[bytes, bytes]],
        present: Sequence[Any],
        redo: set[bytes],
        writes: _Writes,
    ) -> None:
        """A block's payload, header and child entry, unless both are there already."""
        for (header, payload), (hk, pk), have in zip(job.blocks, block_keys, present, strict=False):
            if have == 2 and header.chain_hash not in redo:
                continue
            h = header.chain_hash
            nx = () if h in redo else ("NX",)
            # The payload first: a reader that sees the header finds the payload.
            writes.add(h, ("SET", pk, keys.seal_payload(self.mkey, pk, payload), *nx), False)
            writes.add(h, ("SET", hk, keys.seal_header(self.mkey, hk, header.encode()), *nx), True)
            writes.add(h, child_entry(job.root, header), False)  # partial blocks

    def _single_writes(
        self,
        job: _Publish,
        state_keys: list[bytes],
        end_keys: list[bytes],
        present: Sequence[Any],
        redo: set[bytes],
        writes: _Writes,
    ) -> None:
        """A state or an end record (one entry each), unless it is there already."""
        singles = [
            (h, sk, keys.seal_payload(self.mkey, sk, payload))
            for (h, payload), sk in zip(job.states, state_keys, strict=True)
        ]
        singles += [
            (k[32:], ek, ends.seal(self.mkey, ek, value, n))
            for (k, value, n), ek in zip(job.ends, end_keys, strict=True)
        ]
        for (h, k, entry), have in zip(singles, present, strict=True):
            if have == 1 and h not in redo:
                continue
            nx = () if h in redo else ("NX",)
            writes.add(h, ("SET", k, entry, *nx), True)

    def _published(self, redo: set[bytes], writes: _Writes, done: list[Any]) -> None:
        """After the writes answered: what was rewritten is no longer to be written over,
        and what landed is counted."""
        if redo:  # rewritten: no longer to be written over (a write that failed: still)
            failed = {o for o, a in zip(writes.owners, done, strict=True) if a is None}
            with self._rejected_lock:
                for h in redo - failed:
                    self._rejected.pop(h, None)
        # None: refused (a full node), not sent, or already written by another host.
        written = sum(
            len(c[2])
            for c, a in zip(writes.cmds, done, strict=True)
            if a is not None and c[0] == "SET"
        )
        self.bank.counters.count(
            remote_publishes=sum(1 for a, c in zip(done, writes.counted, strict=True) if c and a),
            remote_published_bytes=written,
        )

    # -- revocation ----------------------------------------------------------------
    def purge(self, roots: Collection[bytes], *, batch: int = 1000) -> Purge:
        """Remove every key of the namespaces `roots` from the cluster: each master
        SCANs for `cb1:<root 8 bytes hex>:*` (`keys.namespace_pattern`, which covers
        every kind a namespace writes: headers, payloads, states, children and end
        records, `ends.remote_key`) and UNLINKs what it finds in pipelines of at most
        `batch` (`RemoteClient.purge`). On the calling thread (and threads of its
        own), not the restoring path's; under the tier's time-outs and breakers, so a
        cluster that is down answers within them with `Purge.complete` False (and which
        masters), never hangs, never raises: purging again later finishes the job
        (what is gone stays gone).

        The pattern names a root by its first 8 bytes, as the keys do: another
        namespace whose root shares them (2^-64 for any two roots) would lose its
        entries too, which costs it misses and nothing else. Never a wrong hit: every
        entry's MAC covers its key, and what a restore takes is checked against the
        full root (a header's root and chain hash, an end record's root).

        Only the cluster: a host whose local bank holds the namespace serves its
        blocks itself and publishes what it stores anew; revoke every host's bank
        too (docs/design.md, "Eviction order", Tenants)."""
        patterns = [keys.namespace_pattern(r) for r in sorted(set(map(bytes, roots)))]
        done = self.client.purge(patterns, batch=batch)
        if patterns:
            log.log(
                logging.INFO if done.complete else logging.WARNING,
                "cas_bank remote tier: purged %d keys of %d namespaces from %d masters in %.3f s%s",
                done.keys,
                len(patterns),
                done.nodes,
                done.seconds,
                f"; not purged: {', '.join(done.failed)}" if done.failed else "",
            )
        return done

    # -- lifecycle -----------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Until every queued publish and local write is done (or `timeout`)."""
        self.publishes.wait(timeout)
        self.adoptions.wait(timeout)

    def close(self) -> None:
        self.publishes.close(CLOSE_TIMEOUT)
        self.adoptions.close(CLOSE_TIMEOUT)
        self.client.close()


def _adopt_end(tx: Any, key: bytes, value: bytes) -> None:
    """Write an end record fetched from the cluster into the local `ends` family (its
    parent block is local: adopted in the same transaction, or there already)."""
    if tx.store.get(Family.ENDS, key) is not None:
        return
    tx.put(Family.ENDS, key, value)
    tx.add(ends=1, end_bytes=len(value), ends_written=1, bytes_written=len(value))
    tx.touch((), ends=[key[:32]])
