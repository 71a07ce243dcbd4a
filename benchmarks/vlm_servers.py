"""mlx-vlm's server four ways, as processes, and the requests agents send them: for the
vision benchmark (`vlm_agents`) and the server's tests (tests/test_vlm_server.py).

The ways (`WAYS`), all `mlx_vlm.server` on the same model directory:

- `none`: no prefix cache (`APC_ENABLED=0`, mlx-vlm's default);
- `apc`: mlx-vlm's automatic prefix cache in memory only (`APC_DISK_ENABLED=0`);
- `apc-disk`: mlx-vlm's APC with its SSD tier (`APC_DISK_PATH`, a directory of the run):
  on by default once APC is, and kept across a restart;
- `bank`: `cas-bank mlx-vlm-server` on a bank directory of the run, 16-token blocks
  (mlx-vlm's APC blocks; the bank restores to the token whatever its block size).

A server is started on a free loopback port (`--port 0`; the port is read from
uvicorn's "running on" line) and is ready when `/health` answers. Images travel as
`data:` URLs (nothing is downloaded). `ask` sends one chat request and returns its
answer, time to first token (streamed) and cached tokens.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

WAYS: Final = ("none", "apc", "apc-disk", "bank")
TIMEOUT: Final = 120.0
_RUNNING = re.compile(r"Uvicorn running on (http://\S+)")


@dataclass
class VlmServer:
    """A running server: its process, URL and way; `stop()` ends it (SIGTERM)."""

    proc: subprocess.Popen[str]
    url: str
    way: str
    model: str  # the path it serves (what a request names)
    log: Path
    drain: threading.Thread = field(repr=False)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.drain.join(timeout=5)
        return int(self.proc.returncode)

    def stats(self) -> dict[str, Any]:
        """mlx-vlm's `/v1/cache/stats` (the bank's under `bank` on the bank way)."""
        r = httpx.get(f"{self.url}/v1/cache/stats", timeout=TIMEOUT)
        r.raise_for_status()
        return dict(r.json())


def command(way: str, model: Path, root: Path, *extra: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `way` (files it keeps go under `root`)."""
    env = dict(os.environ, MLX_VLM_CACHE_HOME=str(root / "mlx-vlm-home"))
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", "0", *extra]
    if way == "bank":
        cli = [sys.executable, "-m", "cas_bank.tools.cli", "mlx-vlm-server"]
        return [*cli, "--bank", str(root / "bank"), "--block-size", "16", *args], env
    env["APC_ENABLED"] = "0" if way == "none" else "1"
    env["APC_DISK_ENABLED"] = "1" if way == "apc-disk" else "0"
    env["APC_DISK_PATH"] = str(root / "apc-disk")
    return [sys.executable, "-m", "mlx_vlm.server", *args], env


def start(way: str, model: Path, root: Path, *extra: str) -> VlmServer:
    """Start `way` on `model` and return once `/health` answers (its stderr goes to
    `root/<way>.log`)."""
    if way not in WAYS:
        raise ValueError(f"unknown way {way!r}; known: {', '.join(WAYS)}")
    root.mkdir(parents=True, exist_ok=True)
    cmd, env = command(way, model, root, *extra)
    log = root / f"{way}.log"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stderr is not None
    url = None
    with open(log, "a") as out:
        for line in proc.stderr:
            out.write(line)
            found = _RUNNING.search(line)
            if found:
                url = found.group(1)
                break
    if url is None:
        proc.wait(timeout=30)
        raise RuntimeError(f"{way} server did not start:\n{log.read_text()[-3000:]}")
    drain = threading.Thread(target=_drain, args=(proc, log), daemon=True)
    drain.start()
    server = VlmServer(proc, url, way, str(model), log, drain)
    try:
        httpx.get(f"{url}/health", timeout=TIMEOUT).raise_for_status()
    except BaseException:
        server.stop()
        raise
    return server


def _drain(proc: subprocess.Popen[str], log: Path) -> None:
    assert proc.stderr is not None
    with open(log, "a") as out:
        for line in proc.stderr:
            out.write(line)


def data_url(image: Any) -> str:
    """A PIL image as a `data:image/png;base64,...` URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(system: str, image_url: str | None, question: str) -> list[dict[str, Any]]:
    """A chat of a system prompt and one user message: the image, then the question."""
    content: list[dict[str, Any]] = []
    if image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url}})
    content.append({"type": "text", "text": question})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


@dataclass(frozen=True)
class Answer:
    """One request's outcome."""

    text: str
    ttft_s: float  # request sent -> first streamed token
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float]  # of the tokens chosen (when asked)


def ask(
    server: VlmServer,
    chat: list[dict[str, Any]],
    *,
    max_tokens: int = 4,
    logprobs: bool = False,
    tenant: str | None = None,
) -> Answer:
    """One greedy streamed chat request (the time to its first token measured)."""
    body: dict[str, Any] = {
        "model": server.model,
        "messages": chat,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 1}
    headers = {"X-APC-Tenant": tenant} if tenant else {}
    text, lps, usage, first = [], [], {}, None
    start = time.perf_counter()
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.way}: {r.status_code} {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece or "")
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    lps.append(float(lp["logprob"]))
    total = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        "".join(text),
        first if first is not None else total,
        total,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        lps,
    )
