"""The children index (`cas_bank/index/children.py`) and partial blocks through the
library: the index stays exact through stores, end records, eviction, `verify --fix`,
bundle imports and salvage; a bank made before the index; what a restore that finds
nothing pays for the lookup."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from cas_bank.tools.cli import main as cli_main
from conftest import attention_spec, hybrid_spec, layers_bits, prefix_layers, random_state
from conftest import tokens_of as _tokens

from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index.chain import Header
from cas_bank.index.children import INDEXED_KEY, expected_entries, is_indexed
from cas_bank.index.ends import split_record
from cas_bank.index.partial import find_partial
from cas_bank.maintenance.bundle.export import chain_for_tokens, export_chain
from cas_bank.maintenance.bundle.load import import_bundle
from cas_bank.maintenance.salvage import salvage
from cas_bank.maintenance.verify import verify

B = 4
SPEC = attention_spec()


def _index(bank: Bank) -> dict[bytes, bytes]:
    return dict(bank.store.iterate(Family.CHILDREN))


def _expected(bank: Bank) -> dict[bytes, bytes]:
    headers = [Header.decode(k, v) for k, v in bank.store.iterate(Family.HEADERS)]
    ends = [(k, split_record(k, v)[0]) for k, v in bank.store.iterate(Family.ENDS)]
    return expected_entries(headers, ends)


def _fill(bank: Bank, seed: int = 1) -> list[list[int]]:
    """Prompts that branch off one another inside blocks, with end records."""
    rng = np.random.default_rng(seed)
    trunk = _tokens(rng, 3 * B + 2)
    prompts = [trunk, [*trunk[:5], *_tokens(rng, 6)], [*trunk[:9], *_tokens(rng, 2)]]
    ns = bank.namespace(SPEC)
    for p in prompts:
        ns.store(p, prefix_layers(SPEC, p))
        ns.store_end(p, prefix_layers(SPEC, p))
    return prompts


def test_the_index_follows_stores_ends_eviction_and_fix(tmp_path: Path) -> None:
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
        assert _index(bank) == _expected(bank) and len(_index(bank)) > 5
        assert is_indexed(bank.store) and verify(bank).ok
        evict_to_budget(bank, bank.stats().payload_bytes // 2)
        assert _index(bank) == _expected(bank)
        # Damage one entry, add a stale one: verify names both, --fix mends them.
        (key, value), *_ = _index(bank).items()
        bank.store.put_batch([(Family.CHILDREN, key, None), (Family.CHILDREN, b"x" * 36, value)])
        report = verify(bank)
        assert sorted(p.kind for p in report.problems) == ["bad_child", "unindexed"]
        fixed = verify(bank, fix=True)
        assert fixed.fixed and fixed.indexed == 1
        assert _index(bank) == _expected(bank) and verify(bank).ok
        assert prompts


def test_a_bank_made_before_the_index_works_and_fix_indexes_it(tmp_path: Path) -> None:
    path = tmp_path / "bank"
    with Bank.open(path, BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
        n = len(_index(bank))
        # As an older cas_bank left it: no entries, no mark.
        old = [(Family.CHILDREN, k, None) for k in _index(bank)]
        bank.store.put_batch([*old, (Family.META, INDEXED_KEY, None)])
    with Bank.open(path) as bank:
        ns = bank.namespace(SPEC)
        b = [*prompts[0][:6], 999]
        hit = ns.restore(b)
        assert hit is not None and hit.tokens == B and hit.partial == 0  # whole blocks only
        report = verify(bank)
        assert report.ok and report.unindexed == n
        fixed = verify(bank, fix=True)
        assert fixed.indexed == n and is_indexed(bank.store)
        hit = ns.restore(b)
        assert hit is not None and (hit.tokens, hit.partial) == (6, 2)
        assert verify(bank).ok


def test_imports_and_salvage_carry_the_index(tmp_path: Path) -> None:
    with Bank.open(tmp_path / "a", BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
        chain = chain_for_tokens(bank, bank.namespace(SPEC).root, prompts[0])
        export_chain(bank, chain, tmp_path / "x.bundle")
    salvage(tmp_path / "a", tmp_path / "s")
    with Bank.open(tmp_path / "s") as bank:
        assert _index(bank) == _expected(bank) and is_indexed(bank.store)
    with Bank.open(tmp_path / "b", BankConfig(block_size=B)) as bank:
        import_bundle(bank, tmp_path / "x.bundle")
        assert _index(bank) == _expected(bank) and len(_index(bank)) >= 3
        hit = bank.namespace(SPEC).restore([*prompts[0][:7], 999])
        assert hit is not None and (hit.tokens, hit.partial) == (7, 3)


def test_a_partial_block_is_the_stored_kv_of_its_first_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From a block or from an end record's tail, restored from disk after a reopen."""
    path = tmp_path / "bank"
    with Bank.open(path, BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        for stored, at in ((prompts[0], 6), (prompts[1], 9), (prompts[0], 13)):
            b = [*stored[:at], 999]
            hit = ns.restore(b)
            assert hit is not None and hit.tokens == at and hit.partial == at % B
            assert layers_bits(hit.layers, SPEC) == layers_bits(
                [(k[..., :at, :], v[..., :at, :]) for k, v in prefix_layers(SPEC, stored)], SPEC
            )
        assert bank.stats().partial_hits == 3
    assert cli_main(["stats", str(path), "--json"]) == 0  # kept past the close
    shown = json.loads(capsys.readouterr().out)
    assert (shown["partial_hits"], shown["partial_tokens"]) == (3, 6 % B + 9 % B + 13 % B)


def test_a_partial_block_joins_a_leased_chain_exactly(tmp_path: Path) -> None:
    """Right after the store the chain is leased (in memory): the partial block's first
    tokens are joined to the lease's arrays, without room and with it."""
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
        ns = bank.namespace(SPEC)
        assert bank.leases is not None
        want = [(k[..., :10, :], v[..., :10, :]) for k, v in prefix_layers(SPEC, prompts[0])]
        for room in (0, 64):
            hit = ns.restore([*prompts[0][:10], 999], room_for=room)
            assert hit is not None and (hit.tokens, hit.partial) == (10, 2)
            got = [(k[..., :10, :], v[..., :10, :]) for k, v in hit.layers]
            assert layers_bits(got, SPEC) == layers_bits(want, SPEC)
        assert bank.stats().hot_hits >= 2 * 2  # both restores took the 2 blocks from the lease


def test_a_hybrid_model_takes_no_partial_block(tmp_path: Path) -> None:
    spec = hybrid_spec()
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        tokens = _tokens(np.random.default_rng(3), 2 * B)
        ns.store(tokens, prefix_layers(spec, tokens), {B: random_state(spec)})
        hit = ns.restore([*tokens[: B + 2], 999])
        assert hit is not None and (hit.tokens, hit.partial) == (B, 0)
        assert ns.match([*tokens[: B + 2], 999]) == B


def test_a_restore_that_finds_no_partial_block_pays_little(tmp_path: Path) -> None:
    """The lookup (one seek of the children index) on a miss: under 50 us. The best
    of 7 rounds of 200 (a shared 2-core machine's other work only adds to a round):
    ~16-25 us here."""
    with Bank.open(tmp_path / "bank", BankConfig(block_size=64)) as bank:
        ns = bank.namespace(SPEC)
        rng = np.random.default_rng(5)
        for _ in range(20):
            p = _tokens(rng, 130)
            ns.store(p, prefix_layers(SPEC, p))
        other = np.array(_tokens(rng, 100), dtype=np.uint32) + 2000  # shares no token
        hashes = ns.chain(other)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(200):
                assert find_partial(bank.store, ns.root, hashes, other, 0, 64) is None
            times.append((time.perf_counter() - start) / 200)
        assert min(times) < 50e-6, sorted(times)


def test_explain_reports_the_partial_block_or_why_not(tmp_path: Path) -> None:
    from cas_bank.maintenance.explain import explain

    with Bank.open(tmp_path / "bank", BankConfig(block_size=B)) as bank:
        prompts = _fill(bank)
        root = bank.namespace(SPEC).root
        found = explain(bank, root, [*prompts[0][:6], 999])
        assert (found.partial_kind, found.partial_tokens, found.partial_used) == ("block", 2, True)
        assert found.restorable_tokens == 6
        assert any("a restore takes them" in line for line in found.summary())
        spec = hybrid_spec()
        ns = bank.namespace(spec)
        tokens = _tokens(np.random.default_rng(3), 2 * B)
        ns.store(tokens, prefix_layers(spec, tokens), {B: random_state(spec)})
        found = explain(bank, ns.root, [*tokens[: B + 3], 999])
        assert found.partial_tokens == 3 and not found.partial_used
        assert found.partial_refused is not None and "recurrent" in found.partial_refused
        assert found.restorable_tokens == B
