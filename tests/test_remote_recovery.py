"""The shared tier comes back by itself: a plain server after a failure, a node whose
trial call got an error answer, slots that moved to another master; a hybrid host that
holds the KV takes a deeper state from the cluster; a rejected entry is written again.
Real Valkey servers (`LocalCluster`), short time-outs (`remote_config`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    prefix_layers,
    random_state,
    remote_config,
    state_bits,
    tokens_of,
)

from cas_bank import Bank
from cas_bank.remote import keys
from cas_bank.remote.local_cluster import LocalCluster

pytest.importorskip("valkey")
SPEC = attention_spec()


def _store(bank: Bank, tokens: list[int]) -> None:
    bank.namespace(SPEC).store(tokens, prefix_layers(SPEC, tokens))
    bank.flush()


def test_a_plain_server_is_used_again_after_it_failed(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    with LocalCluster(1, cluster=False) as cl:
        a = Bank.open(tmp_path / "a", remote_config(cl.url()))
        _store(a, tokens_of(rng, 4 * BLOCK_SIZE))
        assert a.stats().remote_publishes == 4
        cl.pause(0)
        a.namespace(SPEC).restore(tokens_of(rng, 4 * BLOCK_SIZE))  # one time-out
        cl.resume(0)
        time.sleep(1.3)  # past remote_retry_after: the next call tries again
        _store(a, tokens_of(rng, 4 * BLOCK_SIZE))
        assert a.stats().remote_publishes == 8, a.stats()
        a.close()


def test_a_node_whose_trial_got_an_error_answer_is_asked_again(tmp_path: Path) -> None:
    """An error answer (WRONGTYPE here; a full node, MOVED) is a live node: the half-open
    trial it answered must end, not leave the node skipped for good."""
    with LocalCluster(1, cluster=False) as cl:
        a = Bank.open(tmp_path / "a", remote_config(cl.url()))
        client = a.remote.client  # type: ignore[union-attr]
        assert client.run([("SET", b"k", b"v")]) == [True]
        cl.pause(0)
        assert client.run([("GET", b"k")]) == [None]  # a time-out: the breaker opens
        assert client.run([("GET", b"k")]) is None  # skipped while it is open
        cl.resume(0)
        time.sleep(1.3)
        assert client.run([("HSET", b"k", b"f", b"v")]) == [None]  # the trial: WRONGTYPE
        assert client.run([("GET", b"k")]) == [b"v"]
        a.close()


def test_slots_that_moved_to_another_master_are_found(tmp_path: Path) -> None:
    rng = np.random.default_rng(20)
    with LocalCluster(3) as cl, Bank.open(tmp_path / "a", remote_config(cl.url(1))) as a:
        a.namespace(SPEC).restore(tokens_of(rng, 8))  # the slot map is read
        for node in cl.nodes:  # node 0's slots move to node 1 (a resharding)
            with cl._client(node) as c:
                c.execute_command("CLUSTER", "DELSLOTSRANGE", 0, 5460)
        with cl._client(cl.nodes[1]) as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 5460)
            c.execute_command("CLUSTER", "BUMPEPOCH")
        _until_every_node_serves_slot_0_from(cl, cl.nodes[1].port)
        for _ in range(2):  # the first round meets MOVED; the second knows the new map
            before = a.stats().remote_publishes
            _store(a, tokens_of(rng, 12 * BLOCK_SIZE))
        assert a.stats().remote_publishes - before == 12, a.stats()


def _until_every_node_serves_slot_0_from(cl: LocalCluster, port: int) -> None:
    """Wait until every node's slot map has slot 0 at `port` (the new map reaches the
    nodes by gossip: a client that read it from one still behind met MOVED again)."""
    deadline = time.monotonic() + 30

    def owner(node: object) -> int | None:
        with cl._client(node) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= 0 <= int(end):
                    return int(master[1])
        return None

    while any(owner(node) != port for node in cl.nodes):
        assert time.monotonic() < deadline, "the nodes never agreed on the new slot map"
        time.sleep(0.05)


def test_a_dead_masters_slots_served_by_another_are_found(tmp_path: Path) -> None:
    """A master dies and another takes its slots (a failover): a host connected before
    reads the slot map again after the connection is refused."""
    rng = np.random.default_rng(6)
    with LocalCluster(3) as cl:
        a = Bank.open(tmp_path / "a", remote_config(cl.url(1)))
        b = Bank.open(tmp_path / "b", remote_config(cl.url(1)))
        b.namespace(SPEC).restore(tokens_of(rng, 2 * BLOCK_SIZE))  # b reads the slot map
        with cl._client(cl.nodes[0]) as c:
            dead = c.execute_command("CLUSTER", "MYID").decode()
        cl.kill(0)
        for i in (1, 2):
            with cl._client(cl.nodes[i]) as c:
                c.execute_command("CLUSTER", "FORGET", dead)
        with cl._client(cl.nodes[1]) as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 5460)
        time.sleep(1.5)
        tokens = tokens_of(rng, 12 * BLOCK_SIZE)
        _store(a, tokens)
        hits = []
        for _ in range(2):  # the first meets the dead node; the second the new map
            time.sleep(1.1)  # past remote_retry_after
            hit = b.namespace(SPEC).restore(tokens)
            hits.append(0 if hit is None else hit.tokens)
        a.close()
        b.close()
    assert hits[-1] == 12 * BLOCK_SIZE, hits


def test_a_hybrid_host_with_the_kv_takes_a_deeper_state_from_the_cluster(tmp_path: Path) -> None:
    hyb = hybrid_spec()
    rng = np.random.default_rng(15)
    tokens = tokens_of(rng, 8 * BLOCK_SIZE)
    layers = prefix_layers(hyb, tokens)
    s4, s8 = random_state(hyb, 4), random_state(hyb, 8)
    with LocalCluster(3) as cl:
        with Bank.open(tmp_path / "a", remote_config(cl.url())) as a:
            a.namespace(hyb).store(tokens, layers, {4 * BLOCK_SIZE: s4, 8 * BLOCK_SIZE: s8})
            a.flush()
        with Bank.open(tmp_path / "b", remote_config(cl.url())) as b:
            b.namespace(hyb).store(tokens, layers, {})  # the KV only, no state
            for prompt in (tokens, [*tokens, 1, 2]):
                hit = b.namespace(hyb).restore(prompt)
                assert hit is not None and hit.tokens == 8 * BLOCK_SIZE
                assert state_bits(hit.layers, hyb) == state_bits(s8, hyb)


def test_an_entry_a_host_rejected_is_written_again_by_its_next_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tokens = tokens_of(rng, 4 * BLOCK_SIZE)
    with LocalCluster(1, cluster=False) as cl:
        with Bank.open(tmp_path / "a", remote_config(cl.url())) as a:
            _store(a, tokens)
            root = a.namespace(SPEC).root
            chain = a.namespace(SPEC).chain(tokens)
        bad = keys.key(root, chain[2], "p")
        with cl._client(cl.nodes[0]) as c:  # a damaged entry in the cluster
            c.set(bad, c.get(bad)[:-7])
        with Bank.open(tmp_path / "b", remote_config(cl.url())) as b:
            hit = b.namespace(SPEC).restore(tokens)
            assert hit is not None and hit.tokens == 2 * BLOCK_SIZE  # stops before it
            assert b.stats().remote_rejected == 1
            _store(b, tokens)  # this host has the good bytes now: they replace the bad
        with Bank.open(tmp_path / "c", remote_config(cl.url())) as c:
            hit = c.namespace(SPEC).restore(tokens)
            assert hit is not None and hit.tokens == 4 * BLOCK_SIZE
