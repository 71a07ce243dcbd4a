"""Where prefilling beats restoring: per layout, the shortest stored prefix whose
restore is faster than prefilling it, here and (estimated) on Apple silicon.

On this machine, per layout: a cold prefill of `lengths` tokens (the model alone, in
mlx-lm's chunks: `benchmarks.ttft.cold_prefill`), and the restore of a stored prefix of
as many tokens with library defaults, from a bank opened again before each restore
(page cache warm) and again in the same process (hot); beside them the restores the
first-token cases measured at their lengths (`benchmarks.first_token`: after a
restart, and with room in the same process). Two lines fitted by least squares,
prefill(L) = a_p + b_p L and restore(L) = a_r + b_r L (reopened), give the crossover
here, L* = (a_r - a_p) / (b_p - b_r); a prefill line from short prompts leaves out
attention's growth with the context, so it bounds a long prefill from below.

On Apple silicon, an estimate: the prefill rates MLX's maintainers published for
mlx-lm (`PUBLISHED_PREFILL`, tokens per second of a prompt; the sources are named
there), against this machine's restore line (Apple silicon's memory is faster than
this machine's, so its restores should be no slower: the estimate leans towards
prefilling). L* = a_r / (1/R - b_r) for a rate R; a rate above 1/b_r would prefill
faster than the bank restores at every length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from cas_bank.runtime import LoadedModel, PrefixCache

from benchmarks.ceilings import median
from benchmarks.restore import synthetic_cache
from benchmarks.ttft import cold_prefill, eval_cache, kv_bytes
from cas_bank import Bank

# mlx-lm's prompt processing (prefill) rates on Apple silicon, as published by MLX's
# maintainers: tokens per second of a prompt of `prompt` tokens.
_PR406 = "ml-explore/mlx-lm pull request #406 (2025-08-28, after the change)"
PUBLISHED_PREFILL = tuple(
    MappingProxyType(p)
    for p in (
        {"model": "Gemma3 270M", "chip": "M4 Max", "prompt": 2048, "tokens_per_s": 28079.6,
         "source": _PR406},
        {"model": "Qwen3 0.6B 4-bit", "chip": "M4 Max", "prompt": 2048,
         "tokens_per_s": 10278.8, "source": _PR406},
        {"model": "Qwen3 30B-A3B 4-bit", "chip": "M4 Max", "prompt": 2048,
         "tokens_per_s": 1732.0, "source": _PR406},
        {"model": "Mistral 7B 4-bit", "chip": "M2 Ultra", "prompt": 33898,
         "tokens_per_s": 869.3, "source": "ml-explore/mlx-lm pull request #40 (2025-03-20)"},
    )
)  # fmt: skip
RESTORE_REPEATS = 5


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points, neither
    below zero (no time is negative, and none falls with the length: noise on two
    cores draws such lines through a few points): through the origin where the
    intercept would be negative, flat where the slope would."""
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    if len(points) > 1:
        slope, intercept = (float(v) for v in np.polyfit(xs, ys, 1))
        if intercept >= 0 and slope >= 0:
            return intercept, slope
        if slope < 0:
            return float(ys.mean()), 0.0
    return 0.0, float((xs * ys).sum() / (xs * xs).sum())


def _stored(
    lm: LoadedModel, lengths: Sequence[int], path: Path
) -> tuple[dict[int, np.ndarray], tuple[int, int]]:
    """A bank at `path` holding a prefix of each length (random KV); each prompt is its
    prefix and one token more. Also the longest prefix's tokens and KV bytes."""
    prompts, longest = {}, (0, 0)
    with Bank.open(path) as bank:
        pc = PrefixCache(bank, lm)
        for n in lengths:
            rng = np.random.default_rng(1000 + n)
            prompts[n] = rng.integers(0, 256, n + 1).astype(np.uint32)
            cache, states = synthetic_cache(pc, n, rng)
            pc.store(prompts[n][:-1], cache, states)
            longest = max(longest, (n, kv_bytes(cache)))
    return prompts, longest


