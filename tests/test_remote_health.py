"""The shared tier in the servers' `/health` and `/metrics`: `TierProbe` on a real
`LocalCluster` whose nodes die, and both server processes (`cas-bank serve`, `cas-bank
mlx-lm-server`) reporting it while every node is stopped (and serving on)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import server_kit as srv
import test_mlx_lm_server as mlx
from conftest import remote_config
from hf_models import model_dir
from runtime_helpers import metric

from cas_bank import Bank
from cas_bank.remote.health import TierHealth, TierProbe
from cas_bank.remote.local_cluster import LocalCluster

SECRET = "health-test-fleet-secret"


def until(what: Callable[[], Any], timeout: float = 20.0) -> Any:
    """`what()` once it is truthy (polled), or the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def _until_reason(probe: TierProbe, text: str) -> TierHealth:
    """The probe's answer once its reason says `text` (the cluster takes its node
    time-out to decide a master is gone)."""
    got = until(lambda: (h := probe.check()).reason and text in h.reason and h, timeout=60.0)
    assert got, probe.check()
    return got  # type: ignore[no-any-return]


def test_the_probe_sees_a_dead_master_and_a_failed_cluster(tmp_path: Path) -> None:
    with (
        LocalCluster(3, node_timeout_ms=500) as cl,
        Bank.open(tmp_path / "a", remote_config(cl.url(0))) as bank,
    ):
        assert bank.remote is not None
        probe = TierProbe(bank.remote, ttl=0.0)
        first = f"127.0.0.1:{cl.nodes[0].port}"
        assert probe.check() == TierHealth("ok", None, bank.remote.url, first)
        cl.kill(0)  # the URL's node: the probe asks the others the cluster named
        dead = _until_reason(probe, "slots are not served")
        assert dead.status == "degraded" and dead.node not in (None, first)
        # Valkey now fails every slot, at its next state update: CONFIG SET runs none (a
        # node that next looks gone does), so this waited for ever in one run of three.
        cl.config_set("cluster-require-full-coverage", "yes")
        cl.kill(1)
        assert _until_reason(probe, "cluster_state:fail").status == "degraded"
        cl.kill(2)
        gone = probe.check()
        assert gone.status == "degraded" and gone.node is None
        assert "no node of the shared tier answers" in str(gone.reason)
        assert cl.password not in str(gone.reason)
        assert 3 <= probe.failed < probe.probes


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=srv.TIMEOUT).json())


def _metric(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=srv.TIMEOUT).text, f"cas_bank_{name}")


def _degraded(url: str) -> dict[str, Any] | None:
    h = _health(url)
    return h if h["status"] == "degraded" else None


def test_both_servers_report_a_stopped_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAS_BANK_REMOTE_SECRET", SECRET)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))  # none: as on a new host
    model = model_dir(tmp_path / "model", "tiny-qwen3")
    with LocalCluster(3) as cl:
        serve = srv.start_server(tmp_path / "s", tmp_path / "serve.log", "--remote", cl.url())
        try:
            server = mlx.start(tmp_path / "m", model, tmp_path / "mlx.log", "--remote", cl.url())
            try:
                urls = [serve.url, server.url]
                for url in urls:
                    h = _health(url)
                    assert (h["status"], h["degraded"], h["remote"]["status"]) == ("ok", None, "ok")
                    assert "***" in h["remote"]["url"] and cl.password not in str(h)
                    assert _metric(url, "remote_up") == 1
                listed = httpx.get(f"{server.url}/v1/models", timeout=srv.TIMEOUT)
                assert listed.status_code == 200
                assert [m["id"] for m in listed.json()["data"]] == [str(model.resolve())]
                for i in range(len(cl.nodes)):
                    cl.kill(i)
                for url in urls:
                    h = until(lambda url=url: _degraded(url))
                    assert h, _health(url)
                    assert h["remote"]["status"] == "degraded"
                    assert "no node of the shared tier answers" in h["degraded"]
                    assert _metric(url, "remote_up") == 0
                    assert _metric(url, "remote_probes_failed_total") >= 1
                # Serving goes on: the tier's blocks are misses.
                assert srv.chat(serve.url, srv.conversation("still there?"))["choices"]
                assert mlx.chat(server.url, mlx.conversation("still there?"))["choices"]
                assert _metric(server.url, "prompt_cache_fetches_total") == 1
                assert _metric(server.url, "remote_nodes_skipped") >= 0  # exported
            finally:
                assert server.stop() == 0
        finally:
            serve.stop()
    for log in ("serve.log", "mlx.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), log
