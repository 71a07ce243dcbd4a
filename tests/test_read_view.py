"""One read view (`index.view`): what a bank has accepted is found by every lookup at
once, queued in the background writer or written. A fetch made from another thread
right after a store returns finds its end record, its partial block, its recurrent
state and its quantized namespace, restored bit for bit; a queued store that fails
leaves the view and `flush()` raises it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import BankPromptCache
from conftest import (
    attention_spec,
    bits,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    state_bits,
    tokens_of,
)
from hf_models import wide
from mlx_lm.models.cache import make_prompt_cache
from runtime_helpers import random_tokens, temp_bank

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Write
from cas_bank.maintenance.explain import explain

T = TypeVar("T")
REPEATS = 50
SIZES = [4, 16, 64]
KEY = ("model-dir", None, None)


@pytest.fixture(scope="module")
def elsewhere() -> Any:
    """Runs a call on another thread (as a server's next request would) and returns
    what it returned."""
    with ThreadPoolExecutor(1, thread_name_prefix="fetch") as pool:

        def run(fn: Callable[[], T]) -> T:
            return pool.submit(fn).result(timeout=60)

        yield run


@pytest.mark.parametrize("block_size", SIZES)
@pytest.mark.parametrize("hot_bytes", [256 << 20, 0])
def test_a_queued_end_record_is_found_right_after_the_store(
    tmp_path: Path, elsewhere: Any, block_size: int, hot_bytes: int
) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(block_size)
    config = BankConfig(block_size=block_size, write_behind=4, hot_bytes=hot_bytes)
    with Bank.open(tmp_path / "bank", config) as bank:
        ns = bank.namespace(spec)
        for _ in range(REPEATS if hot_bytes else REPEATS // 5):
            prompt = tokens_of(rng, 2 * block_size + block_size // 2 + 1)
            layers = prefix_layers(spec, prompt)
            ns.store_later(prompt, layers)
            ns.store_end_later(prompt, layers)
            follow = prompt + tokens_of(rng, 3)
            hit = elsewhere(lambda f=follow: ns.restore(f))
            assert hit is not None and hit.tokens == len(prompt) and hit.end
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(prompt))
            assert elsewhere(lambda f=follow: ns.match(f)) == len(prompt)
        bank.flush()


@pytest.mark.parametrize("block_size", SIZES)
def test_a_queued_partial_block_is_found_right_after_the_store(
    tmp_path: Path, elsewhere: Any, block_size: int
) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(10 + block_size)
    shared = max(1, block_size // 2)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=block_size)) as bank:
        ns = bank.namespace(spec)
        for _ in range(REPEATS):
            prompt = tokens_of(rng, 3 * block_size)
            ns.store_later(prompt, prefix_layers(spec, prompt))
            # Leaves the stored prompt inside its last block: a partial block.
            branch = prompt[: 2 * block_size + shared] + [2000 + t for t in range(block_size)]
            hit = elsewhere(lambda b=branch: ns.restore(b))
            want = 2 * block_size + shared
            assert hit is not None and hit.tokens == want and hit.partial == shared
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(
                prefix_layers(spec, branch), spec, want
            )
            assert elsewhere(lambda b=branch: ns.match(b)) == want
        bank.flush()


@pytest.mark.parametrize("block_size", SIZES)
def test_a_queued_quantized_insert_picks_its_namespace_right_after(
    elsewhere: Any, block_size: int
) -> None:
    loaded = wide("tiny-qwen3")
    rng = np.random.default_rng(20 + block_size)
    with temp_bank(block_size) as bank:
        pc = BankPromptCache(bank, loaded, model_key=KEY, kv_bits=4, kv_group_size=32)
        for _ in range(REPEATS):
            prompt = random_tokens(rng, block_size + block_size // 2 + 2)
            cache = make_prompt_cache(loaded.model)
            loaded.model(mx.array(prompt)[None], cache=cache)
            cache = [c.to_quantized(group_size=32, bits=4) for c in cache]
            pc.insert_cache(KEY, prompt, cache)
            follow = prompt + random_tokens(rng, 3)
            restored, rest = elsewhere(lambda f=follow: pc.fetch_nearest_cache(KEY, f))
            assert restored is not None and len(follow) - len(rest) == len(prompt)
            n = len(prompt)
            for got, held in zip(restored, cache, strict=True):
                for a, b in zip(flat(kv(got)), flat(kv(held)), strict=True):
                    assert bits(a[..., :n, :]) == bits(b[..., :n, :])
        bank.flush()
        assert pc.stats()["failures"] == 0


def kv(cache: Any) -> Any:
    """A quantized cache's arrays: its keys' and values' (data, scales, biases)."""
    return (cache.keys, cache.values)


def flat(x: Any) -> list[mx.array]:
    if isinstance(x, (tuple, list)):
        return [a for part in x for a in flat(part)]
    return [x]


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_queued_hybrid_state_and_end_record_are_found_right_after(
    tmp_path: Path, elsewhere: Any, block_size: int
) -> None:
    spec = hybrid_spec()
    rng = np.random.default_rng(30 + block_size)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=block_size)) as bank:
        ns = bank.namespace(spec)
        for r in range(REPEATS // 5):
            prompt = tokens_of(rng, 2 * block_size + 3)
            layers = prefix_layers(spec, prompt)
            boundary = random_state(spec, seed=r)
            at_end = random_state(spec, seed=100 + r)
            ns.store_later(prompt, layers, {2 * block_size: boundary})
            ns.store_end_later(prompt, layers, at_end)
            # The boundary's state: a prompt branching after the second block.
            branch = [*prompt[: 2 * block_size], 5000, 5001]
            hit = elsewhere(lambda b=branch: ns.restore(b))
            assert hit is not None and hit.tokens == 2 * block_size
            assert state_bits(hit.layers, spec) == state_bits(boundary, spec)
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 2 * block_size)
            # The end record's state: a prompt extending the stored one.
            follow = [*prompt, 7]
            hit = elsewhere(lambda f=follow: ns.restore(f))
            assert hit is not None and hit.tokens == len(prompt) and hit.end
            assert state_bits(hit.layers, spec) == state_bits(at_end, spec)
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(prompt))
            assert elsewhere(lambda f=follow: ns.match(f)) == len(prompt)
        bank.flush()


