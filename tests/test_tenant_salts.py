"""Tenant salts isolate on both servers: `cas-bank serve` and `cas-bank mlx-lm-server`.

Two tenants send the same system prompt with different `cache_salt`s through each real
server process: neither restores a token of the other's, while a tenant's own repeat
does hit. On mlx-lm's server this covers its batched path too (a salted request sent
alongside unsalted ones in one batch of its generator).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import server_kit as srv
import test_mlx_lm_server as mlx
from hf_models import model_dir

Ask = Callable[..., httpx.Response]


def _asker(url: str, model: str) -> Ask:
    def ask(user: str, salt: object = None) -> httpx.Response:
        body: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": mlx.SYSTEM},
                {"role": "user", "content": user},
            ],
            "max_tokens": 4,
        }
        if salt is not None:
            body["cache_salt"] = salt
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=mlx.TIMEOUT)

    return ask


@pytest.fixture(params=["serve", "mlx-lm-server"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Ask, Path]]:
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    if request.param == "serve":
        s = srv.start_server(bank, log)
        try:
            yield _asker(s.url, srv.MODEL), bank
        finally:
            s.stop()
    else:
        m = mlx.start(bank, model_dir(tmp_path / "model", "tiny-qwen3"), log)
        try:
            yield _asker(m.url, "default_model"), bank
        finally:
            assert m.stop() == 0, log.read_text()


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_two_tenants_with_one_system_prompt_share_nothing(server: tuple[Ask, Path]) -> None:
    ask, _ = server
    assert cached(ask("what is the weather?", "tenant-a")) == 0
    assert cached(ask("what is the weather?", "tenant-b")) == 0  # A's whole prompt is stored
    assert cached(ask("and the time?", "tenant-b")) > 0  # B's own system prompt: a hit
    assert cached(ask("what is the weather?", "tenant-a")) > 0  # A's own repeat: a hit
    assert cached(ask("what is the weather?")) == 0  # no salt is a tenant of its own
    # At once (mlx-lm batches the unsalted ones): each restores only its own tenant's.
    with ThreadPoolExecutor(3) as pool:
        both = list(pool.map(lambda s: ask("a new question", s), [None, "tenant-c", None]))
    assert cached(both[1]) == 0
    assert cached(ask("a new question", "tenant-c")) > 0
    bad = [ask("x", 7), ask("x", ""), ask("x", "s" * 1025)]
    assert all(r.status_code == 400 and "cache_salt" in r.text for r in bad), [r.text for r in bad]
