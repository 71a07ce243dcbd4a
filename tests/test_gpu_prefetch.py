"""On MLX's CUDA build a restore moves the arrays it filled from the CPU (unified
memory) to the GPU before handing them out (`cas_bank.restore.resources`, the bank's
`GpuPrefetch` in its `Resources`: a failure turns it off for that bank). Here MLX runs on
the CPU: the backend is named CUDA where a test needs it, and what the prefetch is
asked to move is checked against the arrays the restore hands out; the driver calls
themselves run on a GPU machine (benchmarks/RESULTS.md, "MLX's CUDA build")."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, attention_spec, layers_bits, prefix_layers

from cas_bank import Bank, BankConfig, arrays
from cas_bank.arrays import address_of, to_numpy
from cas_bank.restore import resources
from cas_bank.restore.resources import GpuPrefetch


@pytest.fixture(autouse=True)
def _fresh_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    resources._driver.cache_clear()
    monkeypatch.delenv(resources.PREFETCH_ENV, raising=False)


def test_prefetch_applies_on_cuda_only_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = GpuPrefetch()
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cpu")
    assert gpu.prefetcher() is None
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "metal")
    assert gpu.prefetcher() is None  # unified memory: nothing to move
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    assert gpu.prefetcher() == gpu.prefetch
    monkeypatch.setenv(resources.PREFETCH_ENV, "0")
    assert gpu.prefetcher() is None


def test_a_cuda_restore_moves_every_array_it_filled(
    bank_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every array handed out (with its room) is asked for whole, once, after its fill:
    the bytes the prefetch was given are the restored prefix."""
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    asked: list[list[tuple[int, int]]] = []
    spec = attention_spec(n_layers=2)
    tokens = list(range(3 * BLOCK_SIZE))
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, hot_bytes=0)) as bank:
        monkeypatch.setattr(bank.resources.gpu, "prefetch", asked.append)
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        hit = ns.restore(tokens, room_for=len(tokens) + 5)
    assert hit is not None and hit.tokens == len(tokens)
    handed = [to_numpy(a) for layer in hit.layers if layer is not None for a in layer]
    assert len(asked) == 1
    assert sorted(asked[0]) == sorted((address_of(v), v.nbytes) for v in handed)
    prefix = [tuple(a[..., : len(tokens), :] for a in layer) for layer in hit.layers]
    assert layers_bits(prefix, spec) == layers_bits(layers, spec)  # moved: the prefix


def test_no_cuda_driver_logs_once_and_moves_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(resources.ctypes, "CDLL", no_library)
    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    gpu = GpuPrefetch()
    with caplog.at_level(logging.WARNING, logger="cas_bank"):
        gpu.prefetch([(4096, 4096)])
        assert gpu.prefetcher() is None  # restores no longer ask
        gpu.prefetch([(4096, 4096)])
        GpuPrefetch().prefetch([(4096, 4096)])  # another bank's: the driver tried once
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no CUDA prefetch" in said[0] and "libcuda.so.1" in said[0]


def test_a_failed_prefetch_turns_it_off_for_its_bank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver call that fails (no managed memory: MLX used pinned host memory) is
    logged once; that bank's restores go on without it, another bank's still ask."""

    class Refusing:
        calls = 0

        def prefetch(self, runs: object) -> None:
            Refusing.calls += 1
            raise OSError("cuMemPrefetchAsync returned CUDA error 1")

    monkeypatch.setattr(arrays, "mlx_backend", lambda: "cuda")
    monkeypatch.setattr(resources, "_driver", lambda: Refusing())
    gpu = GpuPrefetch()
    with caplog.at_level(logging.WARNING, logger="cas_bank"):
        gpu.prefetch([(4096, 4096)])
        assert gpu.prefetcher() is None
        gpu.prefetch([(4096, 4096)])
    assert Refusing.calls == 1
    assert GpuPrefetch().prefetcher() is not None  # the failure was this one's
    assert [r.getMessage() for r in caplog.records] == [
        "cas_bank: CUDA prefetch of restored arrays turned off: "
        "cuMemPrefetchAsync returned CUDA error 1"
    ]
