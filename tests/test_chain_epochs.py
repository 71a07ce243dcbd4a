"""The namespace's epoch of the chain and prefix records (`index.chain_record_writes`):
a record counts only at the epoch read beside it, so an epoch once left behind must
never be current again, even where the epoch record itself could not be read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import hybrid_spec, random_layers, random_state

from cas_bank import Bank, BankConfig, Namespace
from cas_bank.blocks.store import Family
from cas_bank.index import chain_records
from cas_bank.index.chain import longest_chain, stored_chain
from cas_bank.index.children import INDEXED_KEY
from cas_bank.maintenance.verify import verify

B = 4


def _stale_at_1(bank: Bank, ns: Namespace, tokens: list[int]) -> bytes:
    """`tokens` (30 blocks) stored so that block 29's chain and prefix records were
    written at epoch 1 and went stale when a state added to block 9 (no children index
    to write them again) raised the epoch to 2; the epoch's key."""
    spec = ns.spec
    bank.store.put_batch([(Family.META, INDEXED_KEY, None)])  # every rewrite: epoch + 1
    ns.store(tokens[: 20 * B], random_layers(spec, 20 * B), {20 * B: random_state(spec)})
    ns.store(tokens[: 5 * B], random_layers(spec, 5 * B), {5 * B: random_state(spec)})
    ns.store(tokens, random_layers(spec, 30 * B))  # block 29's records at epoch 1
    ns.store(tokens[: 10 * B], random_layers(spec, 10 * B), {10 * B: random_state(spec)})
    key = chain_records.epoch_key(ns.root)
    assert chain_records.epoch_of(bank.store.get(Family.CHAINS, key)) == 2
    return key


def _check_lookups(ns: Namespace, tokens: list[int]) -> None:
    """The records' lookups give what the headers say (block 9 holds a state)."""
    toks = np.asarray(tokens, dtype=np.uint32)
    hashes = ns.chain(toks)
    want = longest_chain(ns.view(), ns.root, hashes)
    assert want[9].has_state
    assert longest_chain(ns.view(), ns.root, hashes, toks) == want
    assert stored_chain(ns.view(), ns.root, toks, B) == (hashes, want)


def test_an_unreadable_epoch_never_makes_stale_records_current_again(tmp_path: Path) -> None:
    """The epoch record does not read (a value of another length): no record is
    current, the lookup reads the headers. The next store writes the epoch again: at
    a value no record was written at, so the stale epoch-1 records (block 9 without
    its state) still give way to the headers."""
    spec = hybrid_spec()
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 1000, 30 * B)]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        key = _stale_at_1(bank, ns, tokens)
        bank.store.put_batch([(f, key, b"bad") for f in (Family.CHAINS, Family.PREFIXES)])
        _check_lookups(ns, tokens)
        other = [int(t) for t in rng.integers(1000, 2000, 8 * B)]
        ns.store(other, random_layers(spec, len(other)), {len(other): random_state(spec)})
        _check_lookups(ns, tokens)


def test_verify_fix_of_an_unreadable_epoch_makes_no_stale_record_current(
    tmp_path: Path,
) -> None:
    """An epoch that does not read in `chains` is reported (beside `prefixes`' 0, or
    alone), and `verify --fix` writes one no record was written at (one more than
    either family's would be 1): the stale epoch-1 records stay stale."""
    spec = hybrid_spec()
    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(0, 1000, 30 * B)]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        key = _stale_at_1(bank, ns, tokens)
        bank.store.put_batch([(Family.CHAINS, key, b"bad"), (Family.PREFIXES, key, None)])
        assert ("bad_chain_record", key) in {(p.kind, p.chain_hash) for p in verify(bank).problems}
        bank.store.put_batch([(Family.PREFIXES, key, chain_records.encode_epoch(0))])
        report = verify(bank, fix=True)
        assert report.fixed
        _check_lookups(ns, tokens)
        assert verify(bank).ok
