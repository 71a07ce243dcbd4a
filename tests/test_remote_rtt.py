"""The delaying proxy (`LocalCluster(rtt=...)`, `cas_bank.remote.delay`): every node
announces its proxy's port, so the slot map sends clients through it; each round trip
costs the added time; a restore through it takes its two round trips and is exact."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
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

valkey = pytest.importorskip("valkey")
RTT = 0.004


def test_a_restore_through_the_delaying_proxy(tmp_path: Path) -> None:
    spec = attention_spec()
    with LocalCluster(3, rtt=RTT) as cl:
        with valkey.ValkeyCluster.from_url(cl.url()) as c:
            ports = {n.port for n in c.get_nodes()}
            assert ports == {n.proxy_port for n in cl.nodes}  # the slot map names the proxies
            c.set("k", b"v")
            times = []
            for _ in range(5):
                t = time.perf_counter()
                assert c.get("k") == b"v"
                times.append(time.perf_counter() - t)
            assert min(times) >= RTT
        toks = tokens_of(np.random.default_rng(7), 12 * BLOCK_SIZE)
        layers = prefix_layers(spec, toks)
        with (
            Bank.open(tmp_path / "a", remote_config(cl.url(0))) as a,
            Bank.open(tmp_path / "b", remote_config(cl.url(1), remote_timeout=1.0)) as b,
        ):
            a.namespace(spec).store(toks, layers)
            a.flush()
            b.namespace(spec).restore(tokens_of(np.random.default_rng(8), 8))  # connects
            client = b.remote.client  # type: ignore[union-attr]
            before = client.round_trips
            t = time.perf_counter()
            hit = b.namespace(spec).restore(toks)
            took = time.perf_counter() - t
            assert hit is not None and hit.tokens == len(toks)
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(toks))
            assert client.round_trips - before == 2  # headers (and end records), payloads
            assert took >= 2 * RTT
