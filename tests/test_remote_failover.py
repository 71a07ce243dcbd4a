"""A master SIGKILLed while three host processes serve from one cluster with a replica
per master: Valkey promotes the replica, the hosts read the dead master's slots from
it (during the failover window too) and keep their hits: no exception, nothing
restored wrong, the run's hit rate within 10% of the same run without the kill."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, TESTS_DIR, attention_spec, child_env, prefix_layers, remote_config
from failover_host import BLOCK, SHARED, shared_prompt

from cas_bank import Bank
from cas_bank.remote.client import MAP_REFRESH_S
from cas_bank.remote.local_cluster import LocalCluster

pytest.importorskip("valkey")
SECONDS = 3.5  # the run with the kill
CALM_SECONDS = 1.5  # the run without
KILL_AFTER = 0.5  # seconds into the run


def _hosts(cl: LocalCluster, workdir: Path) -> list[subprocess.Popen[str]]:
    hosts = [
        subprocess.Popen(
            [
                PYTHON,
                str(TESTS_DIR / "failover_host.py"),
                str(workdir / f"h{h}"),
                cl.url(h),
                str(h),
                "2",
            ],
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h in range(3)
    ]
    for p in hosts:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return hosts


def _run(cl: LocalCluster, hosts: list[subprocess.Popen[str]], kill: bool) -> dict[str, Any]:
    for p in hosts:
        assert p.stdin is not None
        p.stdin.write(f"{SECONDS if kill else CALM_SECONDS}\n")
        p.stdin.flush()
    failover = None
    if kill:
        time.sleep(KILL_AFTER)
        cl.kill(0)
        failover = KILL_AFTER + cl.wait_failover(0)
    out = []
    for p in hosts:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, p.communicate(timeout=30)[1]
        out.append(json.loads(line))
    asked = sum(h["asked"] for h in out)
    last = [h["last_replica_read"] for h in out if h["last_replica_read"] is not None]
    return {
        "hit_rate": sum(h["restored"] for h in out) / asked,
        "requests": sum(h["requests"] for h in out),
        "fell_back": sum(h["fell_back"] for h in out),
        "wrong": sum(h["wrong"] for h in out),
        "errors": [e for h in out for e in h["errors"]],
        "replica_reads": sum(h["replica_reads"] for h in out),
        "last_replica_read": max(last, default=None),
        "failover_s": failover,
    }


def test_a_killed_master_fails_over_and_hosts_keep_their_hits(tmp_path: Path) -> None:
    with LocalCluster(3, replicas=1, node_timeout_ms=500) as cl:
        spec = attention_spec()
        with Bank.open(tmp_path / "seed", remote_config(cl.url(), block_size=BLOCK)) as seed:
            for k in range(SHARED):
                toks = shared_prompt(k)
                seed.namespace(spec).store(toks, prefix_layers(spec, toks))
            seed.flush()
        entries = [k for k in cl.all_keys() if not k.endswith(b":c")]  # less children sets
        assert len(entries) == 2 * SHARED * len(shared_prompt(0)) // BLOCK
        hosts = _hosts(cl, tmp_path)
        try:
            calm = _run(cl, hosts, kill=False)
            killed = _run(cl, hosts, kill=True)
        finally:
            for p in hosts:
                p.kill()
                p.communicate()
    for name, r in (("no kill", calm), ("master killed", killed)):
        print(
            f"{name}: hit rate {r['hit_rate']:.3f} over {r['requests']} requests, "
            f"{r['fell_back']} fell back to prefill, {r['replica_reads']} reads from "
            f"replicas (the last {r['last_replica_read']} s into the run), "
            f"promoted {r['failover_s']} s into the run"
        )
        assert r["errors"] == [] and r["wrong"] == 0
    assert calm["hit_rate"] > 0.99 and calm["replica_reads"] == 0
    assert killed["hit_rate"] >= 0.9 * calm["hit_rate"], (killed, calm)
    assert killed["replica_reads"] > 0  # the dead master's slots, read from its replica
    # Then from the promoted replica as a master, once the slot map says so.
    assert killed["last_replica_read"] < killed["failover_s"] + MAP_REFRESH_S + 0.4, killed
