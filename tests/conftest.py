"""Shared fixtures and helpers: a temporary bank path, small model specs, random arrays.

Everything here builds tiny real things (a RocksDB directory under `tmp_path`, MLX
arrays) and nothing is mocked. The helpers are plain functions as well as fixtures,
so hypothesis tests and child processes (which import this module by path) use them.

Three specs cover the layouts a bank meets:
- `attention_spec()`: fp16 KV, 2 layers (a llama/qwen3-like model);
- `quantized_spec()`: mlx-lm `QuantizedKVCache` tuples (packed uint32, scales, biases);
- `hybrid_spec()`: GDN (recurrent) layers alternating with bf16 attention layers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import numpy as np
import pytest

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.arrays import DTYPES
from cas_bank.blocks import codec
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.index.chain import Header
from cas_bank.index.ends import split_record

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
BLOCK_SIZE = 4  # small blocks keep arrays tiny while exercising many blocks
PYTHON = sys.executable  # the interpreter for child processes


# -- specs ------------------------------------------------------------------------
def attention_spec(dtype: str = "float16", n_layers: int = 2, name: str = "tiny-attn") -> ModelSpec:
    """An attention-only model: every layer (keys, values) of [1, 2, T, 8]."""
    return ModelSpec(
        name=name,
        layers=tuple(
            LayerSpec.attention(kv_heads=2, head_dim=8, dtype=dtype) for _ in range(n_layers)
        ),
        weights_digest="w-" + name,
    )


def quantized_spec(bits: int = 4, group_size: int = 32) -> ModelSpec:
    """Quantized KV as mlx-lm's `QuantizedKVCache` holds it, bf16 scales and biases."""
    layer = LayerSpec.quantized_attention(
        kv_heads=2, head_dim=64, dtype="bfloat16", group_size=group_size, bits=bits
    )
    return ModelSpec(name="tiny-quant", layers=(layer, layer), weights_digest="w-quant")


def hybrid_spec() -> ModelSpec:
    """GDN, attention, GDN, attention (like qwen3_next with full_attention_interval=2).

    A recurrent layer holds conv (1, K-1, conv_dim) bf16 and recurrent (1, Hv, Dv, Dk)
    float32, as mlx-lm's `ArraysCache` does.
    """
    gdn = LayerSpec.recurrent([((1, 3, 24), "bfloat16"), ((1, 2, 4, 4), "float32")])
    att = LayerSpec.attention(kv_heads=2, head_dim=8, dtype="bfloat16")
    return ModelSpec(name="tiny-hybrid", layers=(gdn, att, gdn, att), weights_digest="w-hybrid")


def filed_hybrid_spec() -> ModelSpec:
    """`hybrid_spec()` with a recurrent state of 64 KiB: an end record is many times a
    file's 4 KiB head, and a file in a bank of `FILED_ENDS` (`hybrid_spec`'s is ~1 KiB)."""
    gdn = LayerSpec.recurrent([((1, 3, 24), "bfloat16"), ((1, 4, 64, 64), "float32")])
    att = hybrid_spec().layers[1]
    return ModelSpec(
        name="hybrid-64k-state", layers=(gdn, att, gdn, att), weights_digest="w-hybrid-64k"
    )


# Every end record of `filed_hybrid_spec()` a file, beside a hot tier that holds them all.
FILED_ENDS = BankConfig(block_size=BLOCK_SIZE, file_min_bytes=1024, hot_bytes=64 << 20)


def stored_filed_end(bank: Bank, n: int, **extra: Any) -> tuple[list[int], list[Any], list[Any]]:
    """`n` tokens of seed `n` stored in `filed_hybrid_spec()`'s namespace, with their end
    record (a state of seed `n`, over 64 KiB: a file; `extra`: logits, hidden):
    (tokens, layers, state)."""
    spec = filed_hybrid_spec()
    tokens = tokens_of(np.random.default_rng(n), n)
    layers = prefix_layers(spec, tokens)
    state = random_state(spec, n)
    ns = bank.namespace(spec)
    ns.store(tokens, layers)
    assert ns.store_end(tokens, layers, state, **extra) > 64 << 10
    return tokens, layers, state


def hot_end_bytes(bank: Bank) -> int:
    """Bytes the hot tier charges for end records now."""
    assert bank.hot is not None
    return sum(e.size for (f, _), e in bank.hot._entries.items() if f is Family.ENDS)


def end_file(bank_path: Path) -> Path:
    """The one end record file of the bank at `bank_path`."""
    (file,) = sorted((bank_path / "payloads" / "ends").iterdir())
    return file


