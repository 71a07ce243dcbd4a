"""A queued store's snapshot (new objects over the cache's buffers, no copy: docs/design.md,
"Background writer") against what a runtime does to its cache before the writer has
written it, with real mlx-lm caches, models and RocksDB: the bank writes and hands out
exactly what the prefill computed. And what a snapshot keeps alive: a recurrent
state's, no more memory than a lease is charged for it, where a model's state is a view
of a larger buffer (the last rows of a forward pass's input, as lfm2's conv state is);
a failed store's, nothing once it has failed (its exception keeps no frame). And what
a queued store reads of its caller's later: nothing the caller may write meanwhile (its
token array, its logits and hidden state).
"""

from __future__ import annotations

import copy
import gc
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from conftest import attention_spec, prefix_layers, tokens_of
from mlx_lm.utils import _get_classes
from runtime_helpers import random_tokens, temp_bank, tiny

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Write

BLOCK = 16


def _bits(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _cache_bits(cache: list[Any], n: int) -> list[bytes]:
    """The bits of the first `n` tokens' KV of every attention layer, and of every
    recurrent layer's state."""
    out = []
    for c in cache:
        if hasattr(c, "keys"):
            out += [_bits(c.keys[..., :n, :]), _bits(c.values[..., :n, :])]
        else:
            out += [_bits(a) for a in c.cache]
    return out


def _abuse(pc: PrefixCache, cache: list[Any], n: int) -> None:
    """What a runtime does to a cache in place after its prefill: decode steps, a trim
    back below the stored end (into the end record's tail and the last full block),
    new tokens over the trimmed rows, direct slice writes into the KV below `n`, and
    writes into the recurrent states."""
    rng = np.random.default_rng(1)
    for _ in range(3):
        pc.model(mx.array([[int(rng.integers(0, 200))]]), cache=cache)
    mx.eval([c.state for c in cache])
    hybrid = pc.spec.is_hybrid
    for c in cache:
        if hasattr(c, "keys"):
            c.trim(c.offset - (n - BLOCK + 2))
    if not hybrid:  # a recurrent state cannot be trimmed: no new tokens over the KV
        pc.model(mx.array([[int(t) for t in rng.integers(0, 200, 12)]]), cache=cache)
    for c in cache:
        if hasattr(c, "keys"):
            c.keys[..., :4, :] = mx.zeros_like(c.keys[..., :4, :])
            c.values[..., n - 3 : n, :] = mx.zeros_like(c.values[..., n - 3 : n, :])
        else:
            for i in range(len(c.cache)):
                c.cache[i][...] = 0
    mx.eval([c.state for c in cache])


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("tiny-qwen3", "float32"),
        ("tiny-qwen3", "bfloat16"),
        ("tiny-hybrid", "float32"),
        ("tiny-qwen3_5", "bfloat16"),
    ],
)
def test_a_queued_store_writes_what_the_prefill_computed_whatever_its_cache_does_next(
    name: str, dtype: str
) -> None:
    pc_model = tiny(name, dtype)
    tokens = random_tokens(np.random.default_rng(11), 3 * BLOCK + 5, 200)
    n = len(tokens)
    with temp_bank(BLOCK) as bank:
        assert bank.writer is not None and bank.leases is not None
        pc = PrefixCache(bank, pc_model)
        reference = pc.new_cache()
        want_logits = _bits(pc.prefill(tokens, reference, store=False))
        want = _cache_bits(reference, n)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(60))  # the prefill's store stays queued
        try:
            cache = pc.new_cache()
            pc.prefill(tokens, cache)
            _abuse(pc, cache, n)
            queued, k, logits = pc.restore_exact(tokens)  # from the queued records
            assert k == n and logits is not None
            assert _cache_bits(queued, n) == want and _bits(logits) == want_logits
        finally:
            gate.set()
        bank.flush()
        bank.leases.clear()  # what was written, read back
        written, k, logits = pc.restore_exact(tokens)
        assert k == n and logits is not None
        assert _cache_bits(written, n) == want and _bits(logits) == want_logits


def _lfm2() -> nn.Module:
    """A tiny mlx-lm lfm2 model (a conv layer, an attention layer): its conv state is
    the last rows of the forward pass's input, a view of that whole buffer."""
    config: dict[str, Any] = dict(
        model_type="lfm2",
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        layer_types=["conv", "full_attention"],
    )
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.eval()
    mx.eval(model.parameters())
    return model


