"""Bad input to the library API of issue 2: each a clear error naming the problem, and
nothing stored changes.

Real RocksDB under tmp_path and real MLX arrays. KV comes from `prefix_layers`, which
makes the vector at position t depend only on tokens[: t + 1] (as a model's does),
so every restore is checked bit for bit against the prompt's own KV.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    prefix_layers,
    random_state,
    snapshot,
    tokens_of,
)

from cas_bank import (
    Bank,
    BankConfig,
    BankSettingsError,
    InvalidInputError,
    ModelSpec,
)
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family

B = BLOCK_SIZE


# -- bad input: a clear error, nothing stored changes -----------------------------
@pytest.fixture
def seeded(bank: Bank) -> Bank:
    """A bank holding a few blocks in the attention and hybrid namespaces."""
    tokens = tokens_of(np.random.default_rng(11), 2 * B)
    for spec in (attention_spec(), hybrid_spec()):
        states = {B: random_state(spec)} if spec.is_hybrid else None
        bank.namespace(spec).store(tokens, prefix_layers(spec, tokens), states)
    return bank


BAD_TOKENS = [
    ([1, 2, -1, 4], "token id -1 is outside [0, 2**32)"),
    ([1, 2, 2**32, 4], "token id 4294967296 is outside [0, 2**32)"),
    ([1.0, 2.0, 3.0, 4.0], "token ids must be ints; got float 1.0"),
    ("hello world!", "tokens must be a sequence of int ids, not a string"),
    ([[1, 2], [3, 4]], "token ids must be ints; got list [1, 2]"),
    (np.zeros((2, 4), dtype=np.int64), "tokens must be 1-D (or [1, T]); got shape (2, 4)"),
    (np.zeros(4, dtype=np.float32), "token ids must be integers; got dtype float32"),
]


@pytest.mark.parametrize(("tokens", "message"), BAD_TOKENS)
@pytest.mark.parametrize("call", ["store", "match", "restore"])
def test_bad_tokens(seeded: Bank, tokens: Any, message: str, call: str) -> None:
    spec = attention_spec()
    ns = seeded.namespace(spec)
    before, stats = snapshot(seeded), seeded.stats()
    with pytest.raises(InvalidInputError) as err:
        if call == "store":
            ns.store(tokens, prefix_layers(spec, [0] * 4))
        else:
            getattr(ns, call)(tokens)
    assert message in str(err.value)
    assert snapshot(seeded) == before and seeded.stats() == stats


def _bad_layers(spec: ModelSpec, n: int) -> dict[str, tuple[list[Any], str]]:
    good = prefix_layers(spec, [5] * n)
    k, v = good[1]
    k32 = k.astype(mx.float32)
    return {
        "dtype": (
            [good[0], (k32, v)],
            "layer 1 array 0: dtype mlx.core.float32 but the spec says float16",
        ),
        "heads": (
            [good[0], (mx.zeros((1, 3, n, 8), mx.float16), v)],
            "layer 1 array 0: shape (1, 3, 8, 8) but the spec says (1, 2, 8, 8)",
        ),
        "ndim": ([(k[0], v), good[1]], "layer 0 array 0: got (2, 8, 8), spec (1, 2, 8)"),
        "short": (
            [good[0], (k[..., : n - 1, :], v[..., : n - 1, :])],
            "layer 1 array 0 holds 7 tokens, fewer than the 8 given",
        ),
        "widths": (
            [good[0], (k, mx.concatenate([v, v], axis=2))],
            "layer 1: arrays disagree on the token axis",
        ),
        "count": (good[:1], "1 layers given but the spec of 'tiny-attn' has 2"),
        "missing": ([good[0], None], "layer 1 is an attention layer but None was given"),
        "arity": ([good[0], (k,)], "layer 1: 1 arrays given, the spec expects 2"),
        "numpy": ([good[0], (np.array(k), v)], "layer 1 array 0: got (1, 2, 8, 8), spec (1, 2, 8)"),
    }


@pytest.mark.parametrize(
    "case", ["dtype", "heads", "ndim", "short", "widths", "count", "missing", "arity", "numpy"]
)
def test_bad_layers_name_the_layer(seeded: Bank, case: str) -> None:
    spec = attention_spec()
    layers, message = _bad_layers(spec, 2 * B)[case]
    before, stats = snapshot(seeded), seeded.stats()
    with pytest.raises(InvalidInputError) as err:
        seeded.namespace(spec).store([5] * (2 * B), layers)
    assert message in str(err.value)
    assert snapshot(seeded) == before and seeded.stats() == stats


def test_bad_hybrid_layers_and_states(seeded: Bank) -> None:
    spec = hybrid_spec()
    ns = seeded.namespace(spec)
    tokens = tokens_of(np.random.default_rng(12), 3 * B)
    layers = prefix_layers(spec, tokens)
    state = random_state(spec)
    wrong_state = list(state)
    wrong_state[2] = (state[2][0], state[2][1].astype(mx.float16))
    cases: list[tuple[list[Any], dict[Any, Any] | None, str]] = [
        ([layers[1], *layers[1:]], None, "layer 0 is recurrent: pass None in layers"),
        (layers, {B + 1: state}, f"state at {B + 1} is not at a block boundary"),
        (layers, {0: state}, f"state at 0 is not at a block boundary (a positive multiple of {B})"),
        (layers, {-B: state}, f"state at {-B} is not at a block boundary"),
        (layers, {4 * B: state}, f"state at {4 * B} is beyond the {3 * B} tokens given"),
        (layers, {"4": state}, "state boundary '4' is not an int"),
        (layers, {B: state[:3]}, f"state at {B}: 3 entries but the spec has 4 layers"),
        (layers, {B: [None, *state[1:]]}, f"state at {B}: layer 0 needs 2 state arrays, got None"),
        (
            layers,
            {B: wrong_state},
            f"state at {B}: layer 2 array 1: dtype mlx.core.float16 but the spec says float32",
        ),
        (layers, {B: [state[0], state[0], *state[2:]]}, f"state at {B}: layer 1 is attention"),
    ]
    for bad_layers, bad_states, message in cases:
        before, stats = snapshot(seeded), seeded.stats()
        with pytest.raises(InvalidInputError) as err:
            ns.store(tokens, bad_layers, bad_states)
        assert message in str(err.value), (message, str(err.value))
        assert snapshot(seeded) == before and seeded.stats() == stats


def test_states_on_a_model_without_recurrent_layers(seeded: Bank) -> None:
    spec = attention_spec()
    tokens = [3] * (2 * B)
    before = snapshot(seeded)
    with pytest.raises(InvalidInputError, match="states given but 'tiny-attn' has no recurrent"):
        seeded.namespace(spec).store(tokens, prefix_layers(spec, tokens), {B: [None, None]})
    assert snapshot(seeded) == before


def test_reopen_with_another_block_size(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        tokens = [1] * (2 * B)
        bank.namespace(attention_spec()).store(tokens, prefix_layers(attention_spec(), tokens))
        before = snapshot(bank)
    with pytest.raises(BankSettingsError) as err:
        Bank.open(bank_path, BankConfig(block_size=2 * B))
    assert (
        f"bank at {bank_path} was created with block_size={B}; it cannot be opened with "
        f"block_size={2 * B}"
    ) in str(err.value)
    with Bank.open(bank_path) as bank:  # block_size left unset: taken from the bank
        assert bank.config.block_size == B
        assert snapshot(bank) == before


@pytest.mark.parametrize("key", [b"format_version", b"hash_format_version"])
def test_reopen_a_newer_format(bank_path: Path, key: bytes) -> None:
    Bank.open(bank_path, BankConfig(block_size=B)).close()
    with RocksStore(bank_path) as raw:
        raw.put_batch([(Family.META, key, struct.pack("<I", 6 if key == b"format_version" else 2))])
        before = {f: list(raw.iterate(f)) for f in Family}
    with pytest.raises(BankSettingsError) as err:
        Bank.open(bank_path)
    if key == b"format_version":
        assert f"bank at {bank_path} has format version 6; this cas_bank reads up to 5" in str(
            err.value
        )
    else:
        assert f"bank at {bank_path} uses hash format 2, this build 1" in str(err.value)
    with RocksStore(bank_path) as raw:  # the failed open released the lock, changed nothing
        assert {f: list(raw.iterate(f)) for f in Family} == before


def test_a_reader_needs_a_bank(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no bank at"):
        Bank.open(tmp_path / "none", mode="read_only")
    RocksStore(tmp_path / "empty").close()  # a RocksDB directory that is not a bank
    with pytest.raises(BankSettingsError, match="holds no cas_bank bank"):
        Bank.open(tmp_path / "empty", mode="read_only")


def test_open_reads_a_home_path_and_refuses_an_unknown_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with Bank.open("~/banks/one"):
        pass
    assert (tmp_path / "banks" / "one" / "CURRENT").exists()
    assert not (tmp_path / "~").exists()  # not a folder named "~" here
    with pytest.raises(InvalidInputError, match="mode 'rw'"):
        Bank.open(tmp_path / "banks" / "one", mode="rw")  # type: ignore[arg-type]


def test_bfloat16_token_ids_are_refused_by_name(tmp_path: Path) -> None:
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(attention_spec())
        with pytest.raises(InvalidInputError, match="integers"):
            ns.match(mx.array([1, 2, 3], dtype=mx.bfloat16))