def _restores(lm: LoadedModel, path: Path, prompt: np.ndarray) -> tuple[float, float]:
    """Medians of a restore right after opening the bank (the open untimed) and of the
    same restore again in that process."""
    reopened, hot = [], []
    for _ in range(RESTORE_REPEATS):
        with Bank.open(path) as bank:
            pc = PrefixCache(bank, lm)
            for times in (reopened, hot):
                bank.resources.settle()
                t0 = time.perf_counter()
                cache, n = pc.restore(prompt)
                eval_cache(cache)
                times.append(time.perf_counter() - t0)
                if n != len(prompt) - 1:
                    raise RuntimeError(f"restored {n} of {len(prompt) - 1} tokens")
                del cache
    return median(reopened), median(hot)


def measure(
    lm: LoadedModel, lengths: Sequence[int], cases: Sequence[dict[str, Any]], workdir: Path
) -> dict[str, Any]:
    """One layout: prefill and restores at `lengths`, the first-token cases' restores at
    theirs, the fitted lines and the crossovers."""
    workdir.mkdir(parents=True, exist_ok=True)
    prompts, longest = _stored(lm, lengths, workdir / "bank")
    cold_prefill(lm.model, prompts[min(lengths)][:8])  # warm-up: first-call costs
    points = []
    for n in lengths:
        t0 = time.perf_counter()
        cold_prefill(lm.model, prompts[n][:-1])
        prefill = time.perf_counter() - t0
        reopened, hot = _restores(lm, workdir / "bank", prompts[n])
        points.append({"tokens": n, "prefill_s": prefill, "reopened_s": reopened, "hot_s": hot})
    for c in cases:
        points.append(
            {
                "tokens": c["tokens"],
                "prefill_s": None,
                "reopened_s": c["after_restart"]["bank_reopened"]["restore_s"],
                "hot_s": c["shared_prefix"]["bank"]["restore_s"],
            }
        )
    points.sort(key=lambda p: p["tokens"])
    return {
        "model": lm.name,
        "kv_bytes_per_token": _kv_per_token(cases, longest),
        "points": points,
        **crossover(points),
    }


def _kv_per_token(cases: Sequence[dict[str, Any]], stored: tuple[int, int]) -> float:
    """KV bytes per token of the layout: of its longest case, else of the longest
    prefix stored here (`stored`: tokens, bytes)."""
    if cases:
        c = max(cases, key=lambda c: c["tokens"])
        return float(c["kv_bytes"] / c["tokens"])
    return stored[1] / stored[0]


def crossover(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shortest measured prefix whose restore (reopened) beats its prefill, the
    fitted lines, the crossover here, and the estimate per published rate."""
    prefilled = [(p["tokens"], p["prefill_s"]) for p in points if p["prefill_s"] is not None]
    restored = [(p["tokens"], p["reopened_s"]) for p in points]
    a_p, b_p = _line(prefilled)
    a_r, b_r = _line(restored)
    both = [p for p in points if p["prefill_s"] is not None]
    faster = [p["tokens"] for p in both if p["reopened_s"] < p["prefill_s"]]
    slower = [p["tokens"] for p in both if p["reopened_s"] >= p["prefill_s"]]
    # Where the lines cross; None: prefilling is faster at every length.
    here = max(0.0, (a_r - a_p) / (b_p - b_r)) if b_p > b_r else (0.0 if a_r < a_p else None)
    apple = []
    for pub in PUBLISHED_PREFILL:
        per_token = 1.0 / pub["tokens_per_s"]
        apple.append(
            {
                "model": pub["model"],
                "chip": pub["chip"],
                "tokens_per_s": pub["tokens_per_s"],
                "crossover_tokens": a_r / (per_token - b_r) if per_token > b_r else None,
            }
        )
    return {
        "prefill_line": {"intercept_s": a_p, "per_token_s": b_p},
        "restore_line": {"intercept_s": a_r, "per_token_s": b_r},
        "shortest_measured_faster": min(faster) if faster else None,
        "longest_measured_slower": max(slower) if slower else None,
        "crossover_here_tokens": here,
        "restore_beaten_above_tokens_per_s": 1.0 / b_r if b_r > 0 else None,
        "apple_estimate": apple,
    }


def prefill_estimate(layout: dict[str, Any], tokens: int) -> float:
    """A cold prefill of `tokens` on this machine from the layout's prefill line (short
    prompts: attention's growth with the context left out, so at least this)."""
    line = layout["prefill_line"]
    return float(line["intercept_s"] + line["per_token_s"] * tokens)
