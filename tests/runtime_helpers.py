"""Helpers for the runtime tests: real tiny mlx-lm models, banks in tmp dirs, and the
references a restored prefill is compared with (the same forward passes, no bank).

Models are built once per process (milliseconds each) and shared read-only.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from cas_bank.runtime import LoadedModel, PrefixCache, build_model
from cas_bank.runtime.models import model_config
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import _get_classes

from cas_bank import Bank, BankConfig
from cas_bank.arrays import mlx_backend

# Tolerances of a restored prefill against one straight forward pass.
ATOL = {"float32": 1e-4, "bfloat16": 6e-2}
if mlx_backend() == "cuda" and os.environ.get("MLX_ENABLE_TF32", "1") != "0":
    # MLX's CUDA backend multiplies float32 matrices in TF32 unless told not to, so a
    # chunked and a straight prefill differ by more than float32's rounding (measured on
    # an H200: 6.5e-4 at qwen3, over 2e-3 at qwen3_next). TF32 keeps 10 mantissa bits to
    # bfloat16's 7: bfloat16's tolerance over 8, rounded up. Restores stay bit-equal to
    # the same passes (`bit_equal`); only the comparisons with a straight prefill widen.
    ATOL["float32"] = 1e-2
DTYPES = {"float32": None, "bfloat16": mx.bfloat16}


@cache
def tiny(name: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    return build_model(name, seed=seed, dtype=DTYPES[dtype])


@cache
def wide(name: str, seed: int = 0) -> nn.Module:
    """A tiny model with head_dim 32, so its KV can be quantized (mlx groups of >= 32).

    Built from the embedded config with one change, as a bare mlx-lm module: this
    also exercises PrefixCache on a model that is not a LoadedModel.
    """
    config = model_config(name)
    config["head_dim"] = 32
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.eval()
    mx.eval(model.parameters())
    return model


@contextmanager
def temp_bank(block_size: int = 16, **settings: Any) -> Iterator[Bank]:
    with TemporaryDirectory(prefix="cas_bank_rt_") as d:
        bank = Bank.open(Path(d) / "bank", BankConfig(block_size=block_size, **settings))
        try:
            yield bank
        finally:
            bank.close()


def module_of(model: nn.Module | LoadedModel) -> nn.Module:
    return model.model if isinstance(model, LoadedModel) else model


def forward(
    pc: PrefixCache, cache: list[Any], tokens: Sequence[int], start: int, ends: Sequence[int]
) -> mx.array:
    """Run tokens[start:] through `cache` ending a forward pass at each of `ends`."""
    logits = None
    pos = start
    for end in ends:
        if end <= pos:
            continue
        logits = pc.model(mx.array(list(tokens[pos:end]))[None], cache=cache)
        mx.eval([c.state for c in cache])
        pos = end
    assert logits is not None and pos == len(tokens)
    return logits[0, -1]


def replay_cache(
    pc: PrefixCache, stored: Sequence[int], stored_ends: Sequence[int], n: int
) -> list[Any]:
    """A cache holding stored[:n] computed by the forward passes of the prefill that
    stored `stored` (ending at `stored_ends`), without the bank. An attention-only
    cache is trimmed back to n; a recurrent state cannot be, so n must then be one of
    the ends."""
    cache = pc.new_cache()
    pos = 0
    for end in stored_ends:
        if pos >= n:
            break
        pc.model(mx.array(list(stored[pos:end]))[None], cache=cache)
        mx.eval([c.state for c in cache])
        pos = end
    assert pos >= n, "the stored prefill did not reach the restore point"
    if pos > n:
        assert not any(isinstance(c, ArraysCache) for c in cache), "no state at the restore point"
        for c in cache:
            c.trim(pos - n)
    return cache


def same_schedule_logits(
    pc: PrefixCache,
    stored: Sequence[int],
    stored_ends: Sequence[int],
    tokens: Sequence[int],
    n: int,
    ends: Sequence[int],
) -> mx.array:
    """Logits of `tokens` computed with the very forward passes of store + restore:
    the prefill of `stored` (ends `stored_ends`) up to n, then `ends` over `tokens`
    (which shares stored[:n])."""
    assert list(stored[:n]) == list(tokens[:n])
    cache = replay_cache(pc, stored, stored_ends, n)
    return forward(pc, cache, tokens, n, ends)


def straight_logits(pc: PrefixCache, tokens: Sequence[int]) -> mx.array:
    """Logits of one forward pass over all of `tokens`."""
    return forward(pc, pc.new_cache(), tokens, 0, [len(tokens)])


def bit_equal(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


def close(a: mx.array, b: mx.array, dtype: str) -> bool:
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    return bool(diff <= ATOL[dtype])


def metric(text: str, name: str) -> float:
    """The one sample of the unlabelled metric `name` in a server's /metrics text."""
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{len(values)} samples of {name} in:\n{text[-2000:]}"
    return float(values[0])


def random_tokens(rng: np.random.Generator, n: int, vocab: int = 512) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def stop_process(proc: subprocess.Popen[str]) -> int:
    """SIGTERM a server subprocess (SIGKILL after 30 s), close its stdout, return its code.
    One that outlives the SIGTERM is first asked for its threads' stacks (SIGUSR1: the
    servers print them to stderr, so the test's log says where it hung)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
            proc.kill()
            proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()
    return int(proc.returncode)
