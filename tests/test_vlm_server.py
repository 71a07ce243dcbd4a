"""mlx-vlm's own server on a bank (`cas-bank mlx-vlm-server`), with images in the prompts.

The real command runs in a subprocess on an mlx-vlm model directory of the embedded
tiny Qwen2-VL (`vlm_model_dir`: seeded weights, a local tokenizer and processor
configuration), and a plain `mlx_vlm.server` without a cache runs beside it as the
reference. Images travel as `data:` URLs; nothing is downloaded. Every request is
greedy and asks for the chosen tokens' logprobs, which differ from one image to the
other (so an answer built on another image's blocks would show).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytest.importorskip("mlx_vlm")
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level package beside cas_bank
    sys.path.insert(0, str(REPO_ROOT))

from cas_bank.runtime.mlx_vlm_dirs import vlm_model_dir
from cas_bank.runtime.vlm_models import random_image

from benchmarks.vlm_servers import VlmServer, ask, data_url, messages, start

SYSTEM = "You are a careful assistant. Look at the screenshot and answer briefly. " * 3
LOGPROBS = ("--top-logprobs-k", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vlm_model_dir(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def images() -> list[str]:
    return [data_url(random_image(seed, (112, 112))) for seed in (0, 1)]


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VlmServer]:
    server = start("none", model, tmp_path_factory.mktemp("none"), *LOGPROBS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bank")


@pytest.fixture(scope="module")
def banked(model: Path, root: Path) -> Iterator[VlmServer]:
    server = start("bank", model, root, *LOGPROBS)
    yield server
    server.stop()


def _counts(server: VlmServer) -> tuple[int, int, int]:
    """Prefixes restored from the bank, images whose encoder output it gave, images
    encoded."""
    s = server.stats()
    return int(s["lookups_hit"]), int(s["image_feature_hits"]), int(s["images_encoded"])


def test_same_image_restores_its_blocks_other_image_none(
    banked: VlmServer, reference: VlmServer, images: list[str]
) -> None:
    first = ask(banked, messages(SYSTEM, images[0], "what is in this picture?"), logprobs=True)
    assert first.cached_tokens == 0
    hits, feature_hits, encoded = _counts(banked)
    # Another question on the same image: the system prompt and the image come from the
    # bank, and so does the image's encoder output (mlx-vlm would run the encoder again).
    same = messages(SYSTEM, images[0], "how many windows are open?")
    again = ask(banked, same, logprobs=True)
    assert again.cached_tokens > 0.8 * again.prompt_tokens, again
    assert _counts(banked) == (hits + 1, feature_hits + 1, encoded)
    # The same question on another image at the same place: nothing of the image is reused
    # (mlx-vlm reuses a prefix only when it covers every image of the prompt).
    other = messages(SYSTEM, images[1], "how many windows are open?")
    elsewhere = ask(banked, other, logprobs=True)
    assert elsewhere.cached_tokens == 0
    assert _counts(banked) == (hits + 1, feature_hits + 1, encoded + 1)
    # Answers as mlx-vlm's without a cache, to the bit; and the image changes them.
    for chat, got in ((same, again), (other, elsewhere)):
        want = ask(reference, chat, logprobs=True)
        assert (got.text, got.logprobs) == (want.text, want.logprobs)
    assert again.logprobs != elsewhere.logprobs


def test_two_images_in_one_request(
    banked: VlmServer, reference: VlmServer, images: list[str]
) -> None:
    """Two images in one message: the second request with both restores through both,
    their encoder output read from the bank, and the answers are those without a cache."""

    def chat(question: str) -> list[dict[str, object]]:
        parts: list[dict[str, object]] = [
            {"type": "image_url", "image_url": {"url": url}} for url in images
        ]
        parts.append({"type": "text", "text": question})
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]

    ask(banked, chat("which one is brighter?"))
    hits, feature_hits, encoded = _counts(banked)
    got = ask(banked, chat("which one has more red?"), logprobs=True)
    assert got.cached_tokens > 0.8 * got.prompt_tokens, got
    assert _counts(banked) == (hits + 1, feature_hits + 2, encoded)
    want = ask(reference, chat("which one has more red?"), logprobs=True)
    assert (got.text, got.logprobs) == (want.text, want.logprobs)


def test_tenants_do_not_share(banked: VlmServer, images: list[str]) -> None:
    chat = messages(SYSTEM, images[0], "is there a cat?")
    ask(banked, chat)  # unsalted: stored for everyone without a tenant
    assert ask(banked, chat, tenant="acme").cached_tokens == 0
    assert ask(banked, messages(SYSTEM, images[0], "a dog?"), tenant="acme").cached_tokens > 0
    assert ask(banked, messages(SYSTEM, images[0], "a dog?"), tenant="other").cached_tokens == 0


def test_batched_requests_restore_their_own_images(
    banked: VlmServer, reference: VlmServer, images: list[str]
) -> None:
    """Requests sent together are prefilled in one batch by mlx-vlm: each restores its
    own image's blocks (warm and cold rows side by side) and answers as without a cache."""
    ask(banked, messages(SYSTEM, images[0], "what is on the left?"))
    chats = [
        messages(SYSTEM, images[i % 2], f"question {i}: what is on the right?") for i in range(4)
    ]
    with ThreadPoolExecutor(len(chats)) as pool:
        got = list(pool.map(lambda c: ask(banked, c, logprobs=True), chats))
    assert got[0].cached_tokens > 0  # the image stored just before
    for chat, answer in zip(chats, got, strict=True):
        want = ask(reference, chat, logprobs=True)
        assert (answer.text, answer.logprobs) == (want.text, want.logprobs)


