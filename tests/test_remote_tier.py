"""The shared tier on a real 3-master Valkey cluster: one host stores, another (an
empty bank) restores bit for bit; what the cluster holds is checked before use; a
restore stops at the first missing or rejected entry, never with a hole."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    remote_config,
    state_bits,
    tokens_of,
)

from cas_bank import Bank
from cas_bank.blocks.store import Family
from cas_bank.remote import keys


def _hosts(tmp_path: Path, url: str, n: int = 2, **overrides: Any) -> list[Bank]:
    return [Bank.open(tmp_path / f"host{i}", remote_config(url, **overrides)) for i in range(n)]


def _remote(bank: Bank) -> dict[str, int]:
    return {k: v for k, v in bank.stats().model_dump().items() if k.startswith("remote_")}


def test_an_empty_host_restores_what_another_stored(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url(1))
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(1), 10 * BLOCK_SIZE + 3)
        layers = prefix_layers(spec, toks)
        a.namespace(spec).store(toks, layers)
        a.flush()  # waits for the publish
        assert _remote(a)["remote_publishes"] == 10
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 10 * BLOCK_SIZE
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        b.flush()  # waits for the background local write
        s = b.stats()
        assert (s.remote_hits, s.remote_hit_blocks, s.remote_hit_tokens) == (1, 10, 40)
        assert s.remote_bytes_fetched > s.payload_bytes > 0
        assert s.blocks == 10 and s.remote_adopted_blocks == 10
        # Now local: the same restore asks the cluster nothing.
        fetched = s.remote_bytes_fetched
        again = b.namespace(spec).restore(toks)
        assert again is not None and again.tokens == hit.tokens
        assert b.stats().remote_bytes_fetched == fetched
    finally:
        a.close()
        b.close()


def test_a_restore_continues_the_local_chain_from_the_cluster(cluster: Any, tmp_path: Path) -> None:
    """b holds the shared system prompt itself; only the conversation comes over."""
    a, b = _hosts(tmp_path, cluster.url())
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(2), 12 * BLOCK_SIZE)
        layers = prefix_layers(spec, toks)
        b.namespace(spec).store(toks[: 5 * BLOCK_SIZE], prefix_layers(spec, toks[: 5 * BLOCK_SIZE]))
        a.namespace(spec).store(toks, layers)
        a.flush()
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 12 * BLOCK_SIZE
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        assert b.stats().remote_hit_blocks == 7
    finally:
        a.close()
        b.close()


def test_hybrid_restores_bring_their_state(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url(2))
    try:
        spec = hybrid_spec()
        toks = tokens_of(np.random.default_rng(3), 9 * BLOCK_SIZE)
        layers = prefix_layers(spec, toks)
        st4, st8 = random_state(spec, 4), random_state(spec, 8)
        a.namespace(spec).store(toks, layers, {4 * BLOCK_SIZE: st4, 8 * BLOCK_SIZE: st8})
        a.flush()
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 8 * BLOCK_SIZE  # the deepest state
        assert state_bits(hit.layers, spec) == state_bits(st8, spec)
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        # A prompt that branches after block 6: KV to 6 but the state at 4 only.
        other = toks[: 6 * BLOCK_SIZE] + tokens_of(np.random.default_rng(9), 8)
        hit = b.namespace(spec).restore(other)
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE
        assert state_bits(hit.layers, spec) == state_bits(st4, spec)
        b.flush()
        s = b.stats()
        assert s.states >= 1 and s.remote_rejected == 0
    finally:
        a.close()
        b.close()


def test_no_state_in_the_cluster_no_hybrid_restore(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url())
    try:
        spec = hybrid_spec()
        toks = tokens_of(np.random.default_rng(4), 6 * BLOCK_SIZE)
        a.namespace(spec).store(toks, prefix_layers(spec, toks), {})
        a.flush()
        assert b.namespace(spec).restore(toks) is None
    finally:
        a.close()
        b.close()


def test_a_key_the_cluster_lost_ends_the_chain_there(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url())
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(5), 8 * BLOCK_SIZE)
        layers = prefix_layers(spec, toks)
        ns = a.namespace(spec)
        report = ns.store(toks, layers)
        a.flush()
        cluster.delete(keys.key(ns.root, report.chain[5], "p"))  # as an LRU eviction would
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 5 * BLOCK_SIZE
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        assert b.stats().remote_rejected == 0  # a miss, not an attack
    finally:
        a.close()
        b.close()


def test_forged_entries_are_rejected_misses(cluster: Any, tmp_path: Path) -> None:
    """An attacker with the cluster's password but not the fleet secret writes a
    well-formed entry: it is counted as rejected and never used."""
    a, b = _hosts(tmp_path, cluster.url())
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(6), 6 * BLOCK_SIZE)
        ns = a.namespace(spec)
        report = ns.store(toks, prefix_layers(spec, toks))
        a.flush()
        # Block 3's payload replaced by another block's payload, sealed with a guessed key.
        forged_key = keys.key(ns.root, report.chain[3], "p")
        genuine = a.store.get(Family.BLOCKS, report.chain[0])
        assert genuine is not None
        cluster.set_raw(forged_key, keys.seal_payload(keys.mac_key(b"guess"), forged_key, genuine))
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 3 * BLOCK_SIZE
        assert b.stats().remote_rejected == 1
    finally:
        a.close()
        b.close()


def test_hosts_with_another_secret_share_nothing(cluster: Any, tmp_path: Path) -> None:
    a = Bank.open(tmp_path / "a", remote_config(cluster.url()))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url(), remote_secret="other fleet"))
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(7), 4 * BLOCK_SIZE)
        a.namespace(spec).store(toks, prefix_layers(spec, toks))
        a.flush()
        assert b.namespace(spec).restore(toks) is None
        assert b.stats().remote_rejected == 1
    finally:
        a.close()
        b.close()


def test_other_models_never_meet_in_the_cluster(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url())
    try:
        toks = tokens_of(np.random.default_rng(8), 4 * BLOCK_SIZE)
        one, two = attention_spec(name="model-one"), attention_spec(name="model-two")
        a.namespace(one).store(toks, prefix_layers(one, toks))
        a.flush()
        assert b.namespace(two).restore(toks) is None
        root = a.namespace(one).root
        assert all(k.startswith(keys.namespace_pattern(root)[:-1]) for k in cluster.all_keys())
        assert b.stats().remote_rejected == 0
    finally:
        a.close()
        b.close()


def test_hosts_publish_a_shared_block_once(cluster: Any, tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, cluster.url())
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(10), 4 * BLOCK_SIZE)
        for bank in (a, b):
            bank.namespace(spec).store(toks, prefix_layers(spec, toks))
            bank.flush()
        assert _remote(a)["remote_publishes"] == 4
        assert _remote(b)["remote_publishes"] == 0  # already there
        stored = cluster.all_keys()
        # A header and a payload per block, and each parent's children (partial blocks).
        assert len([k for k in stored if not k.endswith(b":c")]) == 8
        assert len([k for k in stored if k.endswith(b":c")]) == 4
    finally:
        a.close()
        b.close()


def test_a_full_publish_queue_drops_and_counts(cluster: Any, tmp_path: Path) -> None:
    (a,) = _hosts(tmp_path, cluster.url(), n=1, remote_queue_bytes=1)
    try:
        spec = attention_spec()
        cluster.pause(0)  # the worker hangs on its first publish: the queue stays full
        for seed in range(4):
            toks = tokens_of(np.random.default_rng(100 + seed), 2 * BLOCK_SIZE)
            a.namespace(spec).store(toks, prefix_layers(spec, toks))
        assert _remote(a)["remote_dropped"] >= 2
        cluster.resume(0)
        a.flush()
    finally:
        a.close()


def test_no_remote_changes_nothing(bank_path: Path) -> None:
    with Bank.open(bank_path) as bank:
        assert bank.remote is None
        s = bank.stats()
        assert s.remote is None and s.remote_hits == 0 and s.remote_publishes == 0


def test_a_host_fetches_the_partial_block_it_lacks(cluster: Any, tmp_path: Path) -> None:
    """Host a stored a prompt; host b (an empty bank) gets one that leaves it inside a
    block: the chain and the first tokens of that block come from the cluster, bit for
    bit (the block's parent lists it in the cluster's children index)."""
    a, b = _hosts(tmp_path, cluster.url(1))
    try:
        spec = attention_spec()
        toks = tokens_of(np.random.default_rng(7), 6 * BLOCK_SIZE + 1)
        layers = prefix_layers(spec, toks)
        a.namespace(spec).store(toks, layers)
        a.flush()
        at = 4 * BLOCK_SIZE + 3
        branch = [*toks[:at], 99_999]
        hit = b.namespace(spec).restore(branch)
        assert hit is not None and (hit.tokens, hit.partial) == (at, 3)
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, at)
        b.flush()
        assert b.stats().partial_tokens == 3 and b.stats().remote_rejected == 0
        # A forged member naming a block that does not hang there is a rejected miss.
        chain, root = b.namespace(spec).chain(toks), b.namespace(spec).root
        member = bytes(4 * BLOCK_SIZE) + bytes(chain[4])  # tokens 0, 0, ...: block 4's name
        valkey: Any = importlib.import_module("valkey")
        with valkey.ValkeyCluster.from_url(cluster.url(), **cluster.client_tls()) as c:
            c.zadd(keys.key(root, chain[1], "c"), {member: 0})
        assert toks[2 * BLOCK_SIZE] != 0
        other = [*toks[: 2 * BLOCK_SIZE], 0, *([7] * BLOCK_SIZE)]  # shares 1 token with it
        hit = b.namespace(spec).restore(other)
        assert hit is not None and (hit.tokens, hit.partial) == (2 * BLOCK_SIZE, 0)
        assert b.stats().remote_rejected == 1
    finally:
        a.close()
        b.close()


def test_free_ports_are_never_handed_out_twice() -> None:
    # Two nodes spawned a moment apart once got the same port from the kernel (and then
    # the same node directory): the port picker remembers what it gave.
    from cas_bank.remote.servers import free_port_pair

    seen = [p for _ in range(300) for p in free_port_pair()]
    assert len(seen) == len(set(seen))


def test_a_node_whose_port_was_taken_is_spawned_again(monkeypatch: Any) -> None:
    # A port picked free may be taken before the node binds it (by a connection of
    # another process): the node exits, and the cluster spawns it on new ports.
    import socket

    from cas_bank.remote import local_cluster
    from cas_bank.remote.servers import free_port_pair

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    handed = iter([(port, free_port_pair()[1])])
    monkeypatch.setattr(
        local_cluster, "free_port_pair", lambda: next(handed, None) or free_port_pair()
    )
    try:
        with local_cluster.LocalCluster(1) as c:
            assert c.nodes[0].port != port
            assert c.all_keys() == []  # it answers
    finally:
        taken.close()