# -- arrays -----------------------------------------------------------------------
def random_array(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> mx.array:
    """A random MLX array of `dtype` (a name from `cas_bank.arrays.DTYPES`).

    Floats are normal values; integer types are random bits. bf16 goes through its
    uint16 bits, because numpy has no bfloat16.
    """
    if dtype == "bfloat16":
        f32 = rng.standard_normal(shape, dtype=np.float32)
        return mx.array(f32).astype(mx.bfloat16)
    if dtype in ("float16", "float32", "float64"):
        return mx.array(rng.standard_normal(shape).astype(dtype))
    if dtype == "bool":
        return mx.array(rng.integers(0, 2, shape).astype(np.bool_))
    storage = DTYPES[dtype].storage
    info = np.iinfo(storage)
    bits = rng.integers(int(info.min), int(info.max), shape, dtype=storage, endpoint=True)
    return mx.array(bits)


def random_layers(spec: ModelSpec, n_tokens: int, seed: int = 0, pad: int = 0) -> list[Any]:
    """KV for `n_tokens` (+ `pad` tokens of padding) per layer, aligned with spec.layers.

    Attention layers get (keys, values) or, quantized, ((kq, ks, kb), (vq, vs, vb));
    recurrent layers get None (their states go in `states`).
    """
    rng = np.random.default_rng(seed)
    out: list[Any] = []
    for ls in spec.layers:
        if ls.kind == "recurrent":
            out.append(None)
            continue
        arrays = [random_array(s.with_tokens(n_tokens + pad), s.dtype, rng) for s in ls.arrays]
        if ls.quantization is not None:
            out.append((tuple(arrays[:3]), tuple(arrays[3:])))
        else:
            out.append(tuple(arrays))
    return out


def random_state(spec: ModelSpec, seed: int = 0) -> list[Any]:
    """One boundary's state, aligned with spec.layers: a tuple per recurrent layer."""
    rng = np.random.default_rng(seed)
    return [
        tuple(random_array(s.shape, s.dtype, rng) for s in ls.arrays)
        if ls.kind == "recurrent"
        else None
        for ls in spec.layers
    ]


def random_logits(seed: int) -> mx.array:
    """A last token's logits for an end record (50 float32, of `seed`)."""
    return mx.array(np.random.default_rng(seed).standard_normal(50).astype(np.float32))


def end_leases(bank: Bank) -> list[Any]:
    """The bank's leases of end records' decoded arrays: entries under b"e" and a
    64-byte end key (a chain's entry is under its 32-byte chain hash, which begins with
    b"e" for some tokens: those of seed 429 after a store of 2 * BLOCK_SIZE + 3)."""
    assert bank.leases is not None
    return [e for k, e in bank.leases._entries.items() if len(k) == 65 and k[:1] == b"e"]


def stored_hybrid_end(bank: Bank, n: int, **extra: Any) -> tuple[list[int], list[Any], list[Any]]:
    """`n` tokens of seed `n` stored in `hybrid_spec()`'s namespace, their blocks and
    end record (a state of seed `n`; `extra`: logits, hidden): (tokens, layers, state)."""
    spec = hybrid_spec()
    tokens = tokens_of(np.random.default_rng(n), n)
    layers = prefix_layers(spec, tokens)
    state = random_state(spec, n)
    ns = bank.namespace(spec)
    ns.store(tokens, layers)  # its blocks: an end record needs its parent
    assert ns.store_end(tokens, layers, state, **extra) > 0
    return tokens, layers, state


def prefix_layers(spec: ModelSpec, tokens: list[int], pad: int = 0) -> list[Any]:
    """KV like a real model's: the vector at position t depends only on tokens[: t + 1].

    So two prompts sharing a prefix have identical KV over it, and any restore can be
    checked bit for bit against `prefix_layers(spec, prompt)` cut to `hit.tokens`.
    """
    n = len(tokens)
    per_layer: list[list[np.ndarray]] = []
    att = [ls for ls in spec.layers if ls.kind == "attention"]
    for ls in att:
        per_layer.append(
            [np.zeros((*s.with_tokens(n + pad),), dtype=DTYPES[s.dtype].storage) for s in ls.arrays]
        )
    h = blake3.blake3(b"prefix_layers")
    for t, tok in enumerate(tokens):
        h.update(int(tok).to_bytes(4, "little"))
        rng = np.random.default_rng(np.frombuffer(h.digest(), dtype=np.uint64))
        for ls, arrays in zip(att, per_layer, strict=True):
            for s, a in zip(ls.arrays, arrays, strict=True):
                a[..., t, :] = _random_bits(rng, (*s.shape[:-1], s.shape[-1]), s.dtype)
    out: list[Any] = []
    layers = iter(per_layer)
    for ls in spec.layers:
        if ls.kind == "recurrent":
            out.append(None)
            continue
        arrays = [_from_storage(a, s.dtype) for a, s in zip(next(layers), ls.arrays, strict=True)]
        out.append((tuple(arrays[:3]), tuple(arrays[3:])) if ls.quantization else tuple(arrays))
    return out


def _random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    storage = DTYPES[dtype].storage
    if dtype in ("float16", "float32", "float64"):
        return rng.standard_normal(shape).astype(storage)
    if dtype == "bfloat16":  # normal values, as bf16 bits (the top half of float32)
        f32 = rng.standard_normal(shape, dtype=np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16)
    n = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
    return np.frombuffer(rng.bytes(n), dtype=storage).reshape(shape)


def _from_storage(a: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


def flat_arrays(layer: Any) -> list[mx.array]:
    """A layer entry ((k, v), quantized tuples or a state tuple) as a flat array list."""
    out: list[mx.array] = []
    for part in layer:
        out.extend(flat_arrays(part) if isinstance(part, (tuple, list)) else [part])
    return out


def bits(a: mx.array) -> bytes:
    """The exact bytes of an MLX array (bf16 through uint16): compare for bit identity."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return bytes(np.array(a, copy=True).tobytes())


def kv_prefix_bits(layers: list[Any], spec: ModelSpec, n: int) -> list[list[bytes]]:
    """Bytes of each attention layer's arrays cut to the first `n` tokens."""
    return [
        [bits(a[..., :n, :]) for a in flat_arrays(layer)]
        for layer, ls in zip(layers, spec.layers, strict=True)
        if ls.kind == "attention"
    ]


def layers_bits(layers: list[Any], spec: ModelSpec) -> list[list[bytes]]:
    """Bytes of every array of a restored `hit.layers`, per attention layer."""
    return [
        [bits(a) for a in flat_arrays(layer)]
        for layer, ls in zip(layers, spec.layers, strict=True)
        if ls.kind == "attention"
    ]


def state_bits(state: list[Any], spec: ModelSpec) -> list[list[bytes]]:
    """Bytes of every recurrent layer's arrays of a state (or of `hit.layers`)."""
    return [
        [bits(a) for a in layer]
        for layer, ls in zip(state, spec.layers, strict=True)
        if ls.kind == "recurrent"
    ]


def snapshot(bank: Bank) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every record of every family of a bank's store: compare to prove nothing changed."""
    return {f.value: list(bank.store.iterate(f)) for f in Family}


def check_every_block(store: BlockStore) -> int:
    """Walk the headers family; every block shown must decode with its digest, and so
    must its state when the header claims one; every parent must be shown too (or be a
    namespace root). Returns the number of blocks. Raises AssertionError otherwise."""
    roots = set(store.keys(Family.NAMESPACES))
    headers = {k: Header.decode(k, v) for k, v in store.iterate(Family.HEADERS)}
    for key, h in headers.items():
        assert h.parent in headers or h.parent in roots, f"{key.hex()} has no parent"
        payload = store.get(Family.BLOCKS, key)
        assert payload is not None, f"{key.hex()} has a header but no payload"
        codec.decode(payload, h.payload_digest)
        assert len(payload) == h.payload_size
        if h.state_digest is not None:
            state = store.get(Family.STATES, key)
            assert state is not None, f"{key.hex()} claims a state that is not there"
            codec.decode(state, h.state_digest)
    for key, value in store.iterate(Family.ENDS):  # an end record never dangles
        end, payload = split_record(key, value)
        assert end.parent in headers or end.parent in roots, f"end {key.hex()} has no parent"
        codec.decode(payload, end.payload_digest)
    return len(headers)


def tokens_of(rng: np.random.Generator, n: int, vocab: int = 1000) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def child_env() -> dict[str, str]:
    """Environment for a child python that imports this module and cas_bank."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


# -- fixtures ---------------------------------------------------------------------
CHECKS = ("xxh3", "blake3")
"""The payload checks a bank's records carry: XXH3-128 (what a bank created at format
version 4 writes) and blake3 (every record of an older bank)."""


@pytest.fixture(params=CHECKS)
def check(request: pytest.FixtureRequest) -> str:
    """The payload check a test's new bank writes (`BankConfig.payload_check`): a test
    that takes it runs on both kinds."""
    return str(request.param)


@pytest.fixture
def bank_path(tmp_path: Path) -> Path:
    """A directory where a bank may be created (not created yet)."""
    return tmp_path / "bank"


@pytest.fixture
def bank(bank_path: Path) -> Iterator[Bank]:
    """A fresh writable bank with `BLOCK_SIZE`-token blocks, closed after the test."""
    b = Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def attn_spec() -> ModelSpec:
    return attention_spec()


@pytest.fixture
def quant_spec() -> ModelSpec:
    return quantized_spec()


@pytest.fixture
def hyb_spec() -> ModelSpec:
    return hybrid_spec()


# -- the shared tier: real valkey-server processes ---------------------------------
FLEET_SECRET = "test-fleet-secret"


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Any]:
    """Three real valkey-server masters as one cluster, password-protected (session)."""
    from cas_bank.remote.local_cluster import LocalCluster

    with LocalCluster(3) as cluster:
        yield cluster


@pytest.fixture
def cluster(valkey_cluster: Any) -> Any:
    """The session's cluster, emptied, every node running."""
    for i, node in enumerate(valkey_cluster.nodes):
        if node.paused:
            valkey_cluster.resume(i)
    valkey_cluster.flushall()
    return valkey_cluster


def remote_config(url: str, **overrides: Any) -> BankConfig:
    """A test bank's config with the shared tier at `url` and short time-outs."""
    settings: dict[str, Any] = dict(
        block_size=BLOCK_SIZE,
        remote=url,
        remote_secret=FLEET_SECRET,
        remote_connect_timeout=0.2,
        remote_timeout=0.3,
        remote_retry_after=1.0,
    )
    settings.update(overrides)
    return BankConfig(**settings)
