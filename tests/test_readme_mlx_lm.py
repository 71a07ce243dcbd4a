"""The README's "Using cas_bank with mlx-lm" snippets, run as written.

The shell command runs with the placeholders replaced (the bank and model paths, the
port); the Python lines run as they are, with `model` an mlx-lm model, and the cache
they make then serves mlx-lm's own generation loop.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from hf_models import model_dir
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from runtime_helpers import random_tokens, tiny

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets(kind: str) -> list[str]:
    text = README.read_text()
    section = text.split("## Using cas_bank with mlx-lm", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{kind}\n(.*?)```", section, flags=re.S)


def test_the_readme_server_command_runs_mlx_lms_server_on_a_bank(tmp_path: Path) -> None:
    (line,) = [ln for ln in snippets("sh")[0].splitlines() if ln.strip()]
    model = model_dir(tmp_path / "model", "tiny-qwen3")
    swap = {
        ".venv/bin/cas-bank": [sys.executable, "-m", "cas_bank.tools.cli"],
        "~/.cache/cas_bank/bank": [str(tmp_path / "bank")],
        "path/to/mlx-model": [str(model)],
        "8080": ["0"],
    }
    words = shlex.split(line)
    assert set(swap) <= set(words), line
    cmd = [w for word in words for w in swap.get(word, [word])]
    with open(tmp_path / "server.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        body = {"messages": [{"role": "user", "content": "hello " * 80}], "max_tokens": 2}
        replies = [
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json() for _ in "ab"
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()
        assert proc.stdout is not None
        proc.stdout.close()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert cached[0] == 0 and cached[1] > 0


def test_the_readme_library_lines_give_mlx_lm_a_bank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = snippets("python")
    monkeypatch.chdir(tmp_path)
    model = tiny("tiny-qwen3").model
    scope: dict[str, object] = {"model": model}
    exec(code, scope)
    prompt_cache: Any = scope["prompt_cache"]
    prompt = random_tokens(np.random.default_rng(0), 100)
    try:
        for _ in range(2):  # mlx-lm's loop: fetch, generate on the cache, insert
            cache, rest = prompt_cache.fetch_nearest_cache("model", prompt)
            cache = cache if cache is not None else make_prompt_cache(model)
            out = [
                t for t, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=2)
            ]
            prompt_cache.insert_cache("model", prompt + out, cache)
        # The second time: all but the last token (a fetch leaves one to prefill), from
        # the first insert's end record, seen at once though its write may be queued.
        assert len(prompt) - len(rest) == len(prompt) - 1
    finally:
        prompt_cache.bank.close()
