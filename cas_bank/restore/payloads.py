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
from cas_bank.blocks.files import FileTier, PayloadFile
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.chain import Header, read_headers
from cas_bank.restore.assemble import Assembler
from cas_bank.restore.file_read import BlockFiles, Job, read_files, read_plain_blocks
from cas_bank.restore.workers import ReadAhead
from cas_bank.spec import ModelSpec, decode_state

if TYPE_CHECKING:
    from cas_bank.blocks.hot import HotStore
    from cas_bank.restore.resources import Resources
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

READ_AHEAD_FROM = 256 * 1024  # bytes per item; below, the thread costs more than it hides
# Payloads below READ_AHEAD_FROM asked of the store at once: under 16 MiB held as bytes.
_MULTI_GET = 64


def worth_reading_ahead(sizes: Sequence[int]) -> bool:
    """Whether items of these sizes (bytes) are enough, and large enough, to read ahead."""
    return len(sizes) >= 2 and sum(sizes) >= READ_AHEAD_FROM * len(sizes)


class PayloadReader:
    """Reads and verifies one namespace's block and state payloads.

    Collaborators: the `store` read from (and the `hot` tier in it, if any), the
    `counters` that count hot hits and corrupt reads, the `suspects` a corrupt read
    marks, the bank's `resources` whose helper threads read payload files beside the
    restoring thread where the native reader does not (None: it reads them alone).
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: BlockStore,
        hot: HotStore | None,
        counters: Counters,
        suspects: Suspects,
        files: FileTier | None = None,
        resources: Resources | None = None,
    ) -> None:
        self.spec = spec
        self.resources = resources
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

        The payloads the file tier keeps as files are read, verified and copied into the
        arrays by `restore.file_read`, on two threads (`_read_files`); the others, and
        those files that did not read as plain payloads, one by one, hot tier first
        (`_put_the_rest`).
        """
        if self.files is None or not assembler.direct or len(headers) <= first:
            return (*self._assemble_each(headers, assembler, first), None)
        blocks = assembler.block_files()
        state_job = self._state_file(state, assembler) if state is not None else None
        read = self._read_files(headers, first, blocks, state_job)
        if read is None:  # no payload of the file tier's size
            return (*self._assemble_each(headers, assembler, first, blocks), None)
        located, results = read
        along: StateRead | None = None
        if state is not None and state_job is not None:
            if results[0] is None:
                along = (state.chain_hash, assembler.state_arrays())
            results = results[1:]
        if isinstance(located, range) and not any(results):
            return len(headers), 0, along  # all read and verified
        failed: dict[int, str | None] = dict(zip(located, results, strict=True))
        try:
            kept = self._unfound(headers, failed)
        except CorruptDataError:  # RocksDB's own checks, on a record kept in it
            return (*self._assemble_each(headers, assembler, first), along)
        if kept and len(kept) == len(located):  # no payload is a file (a format-1 bank)
            return (*self._assemble_each(headers, assembler, first), along)
        return (*self._put_the_rest(headers, assembler, first, failed, kept), along)

    def _read_files(
        self,
        headers: Sequence[Header],
        first: int,
        blocks: BlockFiles,
        state_job: tuple[BlockFiles, Job] | None,
    ) -> tuple[Collection[int], list[str | None]] | None:
        """`read_files` of the state job (first) and of the payload files of blocks
        `first`..: the blocks it read (a range where it tried them all) and what it says
        of each read, the state's first; None if no block is of the file tier's size.

        Only payloads of the tier's size can be files, and the tier names each by its
        header (`FileTier.file_for`), so the payload records are not read first: a
        header commits in the same batch as its payload's record, and the file is
        checked against the header's digest. The records are read only for the files
        that are not there (`_unfound`).
        """
        files = self.files
        assert files is not None
        results = self._read_plain(headers, first, blocks, state_job)
        if results is not None:  # every block a plain file of the layout, one native call
            return range(first, len(headers)), results
        names: dict[int, str] = {}
        for i in range(first, len(headers)):
            h = headers[i]
            name = files.file_for(Family.BLOCKS, h.chain_hash, h.payload_digest, h.payload_size)
            if name is not None:
                names[i] = name
        if not names:
            return None
        jobs: list[tuple[BlockFiles, Job]] = [
            (blocks, (i, name, headers[i].payload_size, headers[i].payload_digest))
            for i, name in names.items()
        ]
        if state_job is not None:  # first: the largest file, the one to start early
            jobs.insert(0, state_job)
        resources = self.resources
        return names, read_files(jobs, resources.workers if resources is not None else None)

    def _read_plain(
        self,
        headers: Sequence[Header],
        first: int,
        blocks: BlockFiles,
        state_job: tuple[BlockFiles, Job] | None,
    ) -> list[str | None] | None:
        """`read_files` of the state job (first) and of blocks `first`.. in one native
        call (`file_read.read_plain_blocks`), when every one of them is a plain payload
        file of `blocks`' layout (what a bank of this layout writes); None otherwise."""
        files = self.files
        tail = headers[first:]
        if files is None or not files.stores_as_file(blocks.file_len):
            return None
        if set(map(_PAYLOAD_SIZE, tail)) != {blocks.file_len}:
            return None
        keys = b"".join(map(_CHAIN_HASH, tail))
        digests = b"".join(map(_PAYLOAD_DIGEST, tail))
        prefix = files.prefix(Family.BLOCKS)
        return read_plain_blocks(blocks, prefix, keys, digests, first, state_job)

    def _unfound(
        self, headers: Sequence[Header], failed: dict[int, str | None]
    ) -> dict[int, bytes]:
        """What the file tier's records say of the payload files `read_files` did not
        find (in `failed`, rewritten in place): a record naming another payload is
        damage, a payload kept in the database (a format-1 bank's) is returned to be
        decoded, and a record naming this very file leaves it missing."""
        files = self.files
        assert files is not None
        unfound = [i for i, why in failed.items() if why and why.startswith("payload file missing")]
        if not unfound:
            return {}
        kept: dict[int, bytes] = {}
        places = files.locate(Family.BLOCKS, [headers[i].chain_hash for i in unfound])
        for i, place in zip(unfound, places, strict=True):
            h = headers[i]
            if place is None:
                failed[i] = "not a file"  # read the usual way: evicted, or missing
            elif not isinstance(place, PayloadFile):
                kept[i], failed[i] = place, "not a file"
            elif not place.is_of(h.payload_digest, h.payload_size):
                failed[i] = "payload record does not match its header"
        return kept

    def _put_the_rest(
        self,
        headers: Sequence[Header],
        assembler: Assembler,
        first: int,
        failed: Mapping[int, str | None],
        kept: Mapping[int, bytes],
    ) -> tuple[int, int]:
        """After `_read_files`: blocks `first`.. that it did not put in, decoded and
        copied in one at a time, in order, up to the first that is missing or corrupt
        (counted, unless evicted); returns (blocks assembled, hot-tier hits).

        `failed`: why each file read failed (None: read and verified; a block not in
        it is not a file); `kept`: payloads the database keeps, by block.
        """
        hot_hits = 0
        for i in range(first, len(headers)):
            why = failed.get(i, "not a file")
            if why is None:
                continue
            header = headers[i]
            key = header.chain_hash
            if why not in ("not a file", "not a plain payload"):
                # the native reader adds errno to a missing file's why
                missing = why.startswith("payload file missing")
                if not (missing and self._evicted(Family.BLOCKS, key)):
                    self._corrupt(Family.BLOCKS, key, why)
                return i, hot_hits
            # Kept in the database, or compressed: decode it and copy it in.
            value: codec.Decoded | CorruptDataError | None
            if i in kept:
                value, from_hot = _decoded(kept[i], header.payload_digest), False
            else:
                value, from_hot = self._fetch(Family.BLOCKS, key, header.payload_digest)
            hot_hits += from_hot
            block = self._verified(Family.BLOCKS, key, value)
            if block is None:
                return i, hot_hits
            try:
                assembler.put(i, block)
            except CorruptDataError as e:
                self._corrupt(Family.BLOCKS, key, str(e))
                return i, hot_hits
        return len(headers), hot_hits

    def _assemble_each(
        self,
        headers: Sequence[Header],
        assembler: Assembler,
        first: int = 0,
        blocks: BlockFiles | None = None,
    ) -> tuple[int, int]:
        """`assemble` one payload at a time through the store (and the hot tier);
        `blocks`: the assembler's `block_files()`, where the caller made it.

        Payloads too small to read ahead are read by multi-gets (`_assemble_small`).
        Otherwise, from the first payload read from the store on, if enough bytes
        remain, the rest are read and verified on a background thread one block ahead
        (`ReadAhead`) while this one copies.
        """
        if not worth_reading_ahead([h.payload_size for h in headers[first:]]):
            return self._assemble_small(headers, assembler, first, blocks)
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

    def _assemble_small(
        self,
        headers: Sequence[Header],
        assembler: Assembler,
        first: int,
        blocks: BlockFiles | None = None,
    ) -> tuple[int, int]:
        """`_assemble_each` of payloads too small to read ahead: asked of the store
        `_MULTI_GET` at a time (one read each cost a small model's reopened restore
        ~45 us a block), up to the first missing or corrupt one.

        Where the native copy fills the arrays (`BlockFiles.copies_in`), a payload that
        is a plain one of the block layout is checked here as the native reader checks
        a file (its head, then its check) and all that pass in a multi-get are copied
        in by one native call; decoding each and copying it array by array was most of a
        reopened tiny-hybrid restore's Python time (~30 us a block). They are not kept
        decoded in the hot tier (its raw copy is checked again when a restore takes it).
        The rest are decoded and put one at a time, as before.
        """
        if blocks is None and assembler.direct:
            blocks = assembler.block_files()
        plain = blocks if blocks is not None and blocks.copies_in else None
        hot_hits = 0
        for at in range(first, len(headers), _MULTI_GET):
            chunk = headers[at : at + _MULTI_GET]
            checked: list[tuple[int, bytes]] = []
            try:
                for j, (value, from_hot) in enumerate(self._read_some(Family.BLOCKS, chunk)):
                    header = chunk[j]
                    hot_hits += from_hot
                    if (
                        plain is not None
                        and type(value) is bytes
                        and plain.holds(value, header.payload_digest)
                    ):
                        checked.append((at + j, value))
                        continue
                    if not self._put_one(assembler, at + j, header, value, from_hot):
                        return at + j, hot_hits
            finally:  # the blocks checked before a failing one are good
                if plain is not None:
                    plain.copy_in(checked)
        return len(headers), hot_hits

    def _put_one(
        self,
        assembler: Assembler,
        index: int,
        header: Header,
        value: codec.Decoded | bytes | CorruptDataError | None,
        from_hot: bool,
    ) -> bool:
        """Block `index` put in from what `_read_some` gave for it (decoded and checked
        here where it is bytes); False after counting why it cannot be."""
        key = header.chain_hash
        fetched: codec.Decoded | CorruptDataError | None
        if isinstance(value, bytes):
            fetched = self._decoded(Family.BLOCKS, key, header.payload_digest, value, from_hot)[0]
        else:
            fetched = value
        block = self._verified(Family.BLOCKS, key, fetched)
        if block is None:
            return False
        try:
            assembler.put(index, block, later=from_hot)
        except CorruptDataError as e:
            self._corrupt(Family.BLOCKS, key, str(e))
            return False
        return True

    def _fetch(self, family: Family, key: bytes, expected: bytes) -> _Fetched:
        """A payload decoded and checked against `expected`, None if absent, or the
        `CorruptDataError` it failed with; and whether it came from the hot tier.

        Counts nothing, so it may run on a read-ahead thread.
        """
        cached = self.hot.lookup(family, key, expected) if self.hot is not None else None
        if isinstance(cached, codec.Decoded):
            return cached, True  # no digest check: verified when it got hot
        if cached is not None:
            return self._decoded(family, key, expected, cached, True)
        try:
            raw = self.store.get(family, key)
        except CorruptDataError as e:  # RocksDB's own checks failed
            return e, False
        return self._decoded(family, key, expected, raw, False)

    def _decoded(
        self, family: Family, key: bytes, expected: bytes, raw: bytes | None, from_hot: bool
    ) -> _Fetched:
        """`_fetch`'s answer for `raw` (None: absent): decoded and checked against
        `expected`, and kept decoded in the hot tier; or the `CorruptDataError`."""
        if raw is None:
            return None, False
        try:
            block = codec.decode(raw, expected)
        except CorruptDataError as e:  # the digest failed
            return e, from_hot
        if self.hot is not None:
            self.hot.keep_decoded(family, key, raw, expected, block)
        return block, from_hot

    def _read_some(
        self, family: Family, headers: Sequence[Header]
    ) -> list[tuple[codec.Decoded | bytes | CorruptDataError | None, bool]]:
        """The payloads of `headers`, in order, and whether each came from the hot tier:
        decoded where the hot tier holds it decoded (checked when it got hot), else its
        bytes, unchecked (None: absent). Those not hot are asked of the store in one
        multi-get; one RocksDB's own checks refuse is read again one by one (decoded
        then, or the error), so that only the damaged one fails."""
        hot = self.hot
        cached = [
            hot.lookup(family, h.chain_hash, h.payload_digest) if hot is not None else None
            for h in headers
        ]
        missing = [h.chain_hash for h, c in zip(headers, cached, strict=True) if c is None]
        try:
            read = iter(self.store.get_many(family, missing) if missing else ())
        except CorruptDataError:
            return [self._fetch(family, h.chain_hash, h.payload_digest) for h in headers]
        return [(next(read), False) if c is None else (c, True) for c in cached]

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
        """Whether a payload missing under a header just read was evicted since (a miss),
        or evicted and stored again (it is there now). A reader beside a live writer
        (read-only or secondary) sees the database as of its open or last refresh, but
        payload files as they are now: a file gone under the stub its view still holds
        is the writer's eviction, not damage (that view cannot tell them apart;
        `cas-bank verify` finds damage)."""
        if self.store.read_only and self._kept_as_file(family, key):
            return True
        header = read_headers(self.store, [key])[0]
        if header is None or (family is Family.STATES and not header.has_state):
            return True
        # Evicted and stored again between the read and now: there again, not damage
        # (a payload lost under its header stays lost).
        return self.store.get_many(family, [key])[0] is not None

    def _kept_as_file(self, family: Family, key: bytes) -> bool:
        """Whether the file tier's record of `key` names a payload file."""
        files = self.files
        if files is None:
            return False
        try:
            return isinstance(files.locate(family, [key])[0], PayloadFile)
        except CorruptDataError:
            return False

    def state_in_file(self, header: Header) -> bool:
        """Whether `header`'s boundary state is of the file tier's size (a payload file
        `assemble` can read along with the blocks)."""
        return (
            self.files is not None
            and header.state_digest is not None
            and self.files.stores_as_file(header.state_size)
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
        # Named by its header, its record unread (as a block's: `_read_files`); a
        # state that is not there is read the usual way (`read_state`).
        name = files.file_for(Family.STATES, header.chain_hash, digest, header.state_size)
        return None if name is None else (reader, (0, name, header.state_size, digest))

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


def _decoded(raw: bytes, expected: bytes) -> codec.Decoded | CorruptDataError:
    """`raw`'s arrays, checked against `expected`, or the error it failed with."""
    try:
        return codec.decode(raw, expected)
    except CorruptDataError as e:
        return e
