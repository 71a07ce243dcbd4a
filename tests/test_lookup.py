"""`longest_chain`, the lookup every restore starts with: for any stored prefix of any
chain, read whole or measured first (`WHOLE_CHAIN_READ`), through the hot tier or not,
it returns exactly the stored prefix's headers, and stops before a damaged one.

Over a real RocksDB (`RocksStore`, one per module; each example stores its chain under
fresh random hashes), the store a bank reads its headers from.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank.blocks.hashing import BlockHash
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.index import chain
from cas_bank.index.chain import Header, longest_chain

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
