"""Faults of the shared tier, on real valkey-server processes: a paused master
(SIGSTOP), a killed one, a wrong password, nothing listening, a full cluster. Requests
go on with local results within a bounded time; every fault is counted; nothing is
raised into the caller."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    remote_config,
    tokens_of,
)

from cas_bank import Bank
from cas_bank.remote.local_cluster import LocalCluster

TIMEOUT = 0.3  # remote_timeout of remote_config
BOUND = 2 * TIMEOUT + 0.5  # a request's worst extra time: a pipeline or two, then the breaker


def _restore_timed(bank: Bank, toks: list[int]) -> tuple[Any, float]:
    t = time.perf_counter()
    hit = bank.namespace(attention_spec()).restore(toks)
    return hit, time.perf_counter() - t


def _store(bank: Bank, toks: list[int]) -> list[Any]:
    layers = prefix_layers(attention_spec(), toks)
    bank.namespace(attention_spec()).store(toks, layers)
    return layers


def test_a_paused_master_costs_bounded_time_then_the_breaker_skips_it(
    cluster: Any, tmp_path: Path
) -> None:
    a = Bank.open(tmp_path / "a", remote_config(cluster.url(), remote_retry_after=1.0))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url(), remote_retry_after=1.0))
    try:
        rng = np.random.default_rng(20)
        local = tokens_of(rng, 6 * BLOCK_SIZE)
        local_layers = _store(b, local)
        shared = tokens_of(rng, 8 * BLOCK_SIZE)
        _store(a, shared)
        a.flush()
        b.flush()
        cluster.pause(0)
        times = []
        for _ in range(6):  # b's own prompt, longer than what it holds: asks the cluster
            hit, took = _restore_timed(b, [*local, *tokens_of(rng, 2 * BLOCK_SIZE)])
            assert hit is not None and hit.tokens == 6 * BLOCK_SIZE
            assert layers_bits(hit.layers, attention_spec()) == kv_prefix_bits(
                local_layers, attention_spec(), hit.tokens
            )
            times.append(took)
        s = b.stats()
        assert max(times) < BOUND, times
        assert s.remote_timeouts >= 1 and s.remote_skipped >= 1
        assert sorted(times)[-2] < 0.1  # one time-out, then the node's breaker skips it
        t = time.perf_counter()
        _store(b, tokens_of(rng, 4 * BLOCK_SIZE))  # a store never waits for the network
        b.flush()  # the publish fails or is skipped, counted, in bounded time
        assert time.perf_counter() - t < BOUND + 1.0
        cluster.resume(0)
        time.sleep(1.1)  # retry_after: the breaker lets a call through again
        hit, _ = _restore_timed(b, shared)
        assert hit is not None and hit.tokens == 8 * BLOCK_SIZE
        assert b.stats().remote_hit_blocks == 8
    finally:
        cluster.resume(0)
        a.close()
        b.close()


def test_a_killed_master_mid_run(tmp_path: Path) -> None:
    with LocalCluster(3) as own:
        a = Bank.open(tmp_path / "a", remote_config(own.url(2)))
        b = Bank.open(tmp_path / "b", remote_config(own.url(2)))
        try:
            rng = np.random.default_rng(21)
            shared = tokens_of(rng, 8 * BLOCK_SIZE)
            _store(a, shared)
            a.flush()
            hit, _ = _restore_timed(b, shared)
            assert hit is not None and hit.tokens == 8 * BLOCK_SIZE
            own.kill(0)
            other = tokens_of(rng, 8 * BLOCK_SIZE)
            _store(a, other)  # its publish fails (the slots of node 0 have no master)
            a.flush()
            for _ in range(4):
                hit, took = _restore_timed(b, other)  # the blocks on live masters, if any
                assert (hit is None or hit.tokens < 8 * BLOCK_SIZE) and took < BOUND
                hit, took = _restore_timed(b, shared)  # local now
                assert hit is not None and hit.tokens == 8 * BLOCK_SIZE and took < BOUND
            sa, sb = a.stats(), b.stats()
            assert sa.remote_errors + sa.remote_timeouts >= 1
            assert sb.remote_errors + sb.remote_timeouts + sb.remote_skipped >= 1
        finally:
            a.close()
            b.close()


def test_a_wrong_password_is_counted_and_local_results_go_on(cluster: Any, tmp_path: Path) -> None:
    with Bank.open(tmp_path / "a", remote_config(cluster.url(password="wrong"))) as bank:
        toks = tokens_of(np.random.default_rng(22), 4 * BLOCK_SIZE)
        _store(bank, toks)
        bank.flush()
        hit, took = _restore_timed(bank, [*toks, *toks])
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE and took < BOUND
        s = bank.stats()
        assert s.remote_errors >= 1 and s.remote_publishes == 0
    assert cluster.all_keys() == []


def test_nothing_listening(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"valkey://cas:pw@127.0.0.1:{port}"
    with Bank.open(tmp_path / "a", remote_config(url)) as bank:
        toks = tokens_of(np.random.default_rng(23), 4 * BLOCK_SIZE)
        hit, took = _restore_timed(bank, toks)
        assert hit is None and took < BOUND
        _store(bank, toks)
        bank.flush()
        assert bank.stats().remote_errors >= 1


def test_a_full_cluster_evicts_and_restores_stop_at_what_is_left(
    cluster: Any, tmp_path: Path
) -> None:
    """maxmemory with allkeys-lru (as docs/scaling.md runs it): old keys go, a restore
    takes the chain up to the first missing entry, bit-exact, and nothing fails."""
    big = attention_spec(n_layers=32)  # 8 KiB blocks
    cluster.cap_memory(200 * 1024)  # ~600 KiB in all; ~1 MiB is published below
    a = Bank.open(tmp_path / "a", remote_config(cluster.url()))
    b = Bank.open(tmp_path / "b", remote_config(cluster.url()))
    try:
        rng = np.random.default_rng(24)
        prompts = [tokens_of(rng, 4 * BLOCK_SIZE) for _ in range(40)]  # ~1.3 MiB
        layers = {}
        for p in prompts:
            layers[id(p)] = prefix_layers(big, p)
            a.namespace(big).store(p, layers[id(p)])
            a.flush()
        assert a.stats().remote_skipped == 0  # a full node refuses writes; it is not down
        got = 0
        for p in prompts:
            hit = b.namespace(big).restore(p)
            if hit is not None:
                got += hit.tokens
                assert layers_bits(hit.layers, big) == kv_prefix_bits(
                    layers[id(p)], big, hit.tokens
                )
        assert 0 < got < sum(len(p) for p in prompts)  # some of it, none of it wrong
        assert b.stats().remote_rejected == 0
    finally:
        cluster.config_set("maxmemory", 0)
        a.close()
        b.close()
