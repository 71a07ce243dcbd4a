"""`cas-bank demo --hosts N` and `serve --remote`: the fleet demo's agent restores on a
host it never used, and the server's /metrics and `cas-bank stats` show the shared
tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cas_bank.runtime.fleet_demo import run_fleet_demo
from cas_bank.tools import cli
from conftest import attention_spec, remote_config

from cas_bank import Bank


def test_an_agent_moving_to_another_host_restores_from_the_cluster() -> None:
    report = run_fleet_demo(2, 1, 2, max_tokens=4, block_size=64)
    first, moved = report.rows
    assert (first.host, moved.host) == (0, 1)
    assert first.cached_tokens == 0
    # The whole conversation up to its last stored state, fetched by a host that never saw it.
    assert moved.cached_tokens >= 2048 and moved.remote_tokens == moved.cached_tokens
    assert report.host_stats[1]["remote_rejected"] == 0
    assert report.cluster_bytes > 0


def test_stats_shows_the_remote_tier(
    cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Bank.open(tmp_path / "bank", remote_config(cluster.url())) as bank:
        bank.namespace(attention_spec()).restore(list(range(16)))
    assert cli.main(["stats", str(tmp_path / "bank"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["remote"] == cluster.url().replace(cluster.password, "***")
    assert "remote_hit_tokens" in s and "remote_rejected" in s
    assert cli.main(["stats", str(tmp_path / "bank")]) == 0
    text = capsys.readouterr().out
    assert "remote tier" in text and "***" in text and cluster.password not in text
