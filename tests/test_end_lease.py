"""An end record's decoded arrays, leased (`Leases.put_end`, `Leases.end`): a restore of
the same end again in this process reads, checks and copies none of its payload, and
gets the same bits; a record rewritten since (another payload digest) or evicted is
never served from an old lease; and nothing a runtime does to the arrays it was handed
reaches the bank's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from conftest import (
    BLOCK_SIZE,
    bits,
    end_leases,
    hybrid_spec,
    layers_bits,
    prefix_layers,
    random_logits,
    random_state,
    state_bits,
    stored_hybrid_end,
    tokens_of,
)
from runtime_helpers import straight_logits, temp_bank, tiny

from cas_bank import Bank, BankConfig
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index import ends

B = BLOCK_SIZE
HYBRID = hybrid_spec()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The keys of the end records whose payloads are decoded from here on."""
    seen: list[bytes] = []
    real = ends.decode_end

    def counting(spec: Any, header: ends.EndHeader, payload: Any) -> ends.EndPayload:
        seen.append(header.key())
        return real(spec, header, payload)

    monkeypatch.setattr(ends, "decode_end", counting)
    return seen


def test_an_end_record_is_decoded_once_then_restored_from_its_lease(
    bank: Bank, decodes: list[bytes]
) -> None:
    tokens, _, state = stored_hybrid_end(bank, 2 * B + 3, logits=random_logits(1))
    ns = bank.namespace(HYBRID)
    first = ns.restore(tokens)
    assert first is not None and first.exact and len(decodes) == 1
    (entry,) = end_leases(bank)
    assert entry.nbytes > 0 and bank.stats().leased_bytes >= entry.nbytes
    for _ in range(3):
        again = ns.restore(tokens)
        assert again is not None and again.tokens == len(tokens) and again.exact
        assert layers_bits(again.layers, HYBRID) == layers_bits(first.layers, HYBRID)
        assert state_bits(again.layers, HYBRID) == state_bits(state, HYBRID)
        assert bits(again.logits) == bits(random_logits(1))  # type: ignore[arg-type]
    assert len(decodes) == 1  # the payload was read, checked and copied once
    # An extension of the prompt resumes from the same end, from the lease as well.
    longer = ns.restore([*tokens, 9, 9], room_for=len(tokens) + 2)
    assert longer is not None and longer.tokens == len(tokens) and longer.logits is None
    assert state_bits(longer.layers, HYBRID) == state_bits(state, HYBRID)
    assert len(decodes) == 1


def test_a_record_rewritten_since_is_decoded_again(bank: Bank, decodes: list[bytes]) -> None:
    """The lease names the payload digest it was decoded from: a record that now holds
    more (logits and a hidden state added under the same key) is read again."""
    tokens, _, state = stored_hybrid_end(bank, 3 * B + 5)
    ns = bank.namespace(HYBRID)
    hit = ns.restore(tokens)
    assert hit is not None and hit.logits is None and len(decodes) == 1
    assert ns.store_end(tokens, prefix_layers(HYBRID, tokens), state, logits=random_logits(2)) > 0
    hit = ns.restore(tokens)
    assert hit is not None and bits(hit.logits) == bits(random_logits(2))  # type: ignore[arg-type]
    assert len(decodes) == 2
    hit = ns.restore(tokens)
    assert hit is not None and bits(hit.logits) == bits(random_logits(2))  # type: ignore[arg-type]
    assert len(decodes) == 2


def test_an_evicted_record_is_not_restored_from_its_lease(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        tokens, _, _ = stored_hybrid_end(bank, 2 * B + 3, logits=random_logits(3))
        ns = bank.namespace(HYBRID)
        assert ns.restore(tokens) is not None and end_leases(bank)
        evict_to_budget(bank, 0)
        assert bank.stats().ends == 0
        assert not end_leases(bank)  # the decoded arrays went with the record
        assert ns.restore(tokens) is None
        assert bank.leases is not None
        leases = bank.leases
    assert leases.used_bytes == 0 and not leases._entries  # nothing held past close()


def test_a_revoked_tenants_end_leases_go_with_its_records(bank: Bank) -> None:
    tokens = tokens_of(np.random.default_rng(9), 2 * B + 3)
    layers = prefix_layers(HYBRID, tokens)
    ns = bank.namespace(HYBRID, salt="tenant-a")
    ns.store(tokens, layers)
    assert ns.store_end(tokens, layers, random_state(HYBRID, 9), logits=random_logits(9)) > 0
    assert ns.restore(tokens) is not None and end_leases(bank)
    assert bank.revoke("tenant-a").ends == 1
    assert not end_leases(bank)


def test_without_a_memory_budget_nothing_is_leased(tmp_path: Path, decodes: list[bytes]) -> None:
    with Bank.open(tmp_path / "b", BankConfig(block_size=B, hot_bytes=0)) as bank:
        tokens, _, state = stored_hybrid_end(bank, 2 * B + 3)
        ns = bank.namespace(HYBRID)
        for n in (1, 2):
            hit = ns.restore(tokens)
            assert hit is not None and state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
            assert len(decodes) == n


def test_a_leased_end_state_is_never_written_by_the_caches_it_went_to() -> None:
    """tiny-hybrid: a prompt that ends off a boundary, stored by a prefill with its end
    record; two restores from the lease, the first one's state written in place the way
    a runtime could, and the second still exact against a straight prefill."""
    lm = tiny("tiny-hybrid")
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 200, 3 * 16 + 7)]
    with temp_bank(16) as bank:
        pc = PrefixCache(bank, lm)
        pc.prefill(tokens, pc.new_cache())
        bank.flush()
        assert bank.leases is not None
        for key in [k for k in bank.leases._entries if len(k) == 65 and k[:1] == b"l"]:
            bank.leases._drop(key)  # the conversation's live cache: not what is tested
        first, n = pc.restore([*tokens, 10])  # (an exact repeat keeps a token to prefill)
        assert n == len(tokens) and end_leases(bank)
        before = [bits(a) for e in end_leases(bank) for a in e.arrays]
        pc.model(mx.array([[7, 8]]), cache=first)
        for c in first:
            if not hasattr(c, "keys"):
                for i in range(len(c.cache)):
                    c.cache[i][...] = 0
        mx.eval([c.state for c in first])
        assert [bits(a) for e in end_leases(bank) for a in e.arrays] == before
        again, n = pc.restore([*tokens, 11])
        assert n == len(tokens)
        logits = pc.prefill([*tokens, 11], again, start=n, store=False)
        want = straight_logits(pc, [*tokens, 11])
        assert float(mx.max(mx.abs(logits - want)).item()) <= 1e-4