def test_explain_sees_a_queued_store(tmp_path: Path) -> None:
    spec = attention_spec()
    prompt = tokens_of(np.random.default_rng(40), 3 * 4 + 2)
    gate = threading.Event()
    gate.set()

    class Held(RocksStore):
        def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
            gate.wait(30)
            super().put_batch(writes)

    config = BankConfig(block_size=4, write_behind=4)
    with Bank.open(Held(tmp_path / "bank"), config) as bank:
        ns = bank.namespace(spec)
        gate.clear()  # the store's batch waits: it stays queued
        ns.store_later(prompt, prefix_layers(spec, prompt))
        ns.store_end_later(prompt, prefix_layers(spec, prompt))
        found = explain(bank, ns.root, [*prompt, 3])
        assert found.matched_blocks == 3 and found.end_record_tokens == len(prompt)
        assert found.restorable_tokens == len(prompt) and not found.corrupt
        gate.set()


def test_a_failed_queued_store_leaves_the_view_and_flush_raises_it(tmp_path: Path) -> None:
    spec = attention_spec()
    prompt = tokens_of(np.random.default_rng(41), 2 * 4 + 1)
    gate = threading.Event()

    class Failing(RocksStore):
        def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
            if any(w[0].value in ("blocks", "ends") for w in writes):
                gate.wait(30)
                raise OSError("disk full")
            super().put_batch(writes)

    with Bank.open(Failing(tmp_path / "bank"), BankConfig(block_size=4)) as bank:
        ns = bank.namespace(spec)
        ns.store_later(prompt, prefix_layers(spec, prompt))
        ns.store_end_later(prompt, prefix_layers(spec, prompt))
        assert ns.match([*prompt, 1]) == len(prompt)  # queued: in view
        gate.set()
        with pytest.raises(OSError, match="disk full"):
            bank.flush()
        assert ns.match([*prompt, 1]) == 0  # failed: out of view
        hit = ns.restore([*prompt, 1])
        assert hit is None


@pytest.mark.parametrize("stored_logits", [True, False])
def test_of_a_queued_and_a_stored_end_record_the_one_holding_more_is_found(
    tmp_path: Path, stored_logits: bool
) -> None:
    """The same end record stored with its logits and queued without: a lookup finds the
    stored one (the write will skip the queued one as held), before and after the write.
    Stored without and queued with: the queued one, whose write replaces the stored."""
    spec = attention_spec()
    rng = np.random.default_rng(42)
    prompt = tokens_of(rng, 2 * 4 + 1)
    layers = prefix_layers(spec, prompt)
    logits = mx.array(rng.standard_normal(50).astype(np.float32))
    with Bank.open(tmp_path / "bank", BankConfig(block_size=4, write_behind=2)) as bank:
        assert bank.writer is not None
        ns = bank.namespace(spec)
        ns.store(prompt, layers)
        ns.store_end(prompt, layers, logits=logits if stored_logits else None)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(30))  # the end record stays queued
        ns.store_end_later(prompt, layers, logits=None if stored_logits else logits)
        for _ in range(2):  # queued, then written
            hit = ns.restore(prompt)
            assert hit is not None and hit.end and hit.logits is not None
            assert bits(hit.logits) == bits(logits)
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, len(prompt))
            gate.set()
            bank.flush()
        assert bank.stats().ends == 1
