"""Tenants (salts): a byte quota evicts only the over-quota tenant's own entries, and
survives a reopen; revocation removes all of a tenant in batches (one batch and a
reopen leave no hole), others stay restorable and `verify` is clean; bytes and hits
per tenant, by the salt's digest and never the salt (`cas_bank.evict.tenants`).
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cas_bank.tools import cli
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    random_layers,
    random_state,
)
from test_evict import counted, headers, open_bank, recount, store_at

from cas_bank import Bank
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import pins
from cas_bank.evict.tenants import UNSALTED, short_id, tenant_id
from cas_bank.maintenance.verify import verify

B = BLOCK_SIZE
SALT_A, SALT_B = "tenant-a-secret", "tenant-b-secret"


def block_size_bytes(path: Path) -> int:
    spec = attention_spec()
    probe, _ = open_bank(path)
    with probe:
        return probe.namespace(spec).store(list(range(B)), random_layers(spec, B)).bytes_written


def under(bank: Bank, root: bytes) -> set[bytes]:
    return {k for k, h in headers(bank.store).items() if h.root == root}


def fill(bank: Bank, clock: object, salt: str | None, base: int, n: int, t0: float) -> None:
    ns = bank.namespace(attention_spec(), salt=salt)
    for k in range(n):
        store_at(clock, t0 + k, ns, [base + k] * 2 * B, base + k)  # type: ignore[arg-type]


def test_a_quota_evicts_only_its_tenants_entries_and_survives_a_reopen(bank_path: Path) -> None:
    size = block_size_bytes(bank_path.with_name("probe"))
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        b = bank.namespace(spec, salt=SALT_B)
        kept = random_layers(spec, 3 * B, seed=3)
        b_chain = b.store(list(range(5000, 5000 + 3 * B)), kept).chain
        fill(bank, clock, None, 100, 3, 1)  # unsalted: a tenant like any other
        a = bank.namespace(spec, salt=SALT_A)
        evicted = bank.set_quota(SALT_A, 4 * size)
        assert evicted == []  # A holds nothing yet
        fill(bank, clock, SALT_A, 1000, 6, 10)  # 12 blocks of A against a quota of 4
        assert sum(1 for _ in under(bank, a.root)) == 4
        assert under(bank, b.root) == set(b_chain)
        assert len(under(bank, bank.namespace(spec).root)) == 6
        # The order is the bank's: A's newest prompts stay.
        hit = a.restore([1005] * 2 * B)
        assert hit is not None and hit.tokens == 2 * B
        assert a.restore([1000] * 2 * B) is None
        assert recount(bank) == counted(bank)
        assert bank.quotas() == {tenant_id(SALT_A): 4 * size}
    # The stored quota holds after a reopen without any config, and wins over one.
    bank, clock = open_bank(bank_path, tenant_quotas={tenant_id(SALT_A): 10 * size})
    with bank:
        assert bank.quotas() == {tenant_id(SALT_A): 4 * size}
        fill(bank, clock, SALT_A, 2000, 3, 100)
        a = bank.namespace(spec, salt=SALT_A)
        assert len(under(bank, a.root)) == 4
        b = bank.namespace(spec, salt=SALT_B)
        assert under(bank, b.root) == set(b_chain)
        hit = b.restore(list(range(5000, 5000 + 3 * B)))
        assert hit is not None and layers_bits(hit.layers, spec) == kv_prefix_bits(
            kept, spec, 3 * B
        )
        # Cleared, the config's quota applies: room for 10 blocks.
        assert bank.clear_quota(SALT_A) is True and bank.clear_quota(SALT_A) is False
        assert bank.quotas() == {tenant_id(SALT_A): 10 * size}
        fill(bank, clock, SALT_A, 3000, 5, 200)
        assert len(under(bank, a.root)) == 10
        assert under(bank, b.root) == set(b_chain)
        assert not verify(bank).problems


def test_a_quota_keeps_a_tenants_pins(bank_path: Path) -> None:
    size = block_size_bytes(bank_path.with_name("probe"))
    spec = attention_spec()
    bank, clock = open_bank(bank_path, tenant_quotas={tenant_id(SALT_A): 4 * size})
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        system = list(range(1, 2 * B + 1))
        chain = a.store(system, random_layers(spec, 2 * B)).chain
        a.pin(system)
        fill(bank, clock, SALT_A, 1000, 5, 10)
        assert set(chain) <= under(bank, a.root) and len(under(bank, a.root)) == 4
        # A quota below the pins: all but the pins go, at every store that adds more.
        bank.set_quota(SALT_A, size)
        assert under(bank, a.root) == set(chain)
        fill(bank, clock, SALT_A, 3000, 2, 30)
        assert under(bank, a.root) == set(chain)
        assert recount(bank) == counted(bank)


def test_revoke_removes_a_tenant_and_leaves_the_others(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        a, b = bank.namespace(spec, salt=SALT_A), bank.namespace(spec, salt=SALT_B)
        fill(bank, clock, SALT_A, 1000, 4, 1)
        system = list(range(1, 3 * B + 1))
        a.store(system, random_layers(spec, 3 * B))
        a.store_end([*system, 7, 8], random_layers(spec, 3 * B + 2))
        a.pin(system)
        kept = random_layers(spec, 3 * B, seed=9)
        b_chain = b.store(system, kept).chain
        fill(bank, clock, None, 100, 2, 20)
        before = bank.stats()
        report = bank.revoke(SALT_A, batch=3)
        assert report.done and report.pins == 1 and report.batches >= 4
        assert report.blocks == 11 and report.ends == 1
        assert under(bank, a.root) == set() and pins(bank.store) == []
        assert bank.stats().ends == before.ends - 1
        assert under(bank, b.root) == set(b_chain)
        hit = b.restore(system)
        assert hit is not None and layers_bits(hit.layers, spec) == kv_prefix_bits(
            kept, spec, 3 * B
        )
        assert a.restore(system) is None
        assert recount(bank) == counted(bank)
        assert not verify(bank).problems
        assert bank.revoke(SALT_A).blocks == 0  # nothing left: a no-op


def test_an_interrupted_revoke_leaves_no_hole(bank_path: Path) -> None:
    spec = attention_spec()
    bank, _clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        long = list(range(1, 8 * B + 1))
        a.store(long, random_layers(spec, 8 * B))
        a.store(long[: 4 * B] + [9] * 4 * B, random_layers(spec, 8 * B, seed=2))
        report = bank.revoke(SALT_A, batch=3, batches=1)
        assert not report.done and report.blocks == 3
    # As if the process had stopped there: the bank reopens clean, every chain whole.
    bank, _clock = open_bank(bank_path)
    with bank:
        assert not verify(bank).problems
        a = bank.namespace(spec, salt=SALT_A)
        left = headers(bank.store)
        for h in left.values():  # no hole: every block's parent is stored (or the root)
            assert h.parent == a.root or h.parent in left
        assert len(left) == 9
        assert bank.revoke(SALT_A).done
        assert headers(bank.store) == {}
        assert not verify(bank).problems


def test_bytes_and_hits_per_tenant_never_the_salt(bank_path: Path, capsys: object) -> None:
    spec = attention_spec()
    bank, _clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        prompt = list(range(1, 2 * B + 1))
        a.store(prompt, random_layers(spec, 2 * B))
        bank.namespace(spec).store(prompt, random_layers(spec, 2 * B))
        assert a.restore(prompt) is not None and a.restore(prompt) is not None
        assert a.restore([77] * B) is None  # a miss is no hit
        rows = {s.tenant: s for s in bank.tenant_stats()}
        assert set(rows) == {tenant_id(SALT_A), UNSALTED}
        mine = rows[tenant_id(SALT_A)]
        assert (mine.namespaces, mine.hits, mine.hit_tokens) == (1, 2, 2 * 2 * B)
        assert mine.bytes == sum(
            h.payload_size for h in headers(bank.store).values() if h.root == a.root
        )
        assert rows[UNSALTED].hits == 0 and rows[UNSALTED].bytes == mine.bytes
    # Persisted: the CLI shows them after the writer is gone, by digest only.
    assert cli.main(["stats", str(bank_path), "--json"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert SALT_A not in out
    tenants = {t["tenant"]: t for t in json.loads(out)["tenants"]}
    assert tenants[short_id(tenant_id(SALT_A))]["hits"] == 2
    assert tenants[short_id(UNSALTED)]["unsalted"] is True


def test_the_commands_set_show_clear_and_revoke(
    bank_path: Path, tmp_path: Path, capsys: object
) -> None:
    spec = attention_spec()
    size = block_size_bytes(bank_path.with_name("probe"))
    bank, clock = open_bank(bank_path)
    with bank:
        fill(bank, clock, SALT_A, 1000, 3, 1)
        fill(bank, clock, SALT_B, 2000, 2, 10)
        a_root = bank.namespace(spec, salt=SALT_A).root
        b_root = bank.namespace(spec, salt=SALT_B).root
    salt_file = tmp_path / "salt"
    salt_file.write_text(SALT_A + "\n")
    bank_arg = str(bank_path)
    read = capsys.readouterr  # type: ignore[attr-defined]
    read()
    assert cli.main(["quota", "set", bank_arg, "--salt-file", str(salt_file),
                     "--limit-bytes", str(2 * size), "--json"]) == 0  # fmt: skip
    out = json.loads(read().out)
    assert out["tenant"] == short_id(tenant_id(SALT_A)) and out["evicted"] == 4
    assert cli.main(["quota", "show", bank_arg, "--json"]) == 0
    text = read().out
    assert SALT_A not in text and SALT_B not in text
    rows = {r["tenant"]: r for r in json.loads(text)["tenants"]}
    assert rows[short_id(tenant_id(SALT_A))]["quota"] == 2 * size
    assert rows[short_id(tenant_id(SALT_A))]["bytes"] == 2 * size
    assert rows[short_id(tenant_id(SALT_B))]["quota"] is None
    assert cli.main(["quota", "show", bank_arg]) == 0
    assert short_id(tenant_id(SALT_A)) in read().out
    assert cli.main(["revoke", bank_arg, SALT_B, "--batch", "1", "--json"]) == 0
    out = json.loads(read().out)
    assert (out["blocks"], out["batches"], out["done"]) == (4, 4, True)
    assert cli.main(["quota", "clear", bank_arg, SALT_A]) == 0
    assert cli.main(["quota", "clear", bank_arg, SALT_A]) == 1
    assert cli.main(["quota", "set", bank_arg, "--limit-bytes", "1"]) == 1  # no tenant named
    read()
    with Bank.open(bank_path) as bank:
        assert bank.quotas() == {}
        assert {h.root for h in headers(bank.store).values()} == {a_root}
        assert b_root not in {h.root for h in headers(bank.store).values()}
        assert not verify(bank).problems


def test_metrics_per_tenant_by_digest(bank_path: Path) -> None:
    from cas_bank.runtime.metrics import render, tenant_metrics

    spec = attention_spec()
    size = block_size_bytes(bank_path.with_name("probe"))
    bank, _clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        prompt = list(range(1, 2 * B + 1))
        a.store(prompt, random_layers(spec, 2 * B))
        assert a.restore(prompt) is not None
        bank.set_quota(SALT_A, 10 * size)
        bank.namespace(spec).store(prompt[:B], random_layers(spec, B))
        text = render(tenant_metrics(bank.tenant_stats()))
    mine = f'tenant="{short_id(tenant_id(SALT_A))}",unsalted="0"'
    assert f"cas_bank_tenant_bytes{{{mine}}} {2 * size}" in text
    assert f"cas_bank_tenant_hits_total{{{mine}}} 1" in text
    assert f"cas_bank_tenant_hit_tokens_total{{{mine}}} {2 * B}" in text
    assert f"cas_bank_tenant_quota_bytes{{{mine}}} {10 * size}" in text
    plain = f'tenant="{short_id(UNSALTED)}",unsalted="1"'
    assert f"cas_bank_tenant_bytes{{{plain}}} {size}" in text
    assert SALT_A not in text


def test_revoke_takes_states_and_end_records_and_a_quota_still_holds_after(
    bank_path: Path,
) -> None:
    spec = hybrid_spec()
    probe = attention_spec()
    size = block_size_bytes(bank_path.with_name("probe"))
    bank, clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        prompt = list(range(1, 4 * B + 3))
        layers = random_layers(spec, len(prompt))
        a.store(prompt, layers, {B: random_state(spec, 1), 3 * B: random_state(spec, 2)})
        a.store_end(prompt, layers, random_state(spec, 3))
        a.store_end([5, 6], random_layers(spec, 2), random_state(spec, 4))  # under the root
        # The same tenant under another model has a quota, and its heap is kept.
        c = bank.namespace(probe, salt=SALT_A)
        bank.set_quota(SALT_A, 10**9)
        fill(bank, clock, SALT_B, 3000, 2, 5)
        report = bank.revoke(SALT_A, batch=2)
        assert report.done and (report.blocks, report.states, report.ends) == (4, 2, 2)
        assert report.namespaces == 2
        assert bank.stats().states == 0 and bank.stats().ends == 0
        assert not verify(bank).problems
        # The tenant comes back: its quota (kept) holds as before.
        bank.set_quota(SALT_A, 2 * size)
        for k in range(4):
            store_at(clock, 50 + k, c, [4000 + k] * 2 * B, k)
        assert len(under(bank, c.root)) == 2
        assert len(under(bank, bank.namespace(probe, salt=SALT_B).root)) == 4
        assert recount(bank) == counted(bank)


def test_a_namespace_without_a_tenant_record_is_a_tenant_of_its_own(bank_path: Path) -> None:
    spec = attention_spec()
    bank, _clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        a.store(list(range(1, 2 * B + 1)), random_layers(spec, 2 * B))
        bank.namespace(spec).store(list(range(B)), random_layers(spec, B))
        with bank.transaction(budget=False) as tx:  # as a bank made before the records
            for key in list(bank.store.keys(Family.META)):
                if key.startswith(b"tenant/"):
                    tx.delete(Family.META, key)
        root = a.root
    bank, _clock = open_bank(bank_path)
    with bank:
        rows = {s.tenant: s for s in bank.tenant_stats()}
        assert set(rows) == {"root:" + root[:8].hex(), UNSALTED}  # unsalted: recomputed
        bank.namespace(spec, salt=SALT_A)  # named again: recorded
        rows = {s.tenant: s for s in bank.tenant_stats()}
        assert set(rows) == {tenant_id(SALT_A), UNSALTED}
        assert rows[tenant_id(SALT_A)].bytes > 0


def test_the_bank_serves_others_while_a_revoke_runs(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        fill(bank, clock, SALT_A, 1000, 40, 1)
        b = bank.namespace(spec, salt=SALT_B)
        prompt = list(range(1, 3 * B + 1))
        kept = random_layers(spec, 3 * B, seed=5)
        b.store(prompt, kept)
        want = kv_prefix_bits(kept, spec, 3 * B)
        stop = threading.Event()
        served: list[int] = []
        failed: list[BaseException] = []

        def other_tenant() -> None:
            try:
                k = 0
                while not stop.is_set():
                    hit = b.restore(prompt)
                    assert hit is not None and layers_bits(hit.layers, spec) == want
                    b.store([9000 + k] * B, random_layers(spec, B, seed=k))
                    served.append(k)
                    k += 1
            except BaseException as e:
                failed.append(e)

        worker = threading.Thread(target=other_tenant)
        worker.start()
        try:
            report = bank.revoke(SALT_A, batch=1)
        finally:
            stop.set()
            worker.join()
        assert not failed and served
        assert report.done and report.blocks == 80 and report.batches == 80
        assert not verify(bank).problems
        assert len(under(bank, b.root)) == 3 + len(served)


def test_quotas_pins_revokes_and_a_budget_at_random_keep_every_invariant(
    bank_path: Path,
) -> None:
    spec = attention_spec()
    size = block_size_bytes(bank_path.with_name("probe"))
    rng = random.Random(44)
    salts = [None, SALT_A, SALT_B, "tenant-c-secret"]
    quotas = {SALT_A: 6 * size, "tenant-c-secret": 3 * size}
    bank, clock = open_bank(bank_path, max_bytes=30 * size)
    with bank:
        spaces = {s: bank.namespace(spec, salt=s) for s in salts}
        for s, q in quotas.items():
            bank.set_quota(s, q)
        for step in range(150):
            clock.now = step + 1
            salt = rng.choice(salts)
            ns = spaces[salt]
            op = rng.random()
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 5) * B)]
            if op < 0.75:
                ns.store(tokens, random_layers(spec, len(tokens), seed=step))
                if rng.random() < 0.3:
                    ns.store_end([*tokens, 1], random_layers(spec, len(tokens) + 1, seed=step))
            elif op < 0.85 and ns.match(tokens[:B]) >= B:
                with contextlib.suppress(ValueError):  # over pin_share: refused
                    ns.pin(tokens[:B])
            elif op < 0.9:
                bank.revoke(salt, batch=rng.randrange(1, 4))
            else:
                ns.restore(tokens)
            stored = headers(bank.store)
            for key, h in stored.items():  # no hole
                assert h.parent == h.root or h.parent in stored, key.hex()
            held = {s.tenant: s.bytes for s in bank.tenant_stats()}
            pinned = {p.root for p in pins(bank.store)}
            for s, q in quotas.items():
                if spaces[s].root not in pinned:
                    assert held.get(tenant_id(s), 0) <= q, (step, s)
            assert recount(bank) == counted(bank)
        assert not verify(bank).problems
        s = bank.stats()
        assert s.blocks_evicted > 50 and s.blocks > 10  # quotas and the budget both bit


@pytest.fixture(params=["serve", "mlx-lm-server"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A real server process on a fresh bank: its URL and the model name it answers to."""
    import server_kit as srv
    import test_mlx_lm_server as mlx
    from hf_models import model_dir

    bank, log = tmp_path / "bank", tmp_path / "server.log"
    if request.param == "serve":
        s = srv.start_server(bank, log)
        try:
            yield s.url, srv.MODEL
        finally:
            s.stop()
    else:
        m = mlx.start(bank, model_dir(tmp_path / "model", "tiny-qwen3"), log)
        try:
            yield m.url, "default_model"
        finally:
            assert m.stop() == 0, log.read_text()


