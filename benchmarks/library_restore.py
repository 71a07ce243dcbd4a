"""A library caller's restore against mlx-lm's prompt-cache file: no process settings.

`benchmarks.restore` runs as the servers do (`keep_freed_memory`, the bank held open
between restores). A library caller opens a bank and restores, and gets only what the
`Bank` itself owns. This measures, in one process with none of the servers' settings
(unless `--server-settings`), per round and in an order rotated each round:

- the file: `load_prompt_cache` of what `save_prompt_cache` wrote, evaluated;
- a restore after a reopen: `Bank.open` of the stored bank, `PrefixCache.restore`,
  evaluated (the open itself not timed, nor the wait for the bank's start-up work: the
  spares its last session ended with, made from the open on, as a runtime's are while
  it starts; `--at-once`: no wait, the restore made right after the `PrefixCache`);
- the hot one: a second `PrefixCache.restore` of the same prompt on that bank.

Between the two restores, the bank's background work is let finish (`settle`, as a
forward pass would give it time). Each figure is the median of the per-round ratios
file time / restore time (> 1: the restore is faster than the file), printed side by
side. Layouts: the medium models' caches at 1k and 4k tokens, and `fp32-100mb`
(6 layers x 4 KV heads x 128 head dim, float32, 4096 tokens: 100 MB). Each layout is
measured in a process of its own (spawned): the file's load allocates its arrays
afresh, and how fast depends on the heap the layouts before left: medium-qwen3 1k
took 10.2 ms after fp32-100mb in the same process, 3.2 ms alone (the bank 2.5-2.6
both times), which flattered the bank.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache, build_model
from cas_bank.runtime.models import LoadedModel, model_config, weights_digest
from cas_bank.runtime.process import server_settings
from cas_bank.runtime.tokenizer import ByteTokenizer
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.utils import _get_classes

from benchmarks.restore import synthetic_cache
from benchmarks.ttft import eval_cache, kv_bytes
from cas_bank import Bank, BankConfig

LAYOUTS = ("fp32-100mb", "medium-qwen3:1024", "medium-qwen3:4096", "medium-hybrid:4096")


def _fp32_100mb() -> LoadedModel:
    """A qwen3 of 6 layers, 4 KV heads of 128, float32: 100 MB of KV at 4096 tokens."""
    config = model_config("medium-qwen3")
    config.update(num_hidden_layers=6, num_key_value_heads=4, num_attention_heads=8)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.eval()
    mx.eval(model.parameters())
    return LoadedModel(
        model, config, "fp32-100mb", ByteTokenizer(vocab_size=32000), weights_digest(model)
    )


def _prepare(layout: str, workdir: Path) -> tuple[LoadedModel, np.ndarray, Path, Path, int]:
    """The layout's model, a prompt, the bank holding its synthetic cache and the file."""
    name, _, length_s = layout.partition(":")
    length = int(length_s or 4096)
    lm = _fp32_100mb() if name == "fp32-100mb" else build_model(name)
    rng = np.random.default_rng(length)
    prompt = rng.integers(0, 256, length + 1).astype(np.uint32)
    path, file = workdir / f"bank-{layout}", workdir / f"{layout}.safetensors"
    with Bank.open(path, BankConfig(write_behind=0)) as bank:
        pc = PrefixCache(bank, lm)
        cache, states = synthetic_cache(pc, length, rng)
        pc.store(prompt[:-1], cache, states, end=False)
        save_prompt_cache(str(file), cache)
    return lm, prompt, path, file, kv_bytes(cache)


def measure(layout: str, rounds: int, workdir: Path, *, at_once: bool = False) -> dict[str, Any]:
    lm, prompt, path, file, nbytes = _prepare(layout, workdir)
    length = len(prompt) - 1

    def file_way() -> dict[str, float]:
        t0 = time.perf_counter()
        eval_cache(load_prompt_cache(str(file)))
        return {"file": time.perf_counter() - t0}

    def bank_way() -> dict[str, float]:
        out = {}
        with Bank.open(path) as bank:
            pc = PrefixCache(bank, lm)
            for way in ("reopened", "hot"):
                if way == "hot" or not at_once:
                    bank.resources.settle()  # as a forward pass (or a model's load) gives it time
                t0 = time.perf_counter()
                restored, n = pc.restore(prompt)
                eval_cache(restored)
                out[way] = time.perf_counter() - t0
                if n != length:
                    raise RuntimeError(f"{layout}: restored {n} of {length} tokens")
                del restored
        return out

    ways: list[Callable[[], dict[str, float]]] = [file_way, bank_way]
    samples: dict[str, list[float]] = {"file": [], "reopened": [], "hot": []}
    for r in range(rounds + 1):  # round 0 warms up, uncounted
        got: dict[str, float] = {}
        for way in ways[r % 2 :] + ways[: r % 2]:
            got |= way()
        if r:
            for k, v in got.items():
                samples[k].append(v)
    ratios = {
        w: [f / t for f, t in zip(samples["file"], samples[w], strict=True)]
        for w in ("reopened", "hot")
    }
    return {
        "layout": layout,
        "mb": round(nbytes / 1e6, 1),
        "file_ms": 1e3 * statistics.median(samples["file"]),
        "reopened_ms": 1e3 * statistics.median(samples["reopened"]),
        "hot_ms": 1e3 * statistics.median(samples["hot"]),
        "reopened_x": statistics.median(ratios["reopened"]),
        "hot_x": statistics.median(ratios["hot"]),
        "reopened_x_range": (min(ratios["reopened"]), max(ratios["reopened"])),
        "hot_x_range": (min(ratios["hot"]), max(ratios["hot"])),
    }


def _measured_alone(
    layout: str, rounds: int, workdir: Path, at_once: bool, server: bool
) -> dict[str, Any]:
    """`measure` in a new process (spawned: nothing of this one's heap or MLX state)."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as child:
        return child.submit(_measure_here, layout, rounds, workdir, at_once, server).result()


def _measure_here(
    layout: str, rounds: int, workdir: Path, at_once: bool, server: bool
) -> dict[str, Any]:
    if server:
        server_settings()
    return measure(layout, rounds, workdir, at_once=at_once)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Print the ratios file / restore of each layout (medians of the rounds)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.library_restore", description=main.__doc__
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--server-settings", action="store_true", help="as `cas-bank serve` runs")
    p.add_argument("--at-once", action="store_true", help="restore right after the open (no wait)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cas_bank_library_") as tmp:
        for layout in args.layouts.split(","):
            row = _measured_alone(
                layout, args.rounds, Path(tmp), args.at_once, args.server_settings
            )
            rows.append(row)
            print(
                f"{row['layout']:>20} {row['mb']:6.1f} MB  file {row['file_ms']:7.1f} ms  "
                f"reopened {row['reopened_ms']:7.1f} ms {row['reopened_x']:.2f}x "
                f"[{row['reopened_x_range'][0]:.2f}-{row['reopened_x_range'][1]:.2f}]  "
                f"hot {row['hot_ms']:7.1f} ms {row['hot_x']:.2f}x "
                f"[{row['hot_x_range'][0]:.2f}-{row['hot_x_range'][1]:.2f}]",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
