"""mlx-lm's own server (`mlx_lm.server`) on a bank: `cas-bank mlx-lm-server`.

Each test runs the real command in a subprocess on a local model directory with a
trained BPE tokenizer and a Qwen-style chat template (`hf_models`), and talks to it
over HTTP. Expected restored lengths are computed from the same tokenizer: a prompt
restores the full blocks of its longest common prefix with what earlier requests
stored, less its last token (mlx-lm needs one token to prefill).

mlx-lm's server answers chat requests on its batched path (`BatchGenerator`) unless a
request brings a seed or the server quantizes KV (`--kv-bits`): both paths are run. A
draft model (`--draft-model`, speculative decoding) is test_draft_model.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hf_models import hf_tokenizer, model_dir
from runtime_helpers import metric, stop_process
from tool_banks import assert_one_line_error, cas_bank

from cas_bank import Bank
from cas_bank.index.tree import load_namespaces

BLOCK = 16
TIMEOUT = 60.0
SYSTEM = "You are a careful assistant for a team of engineers. Answer briefly. " * 3


@dataclass
class MlxServer:
    proc: subprocess.Popen[str]
    url: str

    def stop(self) -> int:
        return stop_process(self.proc)


def start(bank: Path, model: Path, log: Path, *extra: str) -> MlxServer:
    cmd = [sys.executable, "-m", "cas_bank.tools.cli", "mlx-lm-server", "--json"]
    cmd += ["--bank", str(bank), "--block-size", str(BLOCK)]
    cmd += ["--model", str(model), "--port", "0", "--log-level", "WARNING", *extra]
    with open(log, "a") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"mlx-lm-server did not start:\n{log.read_text()}")
    return MlxServer(proc, json.loads(line)["url"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx_lm_models")
    return {
        "plain": model_dir(root / "qwen3", "tiny-qwen3"),
        "hybrid": model_dir(root / "hybrid", "tiny-hybrid"),
        "wide": model_dir(root / "wide", "tiny-qwen3", wide_heads=True),
    }


def conversation(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"model": "default_model", "messages": messages, "max_tokens": 6, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def answer(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["message"]["content"])


def ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def restorable(
    prompt: list[int],
    stored: list[list[int]],
    ends: list[list[int]] = (),  # type: ignore[assignment]
    *,
    partial: bool = True,
) -> int:
    """Tokens of prompt[:-1] a restore covers, given the prompts whose full blocks are
    stored and the end records of inserted caches (`ends`: their tokens).

    An attention-only model (`partial`) keeps, to the token, the longest prefix it
    shares with any stored block or end record: the child of the last whole block that
    shares most of its next tokens (docs/design.md, partial blocks). A hybrid model
    keeps full blocks, or deeper an end record that prefixes prompt[:-1] inside the
    block after them (its recurrent state exists only there)."""
    head = prompt[:-1]
    if partial:
        extents = [s[: len(s) // BLOCK * BLOCK] for s in stored] + list(ends)
        return max((common(head, x) for x in extents), default=0)
    best = max((common(head, s) for s in stored), default=0)
    full = best // BLOCK * BLOCK
    deeper = [len(e) for e in ends if full < len(e) < full + BLOCK and prompt[: len(e)] == e]
    return max([full, *[d for d in deeper if d <= len(prompt) - 1]])


def system_end(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Where mlx-lm's server ends the "system" segment of a chat prompt (it inserts the
    cache there): as `ResponseGenerator._tokenize` computes it."""
    prompt = ids(tokenizer, messages)
    alone = tokenizer.apply_chat_template(
        [*messages[:1], {"role": "user", "content": ""}], add_generation_prompt=False
    )
    n = common(prompt, list(alone))
    return n if n < min(len(prompt), len(alone)) else 0


