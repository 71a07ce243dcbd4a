"""`cas_bank.explain`, `cas-bank explain` and the server's `POST /v1/explain`: why a
prompt did (not) hit, checked against what a restore really returns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.server import create_app
from cas_bank.tools.cli import main as cli_main
from fastapi.testclient import TestClient
from runtime_helpers import random_tokens, tiny
from test_bank_corruption import _corrupt

from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family
from cas_bank.explain import explain
from cas_bank.index.evict import evict_to_budget

BLOCK = 16


def stored_bank(path: Path, model: str, tokens: list[int]) -> PrefixCache:
    bank = Bank.open(path, BankConfig(block_size=BLOCK))
    pc = PrefixCache(bank, tiny(model))
    cache, _ = pc.restore(tokens)
    pc.prefill(tokens, cache)
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
        assert (e.matched_blocks, e.stop, e.restorable_tokens) == (2, "diverged", 32)
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
    assert answer["restorable_tokens"] == answer["divergence"]["token"] // BLOCK * BLOCK
    assert prompt[: answer["divergence"]["token"]] == other_ids[: answer["divergence"]["token"]]

    file = tmp_path / "tokens.json"
    file.write_text(json.dumps(other_ids[:-1]))
    assert cli_main(["explain", str(tmp_path / "bank"), "--tokens", str(file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in shown.items() if k != "blocks_evicted"} == {
        k: v for k, v in answer.items() if k not in ("prompt_tokens", "blocks_evicted")
    }
    assert cli_main(["explain", str(tmp_path / "bank"), "--tokens", str(file)]) == 0
    assert "diverges in block" in capsys.readouterr().out
