"""A `cas-bank serve` process for the server's tests, and what they ask of it.

`start_server` runs `cas-bank serve --port 0 --json` in a subprocess on a bank in a
tmp dir, with the embedded tiny hybrid model and 16-token blocks, and returns once it
answers /health; the tests talk to it over HTTP (httpx, and the `openai` client).
Request counts are small and every call has a timeout, so a hung server fails a test
instead of the suite. Used by test_server.py, test_server_requests.py and the tests of
other servers' features (tenants, cancels, hostile callers, the shared tier's health).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from runtime_helpers import stop_process

MODEL = "tiny-hybrid"
BLOCK = 16
TIMEOUT = 60.0
SYSTEM = "You are a careful assistant for a team of engineers. " * 6  # ~320 tokens
# Printable ASCII only (no end token): replies run to max_tokens and their text
# re-encodes to the same byte tokens, as a trained model's text would.
ASCII_BIAS = {str(i): 100.0 for i in range(32, 127)}


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    bank: Path
    log: Path

    def stop(self) -> None:
        stop_process(self.proc)


def start_server(bank: Path, log: Path, *extra: str) -> Server:
    """`cas-bank serve` on a free loopback port; returns once it answers /health."""
    cmd = [sys.executable, "-m", "cas_bank.tools.cli", "serve", "--json", "--port", "0"]
    cmd += ["--host", "127.0.0.1", "--bank", str(bank), "--block-size", str(BLOCK), *extra]
    with open(log, "a") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ)
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line: {"url": ..., "model": ..., "bank": ...}
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"the server did not start:\n{log.read_text()}")
    url = json.loads(line)["url"]
    server = Server(proc, url, bank, log)
    try:
        httpx.get(f"{url}/health", timeout=TIMEOUT).raise_for_status()
    except BaseException:
        server.stop()
        raise
    return server


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion of `prompt` from mlx-lm's server (its default model)."""
    body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0.0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def completion_text(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["text"])


def conversation(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def running_server(factory: pytest.TempPathFactory, name: str = "server") -> Iterator[Server]:
    """A module's server (its `server` fixture), in a tmp dir called `name`: started
    once, stopped after."""
    root = factory.mktemp(name)
    s = start_server(root / "bank", root / "server.log")
    try:
        yield s
    finally:
        s.stop()
