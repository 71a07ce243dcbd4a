"""`longest_chain`, the lookup every restore starts with: for any stored prefix of any
chain, read whole or measured first (`WHOLE_CHAIN_READ`), through the hot tier or not,
it returns exactly the stored prefix's headers, and stops before a damaged one.

Over a real RocksDB (`RocksStore`, one per module; each example stores its chain under
fresh random hashes), the store a bank reads its headers from.
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TESTS_DIR, attention_spec, hybrid_spec, random_layers, random_state
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig, Namespace
from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index import chain, chain_record_writes, chain_records, prefixes
from cas_bank.index.chain import Header, longest_chain, stored_chain
from cas_bank.index.children import INDEXED_KEY
from cas_bank.index.header import FIXED
from cas_bank.maintenance.verify import verify

sys.path.insert(0, str(TESTS_DIR / "fixtures"))
from make_bank_v3 import PROMPT_DB, PROMPT_FILES

FIXTURE_V3 = TESTS_DIR / "fixtures" / "bank_v3_blake3.tar.gz"

MiB = 1 << 20


@pytest.fixture(scope="module")
def rocks() -> Iterator[RocksStore]:
    with tempfile.TemporaryDirectory() as tmp:
        store = RocksStore(Path(tmp) / "db")
        try:
            yield store
        finally:
            store.close()


def _chain(n: int) -> tuple[bytes, list[BlockHash], list[Header]]:
    """A namespace root and a chain of `n` linked headers under random hashes."""
    root = os.urandom(32)
    hashes = [BlockHash(os.urandom(32)) for _ in range(n)]
    headers = []
    for i, h in enumerate(hashes):
        parent = root if i == 0 else hashes[i - 1]
        tokens = i.to_bytes(4, "little") * 4
        headers.append(Header(h, parent, i, root, os.urandom(32), 100 + i, tokens))
    return root, hashes, headers


@given(
    n=st.integers(0, 300),
    stored=st.floats(0, 1),
    damaged=st.one_of(st.none(), st.floats(0, 1)),
    whole=st.sampled_from([0, 128, 10**6]),
    hot=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_the_lookup_finds_exactly_the_stored_prefix(
    rocks: RocksStore,
    n: int,
    stored: float,
    damaged: float | None,
    whole: int,
    hot: bool,
) -> None:
    """k of a chain's n headers stored (a prefix, as stores and eviction keep chains):
    the lookup returns those k, in order, whether it reads the chain whole or measures
    its stored length first; a header damaged at position d < k ends it at d."""
    root, hashes, headers = _chain(n)
    k = int(stored * n)
    writes = [(Family.HEADERS, bytes(h.chain_hash), h.encode()) for h in headers[:k]]
    cut = k
    if damaged is not None and k:
        d = min(int(damaged * k), k - 1)
        writes[d] = (Family.HEADERS, writes[d][1], writes[d][2][:-3])  # truncated
        cut = d
    rocks.put_batch(writes)
    store: BlockStore = HotStore(rocks, 4 * MiB) if hot else rocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chain, "WHOLE_CHAIN_READ", whole)
        assert longest_chain(store, root, hashes) == headers[:cut]
        assert longest_chain(store, root, hashes[: n // 2]) == headers[: min(cut, n // 2)]


def test_a_header_that_does_not_link_ends_the_chain(rocks: RocksStore) -> None:
    """A stored header whose parent or index is not its place in the chain (another
    chain's record under this hash) is never returned, nor anything after it."""
    root, hashes, headers = _chain(20)
    wrong = headers[7]._replace(parent=os.urandom(32))
    shifted = headers[12]._replace(index=13)
    records = [*headers[:7], wrong, *headers[8:12], shifted, *headers[13:]]
    rocks.put_batch([(Family.HEADERS, bytes(h.chain_hash), h.encode()) for h in records])
    assert longest_chain(rocks, root, hashes) == headers[:7]
    rocks.put_batch([(Family.HEADERS, bytes(hashes[7]), headers[7].encode())])
    assert longest_chain(rocks, root, hashes) == headers[:12]


# -- chain records (`index.chain`: `read_runs`, kept by `run_writes`) ------------------
B = 4  # tokens a block in the banks below
# The prefix key of tokens 0..523 (<u4) at block size 4 under a root of 32 zero bytes:
# two whole segments of 64 blocks and 3 blocks (docs/design.md, "Hashing (format v1)").
GOLDEN_PREFIX = "a99b6c946f1b3d3680725f1f5770a7a53b979f0725d1d09d3c5ae0fbec3b8568"


def _query(ns: Namespace, tokens: list[int]) -> tuple[list[Header], list[Header]]:
    """`longest_chain` of `tokens` with the chain records, and from the headers alone;
    the restore's lookup (`stored_chain`: the prefix records first) gives the same
    headers as the chain records and the very chain hashes of `ns.chain`."""
    toks = np.asarray(tokens, dtype=np.uint32)
    hashes = ns.chain(toks)
    view = ns.view()
    with_records = longest_chain(view, ns.root, hashes, toks[: len(hashes) * B])
    assert stored_chain(view, ns.root, toks, B) == (hashes, with_records)
    return with_records, longest_chain(view, ns.root, hashes)


def _records(bank: Bank) -> int:
    return sum(1 for k in bank.store.keys(Family.CHAINS) if len(k) == 32)


class _Counting:
    """A store that counts the header keys and chain-record reads asked of it."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.headers = 0
        self.record_reads = 0
        self.prefix_reads = 0

    def get(self, family: Family, key: bytes) -> bytes | None:
        self.headers += family is Family.HEADERS
        return self.inner.get(family, key)

    def get_parsed(self, family: Family, keys: Any, parse: Any) -> Any:
        self.headers += len(keys) if family is Family.HEADERS else 0
        self.record_reads += family is Family.CHAINS
        self.prefix_reads += family is Family.PREFIXES
        return self.inner.get_parsed(family, keys, parse)


@st.composite
def _program(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Stores of prompts that share prefixes (a tiny vocabulary), states stored on
    blocks already there (headers rewritten in place), evictions to a random share of
    what is stored (leaves, and states on their own, go), reopens."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["store"] * 3 + ["state"] * 2 + ["evict", "reopen"]))
        if kind == "store":
            extra = st.lists(st.integers(0, 2), min_size=B, max_size=40 * B)
            ops.append(("store", draw(st.integers(0, 99)), draw(st.floats(0, 1)), draw(extra)))
        elif kind == "state":
            ops.append(("state", draw(st.integers(0, 99)), draw(st.floats(0, 1))))
        elif kind == "evict":
            ops.append(("evict", draw(st.floats(0, 1))))
        else:
            ops.append(("reopen",))
    return ops


@given(program=_program(), segment=st.sampled_from([3, 64]), hybrid=st.booleans())
@settings(max_examples=30, deadline=None)
def test_the_chain_records_give_exactly_what_the_headers_say(
    program: list[tuple[Any, ...]], segment: int, hybrid: bool
) -> None:
    """Whatever stores, in-place rewrites (a state added), evictions (leaves, states on
    their own) and reopens came before, a lookup through the chain records returns the
    very headers the headers alone give, for every stored prompt, its extensions and
    its prefixes and prompts that leave it inside a block: never a block not stored,
    never a stale digest or state. (Segments of 3 blocks: many records in small
    chains.)"""
    spec = hybrid_spec() if hybrid else attention_spec()
    stored: list[list[int]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(chain_records, "SEGMENT", segment)
        path = Path(tmp) / "bank"
        bank = Bank.open(path, BankConfig(block_size=B, file_min_bytes=None))
        try:
            for op in program:
                ns = bank.namespace(spec)
                if op[0] == "store":
                    base = stored[op[1] % len(stored)] if stored else []
                    tokens = base[: int(op[2] * len(base))] + op[3]
                    if len(tokens) >= B:
                        n = len(tokens) // B * B
                        states = {n: random_state(spec, n)} if hybrid else None
                        ns.store(tokens, random_layers(spec, len(tokens)), states)
                        stored.append(tokens)
                elif op[0] == "state" and hybrid and stored:
                    tokens = stored[op[1] % len(stored)]
                    blocks = len(tokens) // B
                    at = max(1, int(op[2] * blocks)) * B
                    ns.store(tokens[:at], random_layers(spec, at), {at: random_state(spec, at)})
                elif op[0] == "evict":
                    evict_to_budget(bank, int(op[1] * bank.stats().payload_bytes))
                elif op[0] == "reopen":
                    bank.close()
                    bank = Bank.open(path, BankConfig(block_size=B, file_min_bytes=None))
                ns = bank.namespace(spec)
                for tokens in stored:
                    for q in (tokens, [*tokens, *[7] * 9 * B], tokens[: len(tokens) // 2],
                              [*tokens[:-B], 7, *tokens[-B + 1 :]]):  # fmt: skip
                        got, want = _query(ns, q)
                        assert got == want
            assert verify(bank).ok  # the records hold what the headers do
        finally:
            bank.close()


def test_a_stored_chain_is_read_from_its_records_alone(tmp_path: Path) -> None:
    """300 blocks stored in one go, then extended: the lookup of either reads their
    records (one multi-get), no header; a prompt going 100 blocks past the stored
    chain reads the header after the last whole segment's record, the records of that
    segment (the chain ends inside it), and the headers past them (none stored); a
    header rewritten in place (a state added) has the records that copy it written
    again with it: the lookup still reads no header, and sees the state. In a bank
    without a complete children index the rewrite makes every record stale instead:
    the lookup then reads the headers, and finds the same."""
    spec = hybrid_spec()
    rng = np.random.default_rng(1)
    first = [int(t) for t in rng.integers(0, 1000, 300 * B)]
    longer = first + [int(t) for t in rng.integers(0, 1000, 50 * B)]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        ns.store(first, random_layers(spec, len(first)), {len(first): random_state(spec)})
        ns.store(longer, random_layers(spec, len(longer)), {len(longer): random_state(spec)})
        assert _records(bank) == 300 // 64 + 1 + 1 + 1  # segment ends, the two chain ends
        for tokens, extra in ((first, []), (longer, []), (longer, [5] * 100 * B)):
            toks = np.asarray(tokens + extra, dtype=np.uint32)
            hashes = ns.chain(toks)
            counting = _Counting(ns.view().store)
            got = longest_chain(counting, ns.root, hashes, toks[: len(hashes) * B])
            assert got == longest_chain(ns.view(), ns.root, hashes)
            assert len(got) == len(tokens) // B
            assert counting.record_reads == 1 + bool(extra)  # the chain ends in a segment
            # Past the records: the next block's header (present: the segment's records
            # are read), then the headers after the deepest record (none stored).
            assert counting.headers == (1 + len(hashes) - len(got) if extra else 0)
        # A state added to block 99 in place: its records (block 127's, 299's, 349's:
        # the segment 64..127 of both chains) written again with it.
        toks = np.asarray(longer, dtype=np.uint32)
        hashes = ns.chain(toks)
        for at, no_index in ((100, False), (200, True)):
            if no_index:  # as a bank made before the children index: records go stale
                bank.store.put_batch([(Family.META, INDEXED_KEY, None)])
            states = {at * B: random_state(spec)}
            ns.store(first[: at * B], random_layers(spec, at * B), states)
            counting = _Counting(ns.view().store)
            got = longest_chain(counting, ns.root, hashes, toks)
            assert got == longest_chain(ns.view(), ns.root, hashes)
            assert got[at - 1].has_state and got[99].has_state
            assert counting.headers >= len(hashes) - 64 if no_index else counting.headers == 0


def test_a_damaged_or_foreign_record_is_not_taken(tmp_path: Path) -> None:
    """A record whose bytes do not hold up (truncated, another version, an entry for
    another block) gives nothing: the lookup reads the headers."""
    spec = attention_spec()
    tokens = list(range(130 * B))
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)))
        hashes = ns.chain(tokens)
        want = longest_chain(ns.view(), ns.root, hashes)
        key = bytes(hashes[63])
        good = bank.store.get(Family.CHAINS, key)
        assert good is not None
        other = bank.store.get(Family.CHAINS, bytes(hashes[127]))
        assert other is not None
        for bad in (good[:-1], b"\x02" + good[1:], good[:16] + other[16 + 152 :] + other[16:168]):
            bank.store.put_batch([(Family.CHAINS, key, bad)])
            assert _query(ns, tokens) == (want, want)


def test_a_bank_written_before_the_records_opens_and_restores(tmp_path: Path) -> None:
    """The version-3 bank of `tests/fixtures` has no `chains` family: read-only it
    restores from its headers; opened to write, the family is made, a store extending
    one of its chains records the new blocks' segments (the old headers read for the
    walk), and every lookup gives what its headers say."""
    with tarfile.open(FIXTURE_V3) as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / "bank"
    spec = attention_spec()
    with Bank.open(path, BankConfig(block_size=B), mode="read_only") as bank:
        ns = bank.namespace(spec)
        hit = ns.restore(PROMPT_DB)
        assert hit is not None and hit.tokens == len(PROMPT_DB)
        assert _query(ns, PROMPT_DB)[0] == _query(ns, PROMPT_DB)[1]
    with Bank.open(path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        assert _records(bank) == 0
        longer = PROMPT_DB + list(range(70 * B))
        ns.store(longer, random_layers(spec, len(longer)))
        assert _records(bank) == 2  # block 63's segment, the chain's end
        for q in (PROMPT_DB, longer, PROMPT_FILES):
            got, want = _query(ns, q)
            assert got == want and len(got) == len(q) // B
        hit = ns.restore(longer)
        assert hit is not None and hit.tokens == len(longer) // B * B


# -- prefix records (`index.prefixes`, kept by `index.chain_record_writes`) -------------
def test_a_stored_chain_is_found_by_its_prefix_records_alone(tmp_path: Path) -> None:
    """300 blocks stored in one go: the restore's lookup of them reads one multi-get of
    prefix records and nothing else (no chain record, no header, no block hashed: the
    hashes come from the records and are the chain's own); a prompt going 100 blocks
    past them takes the 4 whole segments from the prefix records and goes on from
    there with the chain records and headers; a next turn 10 blocks past them finds
    them all (a second multi-get: the stored end inside the last segment) and reads
    the 10 headers after;
    a header rewritten in place (a state added) has its prefix records written again
    with it: still one multi-get."""
    spec = hybrid_spec()
    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(0, 1000, 300 * B)]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)), {len(tokens): random_state(spec)})
        keys = [k for k in bank.store.keys(Family.PREFIXES) if len(k) == 32]
        assert len(keys) == 300 // 64 + 1  # every whole segment and the chain's end
        toks = np.asarray(tokens, dtype=np.uint32)
        want = longest_chain(ns.view(), ns.root, ns.chain(toks))
        counting = _Counting(ns.view().store)
        assert stored_chain(counting, ns.root, toks, B) == (ns.chain(toks), want)
        assert (counting.prefix_reads, counting.record_reads, counting.headers) == (1, 0, 0)
        longer = np.asarray(tokens + [5] * 100 * B, dtype=np.uint32)
        counting = _Counting(ns.view().store)
        hashes, got = stored_chain(counting, ns.root, longer, B)
        assert hashes == ns.chain(longer) and got == want
        assert counting.prefix_reads == 1 and counting.record_reads >= 1
        # A next turn (10 new blocks): its end is not stored; a second multi-get of the
        # last segment's keys, one a block, finds the stored chain's end inside it
        # (block 299); the 10 headers after it: absent.
        turn = np.asarray(tokens + [5] * 10 * B, dtype=np.uint32)
        counting = _Counting(ns.view().store)
        assert stored_chain(counting, ns.root, turn, B) == (ns.chain(turn), want)
        assert (counting.prefix_reads, counting.record_reads, counting.headers) == (2, 0, 10)
        ns.store(tokens[: 100 * B], random_layers(spec, 100 * B), {100 * B: random_state(spec)})
        want = longest_chain(ns.view(), ns.root, ns.chain(toks))
        counting = _Counting(ns.view().store)
        assert stored_chain(counting, ns.root, toks, B) == (ns.chain(toks), want)
        assert want[99].has_state
        assert (counting.prefix_reads, counting.record_reads, counting.headers) == (1, 0, 0)


def test_eviction_removes_the_prefix_records_with_their_blocks(tmp_path: Path) -> None:
    """A prefix record goes with its block's chain record: after an eviction of some
    leaves every prefix record left names stored blocks only, and after one of all
    none is left but the namespace's epoch."""
    spec = attention_spec()
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        base = list(range(70 * B))
        for tail in range(3):
            toks = base + [tail] * (tail + 1) * 30 * B
            ns.store(toks, random_layers(spec, len(toks)))
        # Blocks 63 and 99; 127 and 129; 127 (another) and 159: segment and chain ends.
        assert sum(len(k) == 32 for k in bank.store.keys(Family.PREFIXES)) == 6
        evict_to_budget(bank, bank.stats().payload_bytes // 2)
        for key in bank.store.keys(Family.PREFIXES):
            if len(key) == 32:
                value = bank.store.get(Family.PREFIXES, key)
                assert value is not None
                assert bank.store.get(Family.HEADERS, value[-32:]) is not None
                assert bank.store.get(Family.CHAINS, value[-32:]) is not None
        evict_to_budget(bank, 0)
        assert [len(k) for k in bank.store.keys(Family.PREFIXES)] == [5 + 32]


def test_prefix_keys_are_format_v1() -> None:
    """The prefix keys (persistent, like the chain hashes): a golden vector, and the C
    keys equal the blake3 package's."""
    root = bytes(32)
    data = memoryview(np.arange(2 * 64 * B + 3 * B, dtype="<u4").tobytes())
    keys = prefixes.prefix_keys(root, data, 64 * B * 4)
    assert keys == prefixes.python_prefix_keys(root, data, 64 * B * 4)
    assert len(keys) == 3 and keys[0] == prefixes.next_key(prefixes.start_key(root), data[:1024])
    assert keys[-1].hex() == GOLDEN_PREFIX
    # At block size 64 a segment is 16 BLAKE3 chunks (the SIMD paths; the C test too).
    data = memoryview(np.arange(2 * 64 * 64 + 3 * 64, dtype="<u4").tobytes())
    keys = prefixes.prefix_keys(root, data, 64 * 64 * 4)
    assert keys == prefixes.python_prefix_keys(root, data, 64 * 64 * 4)
    assert keys[-1].hex() == "1ce3d0946e0e322c46ea79bf8d0f2e9f9d97db9d8f745509ff0751f26029492e"
    # A block at a time in the short last segment: each the key of the prefix to it.
    every = prefixes.prefix_keys(root, data, 64 * 64 * 4, 64 * 4)
    assert every == prefixes.python_prefix_keys(root, data, 64 * 64 * 4, 64 * 4)
    assert every[:2] == keys[:2] and every[-1] == keys[-1] and len(every) == 5
    assert every[2] == prefixes.prefix_keys(root, data[: (2 * 64 + 1) * 64 * 4], 64 * 64 * 4)[-1]
    # Going on from the key of the whole segments (a lookup's last segment).
    rest = data[2 * 64 * 64 * 4 :]
    on = prefixes.prefix_keys(root, rest, 64 * 64 * 4, 64 * 4, after=keys[1])
    assert on == every[2:] == prefixes.python_prefix_keys(root, rest, 64 * 64 * 4, 64 * 4, keys[1])


def test_verify_finds_records_that_are_not_the_headers_and_fix_removes_them(
    tmp_path: Path,
) -> None:
    """A current chain record that holds another payload digest, a prefix record under
    a key no chain record carries, one whose entries differ from its chain record's and
    an epoch that differs between the families are each reported; `fix` deletes the
    records (writes a fresh epoch in both), after which verify is clean and the lookup
    gives what the headers say."""
    spec = attention_spec()
    tokens = list(range(130 * B))
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)))
        assert verify(bank).ok
        hashes = ns.chain(tokens)
        record = bank.store.get(Family.CHAINS, bytes(hashes[63]))
        later = bank.store.get(Family.CHAINS, bytes(hashes[127]))
        assert record is not None and later is not None
        key = chain_records.run_prefix(later)
        assert key is not None
        value = bank.store.get(Family.PREFIXES, key)
        assert value is not None
        at = 16 + 5 * FIXED.size + 88  # block 5's (69's) payload digest in the records
        stray, epoch = os.urandom(32), chain_records.epoch_key(ns.root)
        bank.store.put_batch(
            [
                (Family.CHAINS, bytes(hashes[63]), record[:at] + bytes(32) + record[at + 32 :]),
                (Family.PREFIXES, stray, value),
                (Family.PREFIXES, key, value[:at] + bytes(32) + value[at + 32 :]),
                (Family.PREFIXES, epoch, chain_records.encode_epoch(7)),
            ]
        )
        report = verify(bank, fix=True)
        found = {(p.kind, p.chain_hash) for p in report.problems}
        assert found >= {
            ("bad_chain_record", bytes(hashes[63])),
            ("bad_chain_record", epoch),
            ("bad_prefix_record", stray),
            ("bad_prefix_record", key),
        }
        assert {kind for kind, _ in found} == {"bad_chain_record", "bad_prefix_record"}
        assert report.fixed and verify(bank).ok
        assert bank.store.get(Family.CHAINS, bytes(hashes[63])) is None
        assert _query(ns, tokens)[0] == _query(ns, tokens)[1]


def test_a_rewrite_below_a_bushy_subtree_makes_the_records_stale_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `REWRITE_WALK` blocks to walk, a header rewritten in place raises the
    namespace's epoch (a bounded batch): the lookup then reads the headers, and finds
    the state."""
    spec = hybrid_spec()
    tokens = list(range(130 * B))
    monkeypatch.setattr(chain_record_writes, "REWRITE_WALK", 8)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)), {len(tokens): random_state(spec)})
        ns.store(tokens[: 100 * B], random_layers(spec, 100 * B), {100 * B: random_state(spec)})
        toks = np.asarray(tokens, dtype=np.uint32)
        counting = _Counting(ns.view().store)
        got = stored_chain(counting, ns.root, toks, B)[1]
        assert got == longest_chain(ns.view(), ns.root, ns.chain(toks)) and got[99].has_state
        assert counting.headers >= 130 - 64
