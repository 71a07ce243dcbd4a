"""Reading payloads for a restore: hot tier first, then the store, every payload
checked against its header's digest, big chains read one block ahead.

A payload that is missing under its header or fails its digest is a miss that is
counted (`corrupt_reads`), marked suspect (the next store of it rewrites it) and
logged, never an exception in the runtime's face and never wrong data.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import mlx.core as mx

from cas_bank.blocks import codec
from cas_bank.blocks.files import FileTier, stub_of
from cas_bank.blocks.readahead import ReadAhead, worth_reading_ahead
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header, read_headers
from cas_bank.index.layout import decode_state
from cas_bank.restore.assemble import Assembler
from cas_bank.restore.file_read import BlockFiles, Job, read_files, read_plain_blocks
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.blocks.hot import HotStore
    from cas_bank.stats import Counters
    from cas_bank.write.txn import Suspects

# A payload decoded and verified, None if absent, or why it failed; and whether it was hot.
_Fetched = tuple[codec.Decoded | CorruptDataError | None, bool]

# A boundary state read along with a restore's blocks: (chain hash, its arrays).
StateRead = tuple[bytes, list[mx.array]]

log = logging.getLogger("cas_bank")

# A header's fields, taken by C-level maps (a restore's every block, at once).
_CHAIN_HASH = attrgetter("chain_hash")
_PAYLOAD_SIZE = attrgetter("payload_size")
_PAYLOAD_DIGEST = attrgetter("payload_digest")


class PayloadReader:
    """Reads and verifies one namespace's block and state payloads.

    Collaborators: the `store` read from (and the `hot` tier in it, if any), the
    `counters` that count hot hits and corrupt reads, the `suspects` a corrupt read
    marks.
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: BlockStore,
        hot: HotStore | None,
        counters: Counters,
        suspects: Suspects,
        files: FileTier | None = None,
    ) -> None:
        self.spec = spec
        self.files = files
        self.store = store
        self.hot = hot
        self.counters = counters
        self.suspects = suspects

    def assemble(
        self,
        headers: Sequence[Header],
        assembler: Assembler,
        first: int = 0,
        fetched: Mapping[bytes, codec.Decoded] | None = None,
        state: Header | None = None,
    ) -> tuple[int, int, StateRead | None]:
        """Reads, verifies and copies the payloads of `headers[first:]` in order, up to
        the first missing or corrupt one; returns (blocks assembled, counting the
        `first` ones the caller put in, hot-tier hits, and the state read along).

        `fetched`: payloads already read and verified elsewhere (the shared tier's
        continuation of the chain), by chain hash; they follow the local ones.
        `state`: a header whose boundary state the restore will want: a state in a
        payload file is then read along with the blocks, on the same two cores, for
        `read_state` (verified; None if it was not read this way or failed: `read_state`
        then reads it the usual way and counts what is wrong with it).
        """
        remote = fetched or {}
        n_local = next((n for n, h in enumerate(headers) if h.chain_hash in remote), len(headers))
        good, hot_hits, along = self._assemble_local(headers[:n_local], assembler, first, state)
        if good < n_local:
            return good, hot_hits, along
        for i in range(max(n_local, first), len(headers)):
            key = headers[i].chain_hash
            block = remote.get(key)
            if block is None:
                return i, hot_hits, along
            try:
                assembler.put(i, block, later=True)
            except CorruptDataError as e:  # MAC'd, but not this model's layout
                self.counters.count(remote_rejected=1)
                log.warning("cas_bank: remote block %s rejected (%s)", key.hex()[:16], e)
                return i, hot_hits, along
        return len(headers), hot_hits, along

    def _assemble_local(
        self,
        headers: Sequence[Header],
        assembler: Assembler,
        first: int = 0,
        state: Header | None = None,
    ) -> tuple[int, int, StateRead | None]:
        """`assemble` of payloads stored in this bank.

        Payloads in the file tier are read, verified and copied into the arrays by `fastread`,
        on two threads; the others one by one, hot tier first.
        """
        files = self.files
        if files is None or not assembler.direct or len(headers) <= first:
            return (*self._assemble_each(headers, assembler, first), None)
        blocks = assembler.block_files()
        state_job = self._state_file(state, assembler) if state is not None else None
        located: Collection[int]
        results = self._read_plain(headers, first, blocks, state_job)
        if results is not None:  # every block a plain file of the layout, one native call
            located = range(first, len(headers))
        else:
            # Only payloads of the tier's size can be files: the others are not read
            # twice. Each file is named by its header (`FileTier.name`: the key and the
            # digest), so the payload records are not read first: a header commits in
            # the same batch as its payload's record, and the file is checked against
            # the header's digest. The records are read only for the files that are not
            # there (`_unfound`).
            names = {
                i: files.name(Family.BLOCKS, h.chain_hash, h.payload_digest)
                for i, h in enumerate(headers)
                if i >= first and h.payload_size >= files.min_bytes
            }
            if not names:
                return (*self._assemble_each(headers, assembler, first), None)
            jobs: list[tuple[BlockFiles, Job]] = [
                (blocks, (i, name, headers[i].payload_size, headers[i].payload_digest))
                for i, name in names.items()
            ]
            if state_job is not None:  # first: the largest file, the one to start early
                jobs.insert(0, state_job)
            results, located = read_files(jobs), names
        along: StateRead | None = None
        if state is not None and state_job is not None:
            if results[0] is None:
                along = (state.chain_hash, assembler.state_arrays())
            results = results[1:]
        if isinstance(located, range) and not any(results):
            return len(headers), 0, along  # all read and verified
        keys = [h.chain_hash for h in headers]
        failed: dict[int, str | None] = dict(zip(located, results, strict=True))
        try:
            kept = self._unfound(headers, keys, failed)
        except CorruptDataError:  # RocksDB's own checks, on a record kept in it
            return (*self._assemble_each(headers, assembler, first), along)
        if kept and len(kept) == len(located):  # no payload is a file (a format-1 bank)
            return (*self._assemble_each(headers, assembler, first), along)
        hot_hits = 0
        for i, header in enumerate(headers):
            if i < first:
                continue
            why = failed.get(i, "not a file")
            if why is None:
                continue
            missing = why.startswith("payload file missing")  # the native reader adds errno
            if missing and self._evicted(Family.BLOCKS, keys[i]):
                return i, hot_hits, along
            if why not in ("not a file", "not a plain payload"):
                self._corrupt(Family.BLOCKS, keys[i], why)
                return i, hot_hits, along
            # Kept in the database, or compressed: decode it and copy it in.
            if i in kept:
                try:
                    value: codec.Decoded | CorruptDataError | None = codec.decode(
                        kept[i], header.payload_digest
                    )
                except CorruptDataError as e:
                    value = e
            else:
                value, from_hot = self._fetch(Family.BLOCKS, keys[i], header.payload_digest)
                hot_hits += from_hot
            block = self._verified(Family.BLOCKS, keys[i], value)
            if block is None:
                return i, hot_hits, along
            try:
                assembler.put(i, block)
            except CorruptDataError as e:
                self._corrupt(Family.BLOCKS, keys[i], str(e))
                return i, hot_hits, along
        return len(headers), hot_hits, along

    def _read_plain(
        self,
        headers: Sequence[Header],
        first: int,
        blocks: BlockFiles,
        state_job: tuple[BlockFiles, Job] | None,
    ) -> list[str | None] | None:
        """`read_files` of the state job (first) and of blocks `first`.. in one native
        call (`fastread.read_plain_blocks`), when every one of them is a plain payload
        file of `blocks`' layout (what a bank of this layout writes); None otherwise."""
        files = self.files
        tail = headers[first:]
        if files is None or blocks.file_len < files.min_bytes:
            return None
        if set(map(_PAYLOAD_SIZE, tail)) != {blocks.file_len}:
            return None
        keys = b"".join(map(_CHAIN_HASH, tail))
        digests = b"".join(map(_PAYLOAD_DIGEST, tail))
        prefix = files.prefix(Family.BLOCKS)
        return read_plain_blocks(blocks, prefix, keys, digests, first, state_job)

    def _unfound(
        self, headers: Sequence[Header], keys: Sequence[bytes], failed: dict[int, str | None]
    ) -> dict[int, bytes]:
        """What the records say of the payload files `read_files` did not find (in
        `failed`, rewritten in place): a record naming another payload is damage, a
        payload kept in the database (a format-1 bank's) is returned to be decoded, and
        a record naming this very file leaves it missing."""
        files = self.files
        assert files is not None
        unfound = [i for i, why in failed.items() if why and why.startswith("payload file missing")]
        if not unfound:
            return {}
        kept: dict[int, bytes] = {}
        raws = files.get_raw(Family.BLOCKS, [keys[i] for i in unfound])
        for i, raw in zip(unfound, raws, strict=True):
            h = headers[i]
            if raw is None:
                failed[i] = "not a file"  # read the usual way: evicted, or missing
            elif stub_of(raw) is None:
                kept[i], failed[i] = raw, "not a file"
            elif (
                files.file_of(Family.BLOCKS, keys[i], raw, h.payload_digest, h.payload_size) is None
            ):
                failed[i] = "payload record does not match its header"
        return kept

    def _assemble_each(
        self, headers: Sequence[Header], assembler: Assembler, first: int = 0
    ) -> tuple[int, int]:
        """`assemble` one payload at a time through the store (and the hot tier).

        From the first payload read from the store on, if enough bytes remain, the rest
        are read and verified on a background thread one block ahead (`ReadAhead`)
        while this one copies.
        """
        items = [(h.chain_hash, h.payload_digest) for h in headers]
        hot_hits = 0
        ahead: ReadAhead[tuple[bytes, bytes], _Fetched] | None = None
        results: Iterator[_Fetched] | None = None
        i = first
        try:
            for i, (key, expected) in enumerate(items):
                if i < first:
                    continue
                if results is None:
                    value, from_hot = self._fetch(Family.BLOCKS, key, expected)
                    if not from_hot and worth_reading_ahead(
                        [h.payload_size for h in headers[i + 1 :]]
                    ):
                        ahead = ReadAhead(self._fetch_block, items[i + 1 :], depth=1)
                        results = iter(ahead)
                else:
                    value, from_hot = next(results)
                hot_hits += from_hot
                block = self._verified(Family.BLOCKS, key, value)
                if block is None:
                    break
                try:
                    assembler.put(i, block, later=from_hot)
                except CorruptDataError as e:
                    self._corrupt(Family.BLOCKS, key, str(e))
                    break
            else:
                i = len(items)
        finally:
            if ahead is not None:
                ahead.close()
        return i, hot_hits

    def _fetch(self, family: Family, key: bytes, expected: bytes) -> _Fetched:
        """A payload decoded and checked against `expected`, None if absent, or the
        `CorruptDataError` it failed with; and whether it came from the hot tier.

        Counts nothing, so it may run on a read-ahead thread.
        """
        hot = self.hot
        if hot is not None:
            cached = hot.lookup(family, key, expected)
            if isinstance(cached, codec.Decoded):
                return cached, True  # no digest check: verified when it got hot
            raw, from_hot = cached, cached is not None
        else:
            raw, from_hot = None, False
        try:
            if raw is None:
                raw = self.store.get(family, key)
                if raw is None:
                    return None, False
            block = codec.decode(raw, expected)
        except CorruptDataError as e:  # the digest, or RocksDB's own checks, failed
            return e, from_hot
        if hot is not None:
            hot.keep_decoded(family, key, raw, expected, block)
        return block, from_hot

    def _fetch_block(self, item: tuple[bytes, bytes]) -> _Fetched:
        return self._fetch(Family.BLOCKS, *item)

    def _verified(
        self, family: Family, key: bytes, fetched: codec.Decoded | CorruptDataError | None
    ) -> codec.Decoded | None:
        """The block `_fetch` returned, or None after counting why there is none."""
        if isinstance(fetched, codec.Decoded):
            return fetched
        if fetched is not None:
            self._corrupt(family, key, str(fetched))
        elif not self._evicted(family, key):
            self._corrupt(family, key, "payload missing under a stored header")
        return None

    def _read(self, family: Family, key: bytes, expected: bytes) -> codec.Decoded | None:
        fetched, from_hot = self._fetch(family, key, expected)
        if from_hot:
            self.counters.count(hot_hits=1)
        return self._verified(family, key, fetched)

    def _evicted(self, family: Family, key: bytes) -> bool:
        """Whether a payload missing under a header just read was evicted since (a miss).
        A reader beside a live writer (read-only or secondary) sees the database as of
        its open or last refresh, but payload files as they are now: a file gone under
        the stub its view still holds is the writer's eviction, not damage (that view
        cannot tell them apart; `cas-bank verify` finds damage)."""
        if self.store.read_only and self._stub_of_a_file(family, key):
            return True
        header = read_headers(self.store, [key])[0]
        return header is None or (family is Family.STATES and not header.has_state)

    def _stub_of_a_file(self, family: Family, key: bytes) -> bool:
        """Whether the database holds a payload file's stub under `key`."""
        files = self.files
        if files is None:
            return False
        try:
            stub = files.inner.get(family, key)
        except CorruptDataError:
            return False
        return stub is not None and stub_of(stub) is not None

    def state_in_file(self, header: Header) -> bool:
        """Whether `header`'s boundary state is of the file tier's size (a payload file
        `assemble` can read along with the blocks)."""
        return (
            self.files is not None
            and header.state_digest is not None
            and header.state_size >= self.files.min_bytes
        )

    def _state_file(self, header: Header, assembler: Assembler) -> tuple[BlockFiles, Job] | None:
        """A read of `header`'s state payload file into the assembler's state arrays, if
        it is a file the native reader can fill in place; None otherwise (`read_state`
        reads it then)."""
        files, digest = self.files, header.state_digest
        if files is None or digest is None or not self.state_in_file(header):
            return None
        reader = assembler.state_files()
        if reader is None or not reader.native:
            return None
        # Named by its header, its record unread (as a block's: `_assemble_local`); a
        # state that is not there is read the usual way (`read_state`).
        name = files.name(Family.STATES, header.chain_hash, digest)
        return reader, (0, name, header.state_size, digest)

    def read_state(
        self,
        header: Header,
        fetched: Mapping[bytes, codec.Decoded] | None = None,
        along: StateRead | None = None,
    ) -> list[mx.array] | None:
        """`header`'s boundary state, verified, or None after counting why not.

        `along`: the state `assemble` read with the blocks, used if it is this one.
        """
        assert header.state_digest is not None
        if along is not None and along[0] == header.chain_hash:
            return along[1]  # read and verified with the blocks
        block = (fetched or {}).get(header.chain_hash) or self._read(
            Family.STATES, header.chain_hash, header.state_digest
        )
        if block is None:
            return None
        try:
            return decode_state(self.spec, block)
        except CorruptDataError as e:
            self._corrupt(Family.STATES, header.chain_hash, str(e))
            return None

    def damaged_headers(self, why: str) -> None:
        """The headers of a lookup could not be read (RocksDB's checksum, a file gone)."""
        self.counters.count(corrupt_reads=1)
        log.warning("cas_bank: headers unreadable (%s); served as a miss", why)

    def _corrupt(self, family: Family, key: bytes, why: str) -> None:
        self.counters.count(corrupt_reads=1)
        self.suspects.mark(key, state=family is Family.STATES)
        log.warning(
            "cas_bank: %s %s failed verification (%s); served as a miss",
            family.value,
            key.hex()[:16],
            why,
        )
