"""Local model directories with a real tokenizer and chat template, and quantized weights.

The directories come from `hf_models`: a byte-level BPE trained here and a Qwen-style
Jinja chat template, next to weights saved by `save_model` (4-bit quantized by
mlx-lm's `quantize_model` for the quantized ones). They go through `cas-bank serve
--model DIR`, the demo, the engine's system-prompt branch hint and `cas-bank show`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache, build_model, load_model, save_model
from cas_bank.runtime.demo import run_demo
from cas_bank.runtime.engine import Engine
from cas_bank.runtime.generation import GenerationRequest
from cas_bank.runtime.models import weights_digest
from cas_bank.tools.cli import main as cli_main
from hf_models import model_dir, quantized
from mlx.utils import tree_flatten, tree_unflatten
from runtime_helpers import random_tokens, temp_bank
from test_mlx_lm_server import common

from cas_bank import Bank, BankConfig

BLOCK = 16
SYSTEM = "You are a careful assistant for a team of engineers. Answer briefly. " * 3


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("hf") / "hybrid", "tiny-hybrid")


def conversation(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_the_system_prompt_hint_is_found_through_the_real_template_and_show_decodes(
    hybrid_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = load_model(hybrid_dir)
    tok: Any = loaded.tokenizer
    bank = Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK))
    with Engine(loaded, bank, owns_bank=True) as engine:
        one, two = conversation("what is the weather?"), conversation("and the time?")
        p1, p2 = engine.chat_prompt(one), engine.chat_prompt(two)
        assert p1 == list(tok.apply_chat_template(one, add_generation_prompt=True))
        hints = engine.branch_hints(one, p1)
        # The template renders the system message alone up to the next "<|im_start|>".
        system_alone = list(tok.apply_chat_template(one[:1], add_generation_prompt=True))
        assert hints == (common(system_alone, p1),)
        assert tok.decode(p1[: hints[0]]).endswith(SYSTEM + "<|im_end|>\n<|im_start|>")
        for prompt, messages in ((p1, one), (p2, two)):
            request = GenerationRequest(
                prompt=prompt, max_tokens=3, branch_hints=engine.branch_hints(messages, prompt)
            )
            result = engine.generate(request)
        # The hybrid's state was captured at the hint's boundary: agent two restores it.
        assert result.cached_tokens == hints[0] // BLOCK * BLOCK > 0
        first_block = engine.prefix_cache.namespace.chain(p1)[0].hex()

    assert cli_main(["show", str(tmp_path / "bank"), first_block[:16], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens"] == p1[:BLOCK]
    assert shown["text"] == tok.decode(p1[:BLOCK]) and shown["text"].startswith("<|im_start|>")
    assert cli_main(["show", str(tmp_path / "bank"), first_block[:16]]) == 0
    assert "<|im_start|>system" in capsys.readouterr().out


def test_the_demo_runs_on_a_model_directory(hybrid_dir: Path, tmp_path: Path) -> None:
    report = run_demo(
        1, 1, max_tokens=2, block_size=64, bank_dir=tmp_path / "bank", model=hybrid_dir
    )
    assert report.model == "hybrid"
    first, after = report.rows
    # The next turn after the restart restores at least the first turn's full blocks.
    assert first.cached_tokens == 0
    assert after.cached_tokens >= (first.prompt_tokens - 1) // 64 * 64 > 0


def test_quantized_weights_share_blocks_only_with_the_very_same_weights(tmp_path: Path) -> None:
    base = build_model("tiny-qwen3")
    q4, q4_again, q8 = quantized(base), quantized(base), quantized(base, bits=8)
    digests = {weights_digest(m.model) for m in (base, q4, q8)}
    assert len(digests) == 3 and q4.weights_digest == q4_again.weights_digest
    # The digest covers the quantized tensors themselves: scales and biases too.
    params = dict(tree_flatten(q4_again.model.parameters()))
    assert {
        "model.layers.0.self_attn.q_proj.scales",
        "model.layers.0.self_attn.q_proj.biases",
    } <= set(params)
    scales = params["model.layers.0.self_attn.q_proj.scales"]
    q4_again.model.update(
        tree_unflatten([("model.layers.0.self_attn.q_proj.scales", scales * 1.001)])
    )
    mx.eval(q4_again.model.parameters())
    changed = dataclasses.replace(
        q4_again, weights_digest=weights_digest(q4_again.model, refresh=True)
    )
    assert changed.weights_digest != q4.weights_digest

    directory = save_model(q4, tmp_path / "q4")
    reloaded = load_model(directory)
    assert reloaded.weights_digest == q4.weights_digest

    tokens = random_tokens(np.random.default_rng(0), 3 * BLOCK + 1)
    with temp_bank(BLOCK) as bank:
        writer = PrefixCache(bank, q4)
        cache, _ = writer.restore(tokens)
        writer.prefill(tokens, cache)
        assert PrefixCache(bank, reloaded).match(tokens) == 3 * BLOCK  # the same weights
        for other in (base, q8, changed):
            assert PrefixCache(bank, other).match(tokens) == 0


def test_cas_bank_serve_a_quantized_model_directory_with_its_tokenizer(tmp_path: Path) -> None:
    directory = model_dir(tmp_path / "q4", "tiny-qwen3", quantize=True)
    cmd = [sys.executable, "-m", "cas_bank.tools.cli", "serve", "--json", "--port", "0"]
    cmd += ["--bank", str(tmp_path / "bank"), "--block-size", str(BLOCK), "--model", str(directory)]
    with open(tmp_path / "server.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        answers = []
        for user in ("what is the weather?", "and the time?"):
            body = {"model": "q4", "messages": conversation(user), "max_tokens": 3}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    tok: Any = load_model(directory).tokenizer
    shared = common(
        *(
            list(tok.apply_chat_template(conversation(u), add_generation_prompt=True))
            for u in ("what is the weather?", "and the time?")
        )
    )
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    # The shared full blocks, and (partial-block reuse) up to the rest of what is shared.
    assert cached[0] == 0 and shared // BLOCK * BLOCK <= cached[1] <= shared and cached[1] > 0
