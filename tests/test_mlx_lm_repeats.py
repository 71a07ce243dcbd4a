"""`cas-bank mlx-lm-server`: an exact repeat of a prompt on mlx-lm's sequential path
(`_serve_single`: a request with a `seed`, or a salted one) restores all of it but
its last token, on hybrid models as on attention-only ones.

That path inserts the prompt and its answer as one cache, so nothing it stores ends
where the prompt does: on a hybrid model (Gated DeltaNet layers) the recurrent states
the bank held sat only past the prompt's last token but one, and a repeat restored
nothing (mlx-lm's own `LRUPromptCache` restores nothing there either: a hybrid cache
cannot be trimmed back). The bank stores an end record at that token
(`BankPromptCache`: the prompt of its last fetch). Through the real command on model
directories from `hf_models`, a prompt ending on a block boundary (as the one that
showed it: 1,936 tokens, 121 blocks); each answer at temperature 0 must be the one a
server with an empty bank that stores nothing gives (`--stores off`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_models import hf_tokenizer, model_dir
from server_kit import cached, complete, completion_text
from test_mlx_lm_server import BLOCK, start

SENTENCE = "The weather in the city is sunny with a light wind from the west. "


def _prompt(tokenizer: Any) -> str:
    """A prompt of a few hundred tokens that ends on a block boundary."""
    text = "the prompt: " + SENTENCE * 8
    while len(tokenizer.encode(text)) % BLOCK:
        text += "a"
    return text


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-qwen3_5", "tiny-qwen3"])
def test_an_exact_repeat_on_the_sequential_path_restores_all_but_its_last_token(
    name: str, tmp_path: Path
) -> None:
    model = model_dir(tmp_path / "model", name)
    prompt = _prompt(hf_tokenizer(model))
    log = tmp_path / "server.log"
    empty = start(tmp_path / "empty", model, log, "--stores", "off")
    try:
        reference = complete(empty.url, prompt, 5, seed=7)
    finally:
        assert empty.stop() == 0, log.read_text()
    server = start(tmp_path / "bank", model, log)
    try:
        seeded = [complete(server.url, prompt, 5, seed=7) for _ in range(3)]
        salted = [complete(server.url, prompt, 5, cache_salt="tenant-a") for _ in range(3)]
    finally:
        assert server.stop() == 0, log.read_text()
    n = int(reference["usage"]["prompt_tokens"])
    assert n % BLOCK == 0 and cached(reference) == 0
    # The first of each stores it (a salt shares nothing with no salt); each repeat
    # restores all but the last token, which mlx-lm prefills for its logits.
    assert [cached(r) for r in seeded] == [0, n - 1, n - 1], name
    assert [cached(r) for r in salted] == [0, n - 1, n - 1], name
    assert all(completion_text(r) == completion_text(reference) for r in seeded + salted)
