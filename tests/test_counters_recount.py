"""A bank's counters stay exact over any sequence of stores, imports (the same bundle
again too) and evictions: what is stored (blocks, states, their bytes, end records,
namespaces) equals a recount from the records after every step and after a reopen,
and `logical_tokens` follows its rule: a store adds the tokens of its full blocks
(found or written: dedup), an import only those of the blocks it added (a copy is no
request), an eviction nothing. Importing a bundle twice left the dedup ratio at 2.00."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cas_bank.tools.cli import main
from conftest import BLOCK_SIZE, attention_spec, hybrid_spec, prefix_layers, random_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig, ModelSpec
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index.chain import Header
from cas_bank.maintenance.bundle import chain_for_tokens, export_chain, import_bundle

B = BLOCK_SIZE
ATTN, HYBRID = attention_spec(), hybrid_spec()
SYSTEM = list(range(100, 100 + 2 * B))
# (spec, tokens, whether a store also writes its end record): chains that share a
# prefix, one with a partial tail, a hybrid one with states at two boundaries.
PROMPTS: list[tuple[ModelSpec, list[int], bool]] = [
    (ATTN, [*SYSTEM, *range(200, 200 + B)], False),
    (ATTN, [*SYSTEM, *range(300, 300 + 2 * B)], False),
    (ATTN, [*range(400, 400 + 2 * B), 7, 8], True),
    (HYBRID, list(range(500, 500 + 3 * B)), True),
]


def _store(bank: Bank, i: int) -> None:
    spec, tokens, end = PROMPTS[i]
    ns = bank.namespace(spec)
    layers = prefix_layers(spec, tokens)
    states = None
    if spec is HYBRID:
        states = {B: random_state(spec, 1), 2 * B: random_state(spec, 2)}
    ns.store(tokens, layers, states)
    if end:
        ns.store_end(tokens, layers, random_state(spec, 3) if spec is HYBRID else None)


@functools.cache
def _bundles() -> list[Path]:
    """One bundle per prompt (its chain, states and end record), exported once."""
    where = Path(tempfile.mkdtemp(prefix="cas_bank_counter_bundles_"))
    out = []
    with Bank.open(where / "source", BankConfig(block_size=B)) as bank:
        for i, (spec, tokens, _) in enumerate(PROMPTS):
            _store(bank, i)
            path = where / f"{i}.casb"
            export_chain(bank, chain_for_tokens(bank, bank.namespace(spec).root, tokens), path)
            out.append(path)
    return out


def recount(bank: Bank) -> dict[str, int]:
    headers = [Header.decode(k, v) for k, v in bank.store.iterate(Family.HEADERS)]
    ends = [v for _, v in bank.store.iterate(Family.ENDS)]
    return {
        "blocks": len(headers),
        "states": sum(h.has_state for h in headers),
        "payload_bytes": sum(h.payload_size for h in headers),
        "state_bytes": sum(h.state_size for h in headers),
        "ends": len(ends),
        "end_bytes": sum(len(v) for v in ends),
        "namespaces": sum(1 for _ in bank.store.keys(Family.NAMESPACES)),
        "unique_tokens": len(headers) * B,
    }


def counted(bank: Bank) -> dict[str, int]:
    s = bank.stats().model_dump()
    return {k: s[k] for k in recount(bank)}


Op = tuple[str, Any]
OPS = st.one_of(
    st.tuples(st.just("store"), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("import"), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("evict"), st.floats(0.0, 1.0)),
)


def _apply(bank: Bank, op: Op) -> int:
    """Do `op`; the logical tokens it should add."""
    kind, arg = op
    if kind == "store":
        _store(bank, arg)
        return len(PROMPTS[arg][1]) // B * B
    if kind == "import":
        before = {k for k, _ in bank.store.iterate(Family.HEADERS, values=False)}
        report = import_bundle(bank, _bundles()[arg])
        spec, tokens, _ = PROMPTS[arg]
        chain = bank.namespace(spec).chain(tokens)
        assert report.blocks_written == len([h for h in chain if h not in before])
        return len([h for h in chain if h not in before]) * B
    v = bank.stats()
    evict_to_budget(bank, int((v.payload_bytes + v.state_bytes + v.end_bytes) * arg))
    return 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=8))
def test_counters_equal_a_recount_after_any_stores_imports_and_evictions(ops: list[Op]) -> None:
    path = Path(tempfile.mkdtemp(prefix="cas_bank_counters_"))
    try:
        logical = 0
        with Bank.open(path, BankConfig(block_size=B)) as bank:
            for op in ops:
                logical += _apply(bank, op)
                assert counted(bank) == recount(bank), op
                assert bank.stats().logical_tokens == logical, op
        with Bank.open(path) as bank:  # what was persisted is what was counted
            assert counted(bank) == recount(bank)
            assert bank.stats().logical_tokens == logical
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_importing_a_bundle_twice_keeps_the_dedup_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI, as the issue met it: `import` twice, `stats` says 1.00."""
    bank = tmp_path / "bank"
    bundle = str(_bundles()[0])
    assert main(["import", str(bank), bundle, "--create"]) == 0
    assert main(["import", str(bank), bundle]) == 0
    assert "0 of 3 blocks (3 already stored)" in capsys.readouterr().out
    assert main(["stats", str(bank)]) == 0
    out = capsys.readouterr().out
    assert "dedup ratio     1.00" in out and "logical tokens  12" in out, out