def test_kept_across_a_restart(
    banked: VlmServer, model: Path, root: Path, reference: VlmServer, images: list[str]
) -> None:
    new = data_url(random_image(2, (112, 112)))  # an image no request sent before
    ask(banked, messages(SYSTEM, new, "what colour is it?"))
    assert banked.stop() == 0  # SIGTERM: the writer's queue written, the bank closed, exit 0
    restarted = start("bank", model, root, *LOGPROBS)
    try:
        chat = messages(SYSTEM, new, "which shapes are there?")
        got = ask(restarted, chat, logprobs=True)
        assert got.cached_tokens > 0.8 * got.prompt_tokens
        assert _counts(restarted) == (1, 1, 0)  # its KV and its encoder output kept
        want = ask(reference, chat, logprobs=True)
        assert (got.text, got.logprobs) == (want.text, want.logprobs)
    finally:
        assert restarted.stop() == 0


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_other_families(name: str, tmp_path: Path, images: list[str]) -> None:
    """Qwen2.5-VL (its encoder output from the bank too) and Qwen3-VL (mlx-vlm drops its
    deepstack rows when given features: it encodes every request as mlx-vlm does)."""
    model = vlm_model_dir(tmp_path / name, name)
    reference = start("none", model, tmp_path / "none", *LOGPROBS)
    banked = start("bank", model, tmp_path / "bank", *LOGPROBS)
    try:
        for question in ("what is it?", "where is it?"):
            chat = messages(SYSTEM, images[0], question)
            got, want = ask(banked, chat, logprobs=True), ask(reference, chat, logprobs=True)
            assert (got.text, got.logprobs) == (want.text, want.logprobs)
        assert got.cached_tokens > 0.8 * got.prompt_tokens, got
        assert _counts(banked)[1:] == ((1, 1) if name == "tiny-qwen2.5-vl" else (0, 0))
    finally:
        banked.stop()
        reference.stop()


def test_requests_registry_never_mixes_pixels() -> None:
    """Requests are found by (mlx-vlm's hash, ids); two queued under one key with other
    pixels (a collision of mlx-vlm's 64-bit hash) leave it ambiguous: served uncached."""
    import numpy as np
    from cas_bank.runtime.mlx_vlm_apc import Requests

    ids = [1, 2, 3]
    a = {"pixel_values": np.zeros((4, 8), np.float32), "image_grid_thw": np.array([[1, 2, 2]])}
    b = {"pixel_values": np.ones((4, 8), np.float32), "image_grid_thw": np.array([[1, 2, 2]])}
    r = Requests()
    r.remember(7, ids, a, None)
    r.remember(7, ids, a, None)  # the same request twice: found until both are stored
    found = r.get(7, ids)
    assert found is not None and found.pixels is a["pixel_values"]
    assert r.get(7, [1, 2]) is None and r.get(8, ids) is None
    r.forget(7, ids)
    assert r.get(7, ids) is found
    r.remember(7, ids, b, "tenant")  # other pixels under the same key
    assert r.get(7, ids) is None
    r.forget(7, ids)
    r.forget(7, ids)
    r.remember(7, ids, b, "tenant")
    found = r.get(7, ids)
    assert found is not None and found.salt == "tenant" and found.pixels is b["pixel_values"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [([], "mlx-vlm-server needs --model"), (["--model", "m", "--kv-bits", "8"], "--kv-bits")],
)
def test_refused_before_anything_opens(tmp_path: Path, extra: list[str], says: str) -> None:
    bank = tmp_path / "bank"
    cmd = [sys.executable, "-m", "cas_bank.tools.cli", "mlx-vlm-server", "--bank", str(bank)]
    done = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not bank.exists()