def test_two_clients_share_a_system_prompt_and_a_restart_keeps_it(
    models: dict[str, Path], tmp_path: Path
) -> None:
    tok = hf_tokenizer(models["plain"])
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    one, two = conversation("what is the weather in city 1?"), conversation("and in city 22?")
    p1, p2 = ids(tok, one), ids(tok, two)
    system = len(ids(tok, conversation("")[:1])) // BLOCK * BLOCK
    assert restorable(p2, [p1], partial=False) >= system > 0

    # Each request counts what the one before it stored, to the token: inline stores
    # commit before the answer (in the background, a store still queued when the next
    # request comes restores its whole blocks from memory but not its end records).
    server = start(bank, models["plain"], log, "--inline-stores")
    try:
        r1 = chat(server.url, one)
        r2 = chat(server.url, two)
        seeded = chat(server.url, conversation("and in city 3?"), seed=7)  # sequential path
    finally:
        assert server.stop() == 0, log.read_text()
    assert (r1["usage"]["prompt_tokens"], cached(r1)) == (len(p1), 0)
    # mlx-lm's batched path inserts each prompt's cache where its system segment ends
    # and one token before the prompt's end: end records of those exact positions.
    e1, e2 = p1[: system_end(tok, one)], p2[: system_end(tok, two)]
    inserted = [e1, e2, p1[:-1], p2[:-1]]
    assert cached(r2) == restorable(p2, [p1], inserted[::2])
    three = ids(tok, conversation("and in city 3?"))
    assert cached(seeded) == restorable(three, [p1, p2], inserted)

    server = start(bank, models["plain"], log)  # a restart: the bank keeps every block
    try:
        with ThreadPoolExecutor(2) as pool:  # both in one batch of mlx-lm's generator
            again1, again2 = pool.map(lambda m: chat(server.url, m), [one, two])
        # An empty prompt ends mlx-lm's generation thread: refused before it gets there.
        empty = {"model": "default_model", "prompt": "", "max_tokens": 2}
        refused = httpx.post(f"{server.url}/v1/completions", json=empty, timeout=TIMEOUT)
        assert refused.status_code == 400 and "empty" in refused.json()["error"]
        assert answer(chat(server.url, one)) == answer(r1)  # still serving
        # The model's objects are out of the garbage collector's passes (its full
        # collections would land inside requests: cas_bank.runtime.process).
        metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        assert metric(metrics, "cas_bank_gc_frozen_objects") > 10_000
    finally:
        assert server.stop() == 0, log.read_text()
    # An exact repeat restores all but the last token (mlx-lm prefills at least one).
    assert cached(again1) == restorable(p1, [p1], inserted) == len(p1) - 1
    assert cached(again2) == restorable(p2, [p2], inserted) == len(p2) - 1
    assert (answer(again1), answer(again2)) == (answer(r1), answer(r2))
    with Bank.open(bank) as b:
        assert b.stats().hits >= 3


def test_quantized_kv_is_kept_in_its_own_namespace(models: dict[str, Path], tmp_path: Path) -> None:
    tok = hf_tokenizer(models["wide"])
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    quant = ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    one, two = conversation("what is the weather?"), conversation("what is the time?")
    server = start(bank, models["wide"], log, *quant, "--inline-stores")  # as above
    try:
        r1, r2 = chat(server.url, one), chat(server.url, two)
    finally:
        assert server.stop() == 0, log.read_text()
    assert cached(r1) == 0
    p1, p2 = ids(tok, one), ids(tok, two)
    inserted = [p1[: system_end(tok, one)], p1[:-1]]  # mlx-lm's inserts: end records
    assert cached(r2) == restorable(p2, [p1], inserted) > 0
    with Bank.open(bank) as b:
        specs = list(load_namespaces(b.store)[0].values())
    quantized = [s for s in specs if s.layers[0].quantization is not None]
    assert len(quantized) == 1 and quantized[0].layers[0].quantization.bits == 4  # type: ignore[union-attr]


def test_a_hybrid_model_restores_shared_prompts_from_captured_states(
    models: dict[str, Path], tmp_path: Path
) -> None:
    tok = hf_tokenizer(models["hybrid"])
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    one, two = conversation("what is the weather?"), conversation("and the time?")
    p1, p2 = ids(tok, one), ids(tok, two)
    # mlx-lm ends a "system" segment where the system messages rendered with an empty
    # user turn leave the prompt: the bank captures the state at the boundary below it.
    alone = tok.apply_chat_template(
        [*one[:1], {"role": "user", "content": ""}], add_generation_prompt=False
    )
    system_blocks = common(p1, list(alone)) // BLOCK * BLOCK
    server = start(bank, models["hybrid"], log)
    try:
        r1 = chat(server.url, one)
        r2 = chat(server.url, two)
        r3 = chat(server.url, one)  # an exact repeat
    finally:
        assert server.stop() == 0, log.read_text()
    assert cached(r1) == 0
    # The end records of mlx-lm's inserts hold the state at exactly their positions.
    e1 = p1[: system_end(tok, one)]
    assert 0 < system_blocks <= cached(r2) <= restorable(p2, [p1], [e1, p1[:-1]], partial=False)
    assert cached(r2) % BLOCK == 0 or cached(r2) == len(e1)
    assert cached(r3) == restorable(p1, [p1], [e1, p1[:-1]], partial=False) == len(p1) - 1
    assert answer(r3) == answer(r1)


def test_a_stop_right_after_the_ready_line_is_a_clean_exit(
    models: dict[str, Path], tmp_path: Path
) -> None:
    server = start(tmp_path / "bank", models["plain"], tmp_path / "server.log")
    assert server.stop() == 0, (tmp_path / "server.log").read_text()  # SIGTERM at once


def test_a_model_mlx_lm_cannot_load_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """An embedded model (which only `cas-bank serve` runs: no Hugging Face tokenizer)
    is refused by name, never looked up on the Hub; so is a missing --model."""
    bank = tmp_path / "nested" / "bank"
    proc = cas_bank("mlx-lm-server", "--bank", bank, "--model", "tiny-hybrid", "--port", "0")
    assert_one_line_error(proc, "tiny-hybrid", "tiny-qwen3", "cas-bank serve")
    assert "ConnectError" not in proc.stderr
    proc = cas_bank("mlx-lm-server", "--bank", bank, "--port", "0")
    assert_one_line_error(proc, "needs --model")
    assert not (tmp_path / "nested").exists()