def test_metrics_of_a_real_server_show_tenants_by_digest(served: tuple[str, str]) -> None:
    import httpx

    url, model = served

    def ask(salt: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "the same question, twice over"}],
            "max_tokens": 2,
            "cache_salt": salt,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    ask(SALT_A)
    deadline = time.monotonic() + 30
    while True:  # the answer's store is written by the background writer
        ask(SALT_A)
        text = httpx.get(f"{url}/metrics", timeout=30).text
        mine = f'tenant="{short_id(tenant_id(SALT_A))}",unsalted="0"'
        hits = [
            ln for ln in text.splitlines() if ln.startswith(f"cas_bank_tenant_hits_total{{{mine}}}")
        ]
        if (hits and float(hits[0].split()[-1]) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hits and float(hits[0].split()[-1]) > 0, text
    size = [ln for ln in text.splitlines() if ln.startswith(f"cas_bank_tenant_bytes{{{mine}}}")]
    assert size and float(size[0].split()[-1]) > 0
    assert SALT_A not in text


_CRASHING_REVOKE = """
import os, sys
import cas_bank.evict.tenants as tenants
from cas_bank import Bank, BankConfig

real, calls = tenants.evict_tenant, []

def evict_then_die(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(out)
    if len(calls) == 2:
        os._exit(3)  # no close, no flush: as a SIGKILL after the second batch
    return out

tenants.evict_tenant = evict_then_die
bank = Bank.open(sys.argv[1], BankConfig(block_size=int(sys.argv[2])))
bank.revoke(sys.argv[3], batch=2)
"""


def test_a_process_dying_between_revoke_batches_leaves_no_hole(bank_path: Path) -> None:
    import subprocess
    import sys

    spec = attention_spec()
    bank, _clock = open_bank(bank_path)
    with bank:
        a = bank.namespace(spec, salt=SALT_A)
        long = list(range(1, 6 * B + 1))
        a.store(long, random_layers(spec, 6 * B))
        a.store(long[: 2 * B] + [9] * 3 * B, random_layers(spec, 5 * B, seed=2))
        b = bank.namespace(spec, salt=SALT_B)
        b_chain = b.store(long, random_layers(spec, 6 * B, seed=3)).chain
    done = subprocess.run(
        [sys.executable, "-c", _CRASHING_REVOKE, str(bank_path), str(B), SALT_A],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    bank, _clock = open_bank(bank_path)
    with bank:
        assert not verify(bank).problems
        left = headers(bank.store)
        a_root = bank.namespace(spec, salt=SALT_A).root
        assert len([h for h in left.values() if h.root == a_root]) == 9 - 4
        for h in left.values():
            assert h.parent == h.root or h.parent in left
        assert under(bank, bank.namespace(spec, salt=SALT_B).root) == set(b_chain)
        assert bank.revoke(SALT_A).done and not under(bank, a_root)
        assert recount(bank) == counted(bank)
