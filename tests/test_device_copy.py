"""Restores on a device whose arrays a CPU pointer cannot fill (a GPU backend not known
to cas_bank, or CAS_BANK_FILL_COPY=1): the payloads are read into numpy staging buffers
and handed out as copies made by `mx.array` (`cas_bank.arrays.cpu_fillable`). Forced
here on the CPU with CAS_BANK_FILL_COPY=1: the same bit-exact restores, the fast file
reader still used."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.runtime import PrefixCache
from conftest import BLOCK_SIZE, attention_spec, layers_bits, prefix_layers
from runtime_helpers import random_tokens, temp_bank
from test_runtime_exact import VARIANTS, check_restored_prefill

from cas_bank import Bank, BankConfig, arrays
from cas_bank.arrays import FILL_COPY_ENV, cpu_fillable, mlx_backend
from cas_bank.blocks.store import Family
from cas_bank.restore import file_read
from cas_bank.restore.destinations import Destination


def test_only_known_backends_are_filled_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    if mlx_backend() == "cpu":  # the CI machines run MLX on the CPU
        assert cpu_fillable() and arrays.fill_stream() is None
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "gpu")  # a backend not known here
    assert not cpu_fillable()
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    assert cpu_fillable() and arrays.fill_stream() == mx.cpu  # made in unified memory
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "metal")
    assert cpu_fillable() and arrays.fill_stream() is None
    monkeypatch.setenv(FILL_COPY_ENV, "1")
    assert not cpu_fillable()
    monkeypatch.setenv(FILL_COPY_ENV, "0")
    assert cpu_fillable()


def _restore_next_turn(variant: str, seed: int) -> PrefixCache:
    """A 70-token prompt stored, then a 90-token one restored (64 tokens) and prefilled:
    bit-exact against the same passes and close to a straight prefill."""
    factory, _, options = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    a = random_tokens(rng, 70)
    b = [*a, *random_tokens(rng, 20)]
    with temp_bank(16, hot_bytes=0, file_min_bytes=0) as bank:
        pc = PrefixCache(bank, factory(), chunk_size=32, **options)
        assert check_restored_prefill(pc, a, b, "float32", chunk_size=32) == 64
    return pc


@pytest.mark.parametrize("variant", ["hybrid-fp32", "qwen3-kv8"])
def test_restores_through_the_copy_are_exact(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cas_bank.restore.payloads import PayloadReader

    monkeypatch.setenv(FILL_COPY_ENV, "1")
    handed_out: list[bool] = []  # each destination handed out: was it MLX's own memory?
    finish = Destination.finish
    monkeypatch.setattr(
        Destination, "finish", lambda self: handed_out.append(self.direct) or finish(self)
    )
    one_by_one: list[object] = []  # payloads read the slow way
    slow = PayloadReader._read
    monkeypatch.setattr(
        PayloadReader, "_read", lambda self, *a: one_by_one.append(a[0]) or slow(self, *a)
    )
    pc = _restore_next_turn(variant, seed=9)
    assert handed_out and not any(handed_out)  # every array came through the copy
    # and its payloads through the file reader's batch (the Python path reads a
    # hybrid's state on its own)
    alone = [] if file_read.fill_module is not None else [Family.STATES]
    assert one_by_one == (alone if pc.spec.is_hybrid else [])


@pytest.mark.parametrize("variant", ["qwen3-fp32", "hybrid-fp32"])
def test_cuda_restores_fill_arrays_made_on_the_cpu_stream(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (its backend named here; MLX itself runs on the CPU) every destination is
    MLX's own array, made by the CPU stream (in unified memory there), filled in place."""
    from cas_bank.restore import destinations

    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    streams: list[object] = []  # the stream each destination array was made on
    zeros, load = mx.zeros, mx.load

    def seen(k: dict[str, Any]) -> None:  # a call from cas_bank.restore.destinations
        if sys._getframe(2).f_globals["__name__"] == destinations.__name__:
            streams.append(k.get("stream"))

    def zeros_on(*a: Any, **k: Any) -> mx.array:
        seen(k)
        return zeros(*a, **k)

    def load_on(*a: Any, **k: Any) -> Any:
        seen(k)
        return load(*a, **k)

    monkeypatch.setattr(destinations.mx, "zeros", zeros_on)
    monkeypatch.setattr(destinations.mx, "load", load_on)
    made: list[Destination] = []
    init = Destination.__init__

    def init_seen(self: Destination, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Destination, "__init__", init_seen)
    _restore_next_turn(variant, seed=11)
    assert made and all(d.direct for d in made)  # MLX's own memory, no copy
    assert streams and all(s is not None and s == mx.cpu for s in streams)


def test_staged_restores_take_no_spare_mlx_arrays(
    bank_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spares are MLX memory a staged restore would not use: none taken or made."""
    spec = attention_spec(n_layers=2)
    tokens = list(range(64))
    layers = prefix_layers(spec, tokens)
    monkeypatch.setenv(FILL_COPY_ENV, "1")
    config = BankConfig(block_size=BLOCK_SIZE, hot_bytes=0, spare_bytes=16 << 20)
    with Bank.open(bank_path, config) as bank:
        spares = bank.resources.spares
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        for _ in range(2):
            hit = ns.restore(tokens)
            assert hit is not None and hit.tokens == 64
            assert layers_bits(hit.layers, spec) == layers_bits(layers, spec)
            bank.resources.settle()
        assert (spares.taken, spares.made, spares.bytes) == (0, 0, 0)


@pytest.mark.parametrize("name", ["Destination", "UNFILLED_FROM", "keep_freed_memory", "unfilled"])
def test_destinations_moved_from_arrays_still_import_with_a_warning(name: str) -> None:
    from cas_bank.restore import destinations

    with pytest.warns(DeprecationWarning, match=f"cas_bank.restore.destinations.{name}"):
        moved = getattr(arrays, name)
    assert moved is getattr(destinations, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = arrays.nothing_here  # type: ignore[attr-defined]
