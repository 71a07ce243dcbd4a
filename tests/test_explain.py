"""`cas_bank.maintenance.explain`, `cas-bank explain` and the server's `POST /v1/explain`: why a
prompt did (not) hit, checked against what a restore really returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cas_bank.runtime import PrefillCancelled, PrefixCache
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.server import create_app
from cas_bank.tools.cli import main as cli_main
from conftest import attention_spec, hybrid_spec, random_layers, random_state
from fastapi.testclient import TestClient
from rocksdict import Options, Rdict
from runtime_helpers import random_tokens, tiny
from test_bank_corruption import _corrupt

from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family
from cas_bank.evict.evicted import Removal
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.maintenance.explain import explain
from cas_bank.maintenance.verify import verify

BLOCK = 16
SMALL = 4


def stored_bank(path: Path, model: str, tokens: list[int]) -> PrefixCache:
    bank = Bank.open(path, BankConfig(block_size=BLOCK))
    pc = PrefixCache(bank, tiny(model))
    cache, _ = pc.restore(tokens)
    pc.prefill(tokens, cache, end=False)  # the chain alone (end records: their own test)
    bank.flush()  # stored: committed by the background writer
    return pc


def restored(pc: PrefixCache, tokens: list[int]) -> int:
    hit = pc.namespace.restore(tokens)
    return hit.tokens if hit is not None else 0


def test_matched_diverged_absent_corrupt_and_evicted(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = random_tokens(rng, 5 * BLOCK + 3)
    pc = stored_bank(tmp_path / "bank", "tiny-qwen3", a)
    bank, root = pc.bank, pc.namespace.root
    try:
        e = explain(bank, root, a)
        assert (e.matched_blocks, e.restorable_tokens, e.stop, e.tail_tokens) == (
            5,
            80,
            "complete",
            3,
        )

        b = [*a[:40], (a[40] + 1) % 512, *a[41:]]
        e = explain(bank, root, b)
        # Two whole blocks, then the first 8 tokens of a's block 2 (a partial block).
        assert (e.matched_blocks, e.stop, e.restorable_tokens) == (2, "diverged", 40)
        assert (e.partial_kind, e.partial_tokens, e.partial_used) == ("block", 8, True)
        assert e.divergence is not None
        assert (e.divergence.block, e.divergence.token) == (2, 40)
        assert (e.divergence.prompt_token, e.divergence.stored_token) == (b[40], a[40])
        assert any("token 40" in line for line in e.summary())

        longer = a[: 5 * BLOCK] + random_tokens(rng, 2 * BLOCK)
        e = explain(bank, root, longer)
        assert (e.stop, e.matched_blocks, e.divergence) == ("absent", 5, None)
        assert e.missing == "never_stored" and e.memory_horizon is None
        assert "was never stored here" in " ".join(e.summary())
        for tokens in (a, b, longer):
            assert explain(bank, root, tokens).restorable_tokens == restored(pc, tokens)
    finally:
        bank.close()

    _corrupt(tmp_path / "bank", Family.BLOCKS, pc.namespace.chain(a)[3], "flip")
    with Bank.open(tmp_path / "bank") as bank:
        e = explain(bank, root, a)
        assert (e.stop, e.restorable_tokens, e.matched_blocks) == ("corrupt", 48, 5)
        assert [(c.block, c.record, c.why) for c in e.corrupt] == [
            (3, "payload", "fails its digest")
        ]
        evict_to_budget(bank, 0)
        e = explain(bank, root, a)
        assert (e.stop, e.matched_blocks, e.blocks_evicted) == ("absent", 0, 5)
        assert (e.missing, e.evicted_by) == ("evicted", "budget")
        assert "was evicted at " in " ".join(e.summary())


def test_a_hybrid_restore_stops_at_the_deepest_boundary_with_a_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = random_tokens(rng, 4 * BLOCK + 5)  # states at 64 (before the last token) only
    pc = stored_bank(tmp_path / "bank", "tiny-hybrid", a)
    try:
        assert pc.last_prefill is not None and pc.last_prefill.captured == [64]
        bank, root = pc.bank, pc.namespace.root
        e = explain(bank, root, a[: 3 * BLOCK + 2])  # matches 3 blocks, no state among them
        assert (e.matched_blocks, e.state_at, e.restorable_tokens, e.stop) == (
            3,
            None,
            0,
            "no_state",
        )
        assert e.boundaries_without_state == [16, 32, 48]
        e = explain(bank, root, a)
        assert (e.state_at, e.restorable_tokens, e.stop) == (64, 64, "complete")
        for n in (BLOCK, 3 * BLOCK + 2, len(a)):
            assert explain(bank, root, a[:n]).restorable_tokens == restored(pc, a[:n])
    finally:
        pc.bank.close()


def test_a_corrupt_first_block_of_a_hybrid_is_named_as_the_reason(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = random_tokens(rng, 5 * BLOCK)
    pc = stored_bank(tmp_path / "bank", "tiny-hybrid", a)
    chain = pc.namespace.chain(a)
    pc.bank.close()
    _corrupt(tmp_path / "bank", Family.BLOCKS, chain[0], "flip")
    with Bank.open(tmp_path / "bank") as bank:
        e = explain(bank, pc.namespace.root, a)
        assert (e.stop, e.restorable_tokens, e.state_at) == ("corrupt", 0, None)
        said = " ".join(e.summary())
        assert "before the first corrupt block" in said and "block 0" in said
        assert "no matched boundary holds" not in said


def test_the_command_and_the_server_say_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank = Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK))
    messages = [{"role": "system", "content": "be brief " * 10}, {"role": "user", "content": "hi"}]
    with Engine(tiny("tiny-qwen3"), bank, owns_bank=True) as engine:
        client = TestClient(create_app(engine))
        prompt = engine.chat_prompt(messages)
        body = {"model": engine.model_id, "messages": messages, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        other = [*messages[:1], {"role": "user", "content": "hello"}]
        served = client.post("/v1/explain", json={"messages": other})
        assert served.status_code == 200, served.text
        bad = client.post("/v1/explain", json={"prompt": [1, "x"]})
        assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
    answer = served.json()
    other_ids = engine.chat_prompt(other)
    assert answer["prompt_tokens"] == len(other_ids)
    assert answer["stop"] == "diverged" and answer["divergence"]["token"] >= BLOCK
    # Every token before the divergence: the whole blocks, then a partial block.
    assert answer["restorable_tokens"] == answer["divergence"]["token"]
    assert (
        answer["partial_used"] and answer["partial_tokens"] == answer["divergence"]["token"] % BLOCK
    )
    at = answer["divergence"]["token"]
    assert prompt[:at] == other_ids[:at]
    # Any client may ask: the answer names no token of the stored prompt it left.
    assert prompt[at] != other_ids[at] and "stored_token" not in answer["divergence"]
    assert "sibling" not in answer["divergence"]
    said = " ".join(answer["summary"])
    assert f"has {prompt[at]}" not in said and "a stored block has another" in said

    file = tmp_path / "tokens.json"
    file.write_text(json.dumps(other_ids))  # the server explains the prompt it restores
    assert cli_main(["explain", str(tmp_path / "bank"), "--tokens", str(file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # The command (the bank's owner, local) also says the stored token.
    assert shown["divergence"].pop("stored_token") == prompt[at]
    assert shown["divergence"].pop("sibling")
    skip = ("prompt_tokens", "blocks_evicted", "summary")
    assert {k: v for k, v in shown.items() if k not in skip} == {
        k: v for k, v in answer.items() if k not in skip
    }
    assert cli_main(["explain", str(tmp_path / "bank"), "--tokens", str(file)]) == 0
    assert "diverges in block" in capsys.readouterr().out


# -- evicted or never stored (the removal records of `cas_bank.evict.evicted`) ----------
class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def clocked_bank(path: Path, **settings: Any) -> tuple[Bank, Clock]:
    bank = Bank.open(path, BankConfig(block_size=SMALL, **settings))
    clock = Clock(1_700_000_000.0)
    bank.access.set_clock(clock)
    return bank, clock


def test_an_evicted_block_is_told_from_one_never_stored(tmp_path: Path) -> None:
    spec = attention_spec()
    bank, clock = clocked_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(spec)
        a = list(range(1, 3 * SMALL + 1))
        ns.store(a, random_layers(spec, len(a), seed=1))
        size = bank.stats().payload_bytes // 3
        clock.now += 60
        b = list(range(100, 100 + 2 * SMALL))
        ns.store(b, random_layers(spec, len(b), seed=2))
        never = list(range(500, 500 + 2 * SMALL))
        assert explain(bank, ns.root, never).missing == "never_stored"

        # A budget that holds two blocks: the older chain goes, block by block.
        clock.now += 60
        evicted_at = clock.now
        report = evict_to_budget(bank, 2 * size)
        assert report.blocks_evicted == 3
        e = explain(bank, ns.root, a)
        # (b's first block is a stored sibling of a's: the chain diverges at token 0)
        assert (e.stop, e.matched_blocks, e.missing) == ("diverged", 0, "evicted")
        assert (e.evicted_at, e.evicted_by, e.memory_horizon) == (evicted_at, "budget", None)
        text = " ".join(e.summary())
        assert "was evicted at 2023-11-14T22:15:20Z by the byte budget" in text
        assert e.as_dict()["evicted_by"] == "budget"
        e = explain(bank, ns.root, never)
        assert (e.matched_blocks, e.missing) == (0, "never_stored")
        assert "was never stored here" in " ".join(e.summary())
        # The stored chain, one token changed in its second block: not evicted either.
        e = explain(bank, ns.root, [*b[:SMALL], b[SMALL] + 1, *b[SMALL + 1 :]])
        assert (e.stop, e.missing, e.matched_blocks) == ("diverged", "never_stored", 1)

        # Stored again: the record goes with the same batch.
        ns.store(a, random_layers(spec, len(a), seed=1))
        assert explain(bank, ns.root, a).stop == "complete"
        evicted = list(bank.store.iterate(Family.EVICTED))
        assert not [k for k, _ in evicted if k.startswith(b"r")]


def test_gc_and_verify_fix_name_themselves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = attention_spec()
    path = tmp_path / "bank"
    a = list(range(1, 3 * SMALL + 1))
    b = list(range(100, 100 + 2 * SMALL))
    with Bank.open(path, BankConfig(block_size=SMALL)) as bank:
        ns = bank.namespace(spec)
        chain_a = ns.store(a, random_layers(spec, len(a), seed=1)).chain
        ns.store(b, random_layers(spec, len(b), seed=2))
        root = ns.root
    _corrupt(path, Family.BLOCKS, chain_a[1], "flip")
    with Bank.open(path) as bank:
        report = verify(bank, fix=True)
        assert sorted(report.removed_blocks) == sorted(chain_a[1:])
        e = explain(bank, root, a)
        assert (e.matched_blocks, e.missing, e.evicted_by) == (1, "evicted", "damaged")
        assert "by verify --fix, as damaged" in " ".join(e.summary())
        e = explain(bank, root, [*a[: 2 * SMALL], a[2 * SMALL] + 1, *a[2 * SMALL + 1 :]])
        assert e.missing == "evicted" and e.evicted_by == "damaged"
        raw = bank.store.get(Family.EVICTED, b"r" + chain_a[2])
        assert raw is not None
        r = Removal.decode(raw)
        assert r is not None and r.reason == "unreachable"

    file = tmp_path / "tokens.json"
    file.write_text(json.dumps(b))
    assert cli_main(["gc", str(path), "--max-bytes", "0"]) == 0
    capsys.readouterr()
    assert cli_main(["explain", str(path), "--tokens", str(file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["missing"], shown["evicted_by"]) == ("evicted", "gc")
    assert cli_main(["explain", str(path), "--tokens", str(file)]) == 0
    assert "by cas-bank gc" in capsys.readouterr().out


def test_a_state_evicted_on_its_own_is_named(tmp_path: Path) -> None:
    spec = hybrid_spec()
    bank, clock = clocked_bank(tmp_path / "bank")
    with bank:
        ns = bank.namespace(spec)
        toks = list(range(1, 3 * SMALL + 1))
        layers = random_layers(spec, len(toks), seed=1)
        ns.store(toks, layers, {SMALL: random_state(spec, 1), 3 * SMALL: random_state(spec, 2)})
        clock.now += 10
        hit = ns.restore(toks[: SMALL + 1])  # the shallow state is used: the deep one is older
        assert hit is not None and hit.tokens == SMALL
        clock.now += 10
        stats = bank.stats()
        evict_to_budget(bank, stats.payload_bytes + stats.state_bytes - 1)  # one state goes
        e = explain(bank, ns.root, toks)
        assert (e.stop, e.state_at, e.boundaries_without_state) == ("no_state", SMALL, [8, 12])
        assert [(s.boundary, s.at, s.by) for s in e.states_evicted] == [(12, clock.now, "budget")]
        assert "the state at token 12 was removed at " in " ".join(e.summary())


def test_the_memory_is_bounded_and_says_its_horizon(tmp_path: Path) -> None:
    spec = attention_spec()
    bank, clock = clocked_bank(tmp_path / "bank", eviction_memory=2)
    with bank:
        ns = bank.namespace(spec)
        prompts = [list(range(k * 1000, k * 1000 + SMALL)) for k in range(5)]
        times = []
        for p in prompts:  # one block each, evicted one at a time
            clock.now += 10
            ns.store(p, random_layers(spec, len(p), seed=p[0]))
            times.append(clock.now)
            evict_to_budget(bank, 0)
        records = [k for k, _ in bank.store.iterate(Family.EVICTED) if k.startswith(b"r")]
        assert len(records) == 2
        for p, t in zip(prompts[3:], times[3:], strict=True):
            e = explain(bank, ns.root, p)
            assert (e.missing, e.evicted_at) == ("evicted", t)
        e = explain(bank, ns.root, prompts[0])  # its record was dropped for the cap
        assert (e.missing, e.memory_horizon) == ("not_recorded", times[2])
        assert "or removed at 2023-11-14T22:13:50Z or before" in " ".join(e.summary())
    # A smaller cap at reopen keeps the newest record.
    with Bank.open(tmp_path / "bank", BankConfig(eviction_memory=1)) as bank:
        assert explain(bank, ns.root, prompts[4]).missing == "evicted"
        e = explain(bank, ns.root, prompts[3])
        assert (e.missing, e.memory_horizon) == ("not_recorded", times[3])


def test_a_bank_from_before_removal_records_says_what_it_can(tmp_path: Path) -> None:
    spec = attention_spec()
    path = tmp_path / "bank"
    a, b = list(range(1, 2 * SMALL + 1)), list(range(100, 100 + 2 * SMALL))
    with Bank.open(path, BankConfig(block_size=SMALL)) as bank:
        ns = bank.namespace(spec)
        root = ns.root
        ns.store(a, random_layers(spec, len(a), seed=1))
        evict_to_budget(bank, 0)
        ns.store(b, random_layers(spec, len(b), seed=2))
    # As a bank written before the `evicted` family: RocksDB without it.
    families = {n: Options(raw_mode=True) for n in Rdict.list_cf(str(path))}
    db = Rdict(str(path), options=Options(raw_mode=True), column_families=families)
    db.drop_column_family("evicted")
    db.close()
    del db
    with Bank.open(path, mode="read_only") as bank:
        e = explain(bank, root, a)
        assert (e.missing, e.memory_horizon, e.blocks_evicted) == ("not_recorded", None, 2)
        assert "before this bank recorded removals" in e.summary()[-1]
    with Bank.open(path) as bank:  # a writer begins recording; what went before is past
        e = explain(bank, root, a)
        assert e.missing == "not_recorded" and e.memory_horizon is not None
        evict_to_budget(bank, 0)
        e = explain(bank, root, b)
        assert (e.missing, e.evicted_by) == ("evicted", "budget")


def test_an_end_record_is_explained_and_counted_as_a_restore_does(tmp_path: Path) -> None:
    """An exact repeat and an extension of a finished request: explain reports the end
    record and the tokens a restore covers through it (hybrid: no boundary state)."""
    rng = np.random.default_rng(9)
    a = random_tokens(rng, 3 * BLOCK + 5)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK)) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        cache = pc.new_cache()
        pc.prefill(a, cache, store=False)  # no boundary state is captured
        pc.store(a, cache)
        pc.store_end(a, cache)
        bank.flush()  # committed: explain reads the bank
        root = pc.namespace.root
        before = explain(bank, root, a)
        assert before.end_record_tokens == len(a) == before.restorable_tokens
        assert not before.end_record_logits
        assert any("exact repeat, but without its logits" in x for x in before.summary())
        longer = [*a, 1, 2, 3]
        e = explain(bank, root, longer)
        assert (e.end_record_tokens, e.restorable_tokens) == (len(a), len(a))
        assert e.restorable_tokens == restored(pc, longer)
        other = [*a[:-1], (a[-1] + 1) % 200]  # the same blocks, another tail
        e = explain(bank, root, other)
        assert e.end_record_tokens is None and e.restorable_tokens == restored(pc, other) == 0


def test_a_hybrid_restore_from_an_end_record_is_not_called_nothing_to_restore(
    tmp_path: Path,
) -> None:
    """A cancelled prefill of a hybrid model whose chunks cross the block grid stores its
    state in an end record between two boundaries (no block holds one): explain says the
    restore resumes from that record, and what stops it after, not "no_state"."""
    rng = np.random.default_rng(11)
    a = random_tokens(rng, 5 * BLOCK + 3)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK)) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"), chunk_size=24)  # across the grid
        cache, _ = pc.restore(a)
        with pytest.raises(PrefillCancelled):
            pc.prefill(a, cache, cancelled=lambda: True)  # stopped after the first chunk
        bank.flush()  # committed: explain reads the bank
        root = pc.namespace.root
        e = explain(bank, root, a)
        assert (e.matched_blocks, e.state_at, e.end_record_tokens) == (1, None, 24)
        assert e.restorable_tokens == restored(pc, a) == 24
        assert e.stop == "absent"  # block 1 is not stored: the record is all there is
        said = " ".join(e.summary())
        assert "the restore resumes from the end record at token 24" in said
        assert "nothing to restore" not in said
        e = explain(bank, root, a[:24])  # the cut prompt itself: nothing after the record
        assert (e.restorable_tokens, e.stop) == (24, "complete")
