"""`cas-bank mlx-lm-server`: a prefill stopped before its end (a streamed client that
goes away, a SIGTERM) keeps what it computed, and the next attempt restores all of it.

Through the real command on a tiny hybrid model directory (`hf_models`) with
`--prefill-step-size 40`, on mlx-lm's batched path (a completion without a seed). A
chunk of 40 tokens ends inside a 16-token block as often as not, so a stopped prefill
is kept as its blocks and an end record holding the recurrent state where it stopped.
The long prompt is sized from a measured chunk time (its whole prefill about 4 s); each
test stops it after about a quarter. The server logs how many tokens a stopped prefill
kept (`--log-level INFO`); a retry's `cached_tokens` must be exactly those, and its
answer at temperature 0 the one a server with an empty bank gives.

On mlx-lm's own code (and before the fix) a stopped prompt kept nothing: a retry
restored 0 tokens.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hf_models import hf_tokenizer, model_dir
from server_kit import cached, complete, completion_text
from test_mlx_lm_server import MlxServer, start

STEP = 40  # --prefill-step-size: tokens per forward pass
WHOLE_PREFILL_S = 4.0  # the long prompt's whole prefill, about
TIMEOUT = 60.0
SENTENCE = "The weather in the city is sunny with a light wind from the west. "
STOPPED = re.compile(r"a prefill stopped \((?P<why>[^)]*)\) after (?P<n>\d+) tokens")


@dataclass
class Setup:
    model: Path
    root: Path
    prompt: str  # the long prompt
    tokens: int  # its length in tokens
    reference: str  # its answer from a server with an empty bank


def _start(bank: Path, setup_model: Path, log: Path) -> MlxServer:
    step = ("--prefill-step-size", str(STEP))
    return start(bank, setup_model, log, *step, "--log-level", "INFO")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """The model, a long prompt sized from a measured chunk time, and its answer from a
    server whose bank is empty and stores nothing (`--stores off`)."""
    root = tmp_path_factory.mktemp("mlx_lm_cancel")
    model = model_dir(root / "hybrid", "tiny-hybrid")
    tok = hf_tokenizer(model)
    server = _start(root / "reference", model, root / "reference.log")
    try:
        calibration = SENTENCE * 40
        t0 = time.perf_counter()
        complete(server.url, "calibrates: " + calibration, 4)
        chunk_s = (time.perf_counter() - t0) / (len(tok.encode(calibration)) / STEP)
        want = int(WHOLE_PREFILL_S / chunk_s) * STEP
        prompt = "the long prompt: " + SENTENCE * (want // len(tok.encode(SENTENCE)) + 1)
        reference = complete(server.url, prompt, 4)
    finally:
        assert server.stop() == 0, (root / "reference.log").read_text()
    n = int(reference["usage"]["prompt_tokens"])
    print(f"one {STEP}-token chunk {chunk_s:.3f} s; the long prompt {n} tokens")
    return Setup(model, root, prompt, n, completion_text(reference))


def _keepalives(url: str, prompt: str) -> Iterator[int]:
    """A streamed request of `prompt`: the prefill's progress (tokens done) as mlx-lm's
    keepalive lines report it; the connection closes when the caller stops iterating."""
    body = {"model": "default_model", "prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(": keepalive "):
                yield int(line.removeprefix(": keepalive ").split("/")[0])


def _stopped(log: Path, why: str, timeout: float = 20.0) -> int:
    """The tokens the server says a stopped prefill kept (its log line)."""
    deadline = time.perf_counter() + timeout
    while True:
        found = [m for m in STOPPED.finditer(log.read_text()) if m["why"] == why]
        if found:
            return int(found[-1]["n"])
        if time.perf_counter() > deadline:
            return 0  # nothing kept: mlx-lm drops the prompt
        time.sleep(0.05)


def _check_retry(setup: Setup, url: str, seen: int, kept: int) -> None:
    """The retry restores exactly what the stopped prefill kept, all of what it
    finished (whole chunks), and answers as a server with an empty bank does."""
    retry = complete(url, setup.prompt, 4)
    print(f"stopped having reported {seen} tokens; kept {kept}; retry cached {cached(retry)}")
    assert cached(retry) == kept, f"the retry restored {cached(retry)} tokens, kept {kept}"
    assert seen <= kept < setup.tokens and kept % STEP == 0
    assert completion_text(retry) == setup.reference


def test_a_streamed_client_that_goes_away_mid_prefill_leaves_it_all_restorable(
    setup: Setup,
) -> None:
    bank, log = setup.root / "bank-disconnect", setup.root / "disconnect.log"
    server = _start(bank, setup.model, log)
    try:
        seen = 0
        for seen in _keepalives(server.url, setup.prompt):
            if seen >= setup.tokens // 4:
                break  # the client goes away
        kept = _stopped(log, "its client went away")
        _check_retry(setup, server.url, seen, kept)
    finally:
        assert server.stop() == 0, log.read_text()


def test_sigterm_mid_prefill_keeps_it_for_the_next_server_on_the_bank(setup: Setup) -> None:
    bank, log = setup.root / "bank-sigterm", setup.root / "sigterm.log"
    server = _start(bank, setup.model, log)
    try:
        seen = 0
        for seen in _keepalives(server.url, setup.prompt):
            if seen >= setup.tokens // 4:
                server.proc.send_signal(signal.SIGTERM)  # the client is still there
                assert server.proc.wait(timeout=30) == 0, log.read_text()
                break
    except httpx.HTTPError:
        pass  # the server went while the stream was read
    finally:
        server.stop()
    kept = _stopped(log, "the server stopped", timeout=0)
    again = _start(bank, setup.model, log)
    try:
        _check_retry(setup, again.url, seen, kept)
    finally:
        assert again.stop() == 0, log.read_text()
