"""End records through the shared tier: an exact repeat on another host restores every
token with the stored logits; a hybrid's next turn on another host resumes from the end
record (its state at the prompt's end, no boundary state needed); a forged record is a
rejected miss; the restoring host keeps the record locally afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    bits,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_logits,
    random_state,
    remote_config,
    state_bits,
    tokens_of,
)
from runtime_helpers import bit_equal, close, random_tokens, straight_logits, tiny

from cas_bank import Bank
from cas_bank.blocks.store import Family
from cas_bank.index.ends import end_key, split_record
from cas_bank.remote import ends, keys

ATT = attention_spec()


@pytest.fixture
def hosts(cluster: Any, tmp_path: Path) -> Iterator[tuple[Bank, Bank]]:
    """Two hosts' banks on the cluster (a on master 0, b on master 1), closed after."""
    a = Bank.open(tmp_path / "a", remote_config(cluster.url(0)))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url(1)))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_an_exact_repeat_on_another_host_restores_every_token_and_the_logits(
    cluster: Any, hosts: tuple[Bank, Bank]
) -> None:
    a, b = hosts
    toks = tokens_of(np.random.default_rng(1), 5 * BLOCK_SIZE + 3)
    layers, logits = prefix_layers(ATT, toks), random_logits(1)
    a.namespace(ATT).store(toks, layers)
    a.namespace(ATT).store_end(toks, layers, logits=logits)
    a.flush()
    hit = b.namespace(ATT).restore(toks)
    assert hit is not None and hit.tokens == len(toks) and hit.exact
    assert hit.logits is not None and bits(hit.logits) == bits(logits)
    assert layers_bits(hit.layers, ATT) == kv_prefix_bits(layers, ATT, len(toks))
    assert b.stats().remote_hit_tokens == len(toks)
    b.flush()  # the record and its blocks written locally
    cluster.flushall()
    again = b.namespace(ATT).restore(toks)
    assert again is not None and again.exact and bits(again.logits) == bits(logits)
    assert b.stats().ends == 1


def test_a_host_with_the_blocks_takes_the_end_record_from_the_cluster(
    hosts: tuple[Bank, Bank],
) -> None:
    a, b = hosts
    toks = tokens_of(np.random.default_rng(2), 4 * BLOCK_SIZE + 1)
    layers, logits = prefix_layers(ATT, toks), random_logits(2)
    b.namespace(ATT).store(toks, layers)  # b has every block, not the end
    a.namespace(ATT).store(toks, layers)
    a.namespace(ATT).store_end(toks, layers, logits=logits)
    a.flush()
    hit = b.namespace(ATT).restore(toks)
    assert hit is not None and hit.exact and hit.tokens == len(toks)
    assert bits(hit.logits) == bits(logits)


def test_a_hybrid_next_turn_on_another_host_resumes_from_the_end_record(
    hosts: tuple[Bank, Bank],
) -> None:
    spec = hybrid_spec()
    a, b = hosts
    rng = np.random.default_rng(3)
    turn = tokens_of(rng, 3 * BLOCK_SIZE + 2)
    layers, state = prefix_layers(spec, turn), random_state(spec, 3)
    a.namespace(spec).store(turn, layers)  # no boundary state (mlx-lm's server)
    a.namespace(spec).store_end(turn, layers, state)
    a.flush()
    nxt = [*turn, *tokens_of(rng, 2 * BLOCK_SIZE)]
    hit = b.namespace(spec).restore(nxt)
    assert hit is not None and hit.tokens == len(turn) and hit.end and not hit.exact
    assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(turn))
    assert state_bits(hit.layers, spec) == state_bits(state, spec)


def test_a_forged_end_record_is_a_rejected_miss(cluster: Any, hosts: tuple[Bank, Bank]) -> None:
    a, b = hosts
    toks = tokens_of(np.random.default_rng(4), 3 * BLOCK_SIZE + 2)
    layers = prefix_layers(ATT, toks)
    a.namespace(ATT).store(toks, layers)
    a.namespace(ATT).store_end(toks, layers, logits=random_logits(4))
    a.flush()
    ns = a.namespace(ATT)
    local = end_key(ns.chain(toks)[-1], np.array(toks[-2:], dtype="<u4").tobytes())
    value = a.store.get(Family.ENDS, local)
    assert value is not None
    header, _ = split_record(local, value)
    k = ends.remote_key(ns.root, local)
    forged = ends.seal(keys.mac_key(b"another fleet"), k, value, len(header.encode()))
    cluster.set_raw(k, forged)
    hit = b.namespace(ATT).restore(toks)
    assert hit is not None and hit.tokens == 3 * BLOCK_SIZE and not hit.exact
    assert b.stats().remote_rejected == 1


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-hybrid"])
def test_real_models_on_two_hosts_zero_prefill_and_the_next_turn(
    cluster: Any, tmp_path: Path, name: str
) -> None:
    """A real tiny model served on host a; on host b the exact repeat samples from the
    stored logits with no forward pass, and the next turn prefills only its new tokens
    and matches a straight prefill."""
    block = 16
    lm = tiny(name)
    a = Bank.open(tmp_path / "a", remote_config(cluster.url(0), block_size=block))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url(1), block_size=block))
    try:
        pa = PrefixCache(a, lm, chunk_size=block)
        tokens = random_tokens(np.random.default_rng(5), 3 * block + 7)
        cache, n = pa.restore(tokens)
        first = pa.prefill(tokens, cache, n, end=True)
        a.flush()
        pb = PrefixCache(b, lm, chunk_size=block)
        _, n, logits = pb.restore_exact(tokens)
        assert pb.last_prefill is None  # no forward pass on host b
        assert n == len(tokens) and logits is not None and bit_equal(logits, first)
        b.flush()
        nxt = [*tokens, *random_tokens(np.random.default_rng(6), 5)]
        cache, n = pb.restore(nxt)
        assert n == len(tokens)  # from the end record (a hybrid: its state), not a boundary
        out = pb.prefill(nxt, cache, n)
        assert close(out, straight_logits(pb, nxt), "float32")
    finally:
        a.close()
        b.close()