def test_a_leased_state_keeps_no_more_memory_alive_than_it_is_charged_for() -> None:
    with temp_bank(BLOCK, spare_bytes=0) as bank:
        leases = bank.leases
        assert leases is not None
        pc = PrefixCache(bank, _lfm2(), chunk_size=4096)
        cache = pc.new_cache()
        tokens = random_tokens(np.random.default_rng(2), 2100, 200)
        pc.prefill(tokens, cache)  # one pass to 2096 (its state captured), one to 2100
        assert pc.last_prefill is not None and pc.last_prefill.captured == [2096]
        bank.flush()
        del cache
        entries = list(leases._entries.items())
        assert any(key.startswith(b"s") for key, _ in entries), "no state was leased"
        del entries
        for key in list(leases._entries):
            charged = leases._entries[key].nbytes
            gc.collect()
            before = mx.get_active_memory()
            with leases._lock:
                leases._drop(key)
            gc.collect()
            freed = before - mx.get_active_memory()
            # A 2098-row view of the pass's input would keep ~0.5 MiB, charged 512 bytes.
            assert freed <= charged + 16384, (key[:1], freed, charged)
        assert leases.used_bytes == 0


@pytest.mark.parametrize("failing", ["blocks", "ends"])
def test_a_failed_store_lets_go_of_its_snapshot(tmp_path: Path, failing: str) -> None:
    """The exception a failed store keeps (for `flush()` and its `PendingStore`) holds
    no frame's locals: not the job, whose snapshot is the cache's whole buffers."""

    class Failing(RocksStore):
        def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
            if any(w[0].value == failing for w in writes):
                raise OSError("disk full")
            super().put_batch(writes)

    config = BankConfig(block_size=BLOCK, spare_bytes=0)
    with Bank.open(Failing(tmp_path / "bank"), config) as bank:
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        gc.collect()
        before = mx.get_active_memory()
        cache = pc.new_cache()
        pc.prefill(random_tokens(np.random.default_rng(3), 300, 200), cache)
        with pytest.raises(OSError, match="disk full"):
            bank.flush()
        del cache
        gc.collect()
        assert bank.leases is not None and bank.leases.used_bytes == 0
        assert pc.last_pending is not None and pc.last_end_pending is not None  # kept
        assert mx.get_active_memory() - before <= 16384


@pytest.mark.parametrize("kind", ["numpy", "mlx"])
def test_a_queued_store_keeps_its_own_tokens(kind: str) -> None:
    """A caller may write new tokens into the array it prefilled from (a reused buffer,
    an MLX array updated in place, which numpy's view of it then shows) before the
    writer has written the store: the blocks are stored under the tokens they were
    computed from, and a prompt of the new tokens restores none of them."""
    rng = np.random.default_rng(1)
    first = np.array(random_tokens(rng, 4 * BLOCK + 3, 200), dtype=np.uint32)
    other = np.array(random_tokens(rng, len(first), 200), dtype=np.uint32)
    with temp_bank(BLOCK) as bank:
        assert bank.writer is not None and bank.leases is not None
        pc = PrefixCache(bank, tiny("tiny-qwen3"))
        tokens: Any = first.copy() if kind == "numpy" else mx.array(first)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(60))  # the prefill's store stays queued
        try:
            pc.prefill(tokens, pc.new_cache())
            tokens[:] = other if kind == "numpy" else mx.array(other)
            mx.eval(tokens)
        finally:
            gate.set()
        bank.flush()
        bank.leases.clear()  # what was written, read back
        assert pc.restore([*first.tolist(), 1])[1] == len(first)
        assert pc.restore([*other.tolist(), 1])[1] == 0


def test_a_queued_end_record_keeps_its_own_logits_and_hidden_state(tmp_path: Path) -> None:
    """The caller's logits and hidden state, written in place after the end record was
    queued: the record holds what they were when it was stored."""
    spec = attention_spec()
    prompt = tokens_of(np.random.default_rng(0), 9)
    layers = prefix_layers(spec, prompt)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=4)) as bank:
        assert bank.writer is not None and bank.leases is not None
        ns = bank.namespace(spec)
        ns.store(prompt, layers)
        logits, hidden = mx.ones((50,)), mx.ones((8,))
        mx.eval(logits, hidden)
        gate = threading.Event()
        bank.writer.submit(lambda: gate.wait(60))
        try:
            ns.store_end_later(prompt, layers, logits=logits, hidden=hidden)
            logits[:] = 5.0
            hidden[:] = 7.0
            mx.eval(logits, hidden)
        finally:
            gate.set()
        bank.flush()
        bank.leases.clear()
        hit = ns.restore(prompt)
        assert hit is not None and hit.logits is not None and hit.hidden is not None
        assert np.array_equal(np.array(hit.logits), np.ones(50, np.float32))
        assert np.array_equal(np.array(hit.hidden), np.ones(8, np.float32))
