"""Restore alone at the medium models' sizes, with synthetic KV: no prefill needed.

The TTFT benchmark runs real prefills, so by default it uses the tiny models, whose
caches are a few MB: there a restore's fixed costs (Python, MLX allocations, one
RocksDB get per block) weigh more than its bytes. Real models move tens to hundreds
of MB. This measures the same three reuse paths at those sizes, on the medium
models' real cache layouts (from `PrefixCache`'s probe of the model), filled with
random arrays of the right shapes and dtypes:

- mlx-lm file: `save_prompt_cache` of the cache, then `load_prompt_cache` + evaluation;
- cas_bank from RocksDB after a reopen: `PrefixCache.restore` + evaluation, once the
  bank's start-up work is done (`settle`: the spares its last session ended with, made
  ahead from the open on, as a server's are before its first request; the
  open and that wait untimed; `benchmarks.library_restore --at-once` measures a restore
  made at once after the open);
- cas_bank from the hot tier: the same again in the same process, the lease copied
  ahead by the spares' thread after the restore before (`restore.lease_copy`), and
  with the copy on the restore's path (copies ahead off), as a lease's first two
  restores go;

beside the floors on the same bytes: the bank's payload files read on both cores as a
plain copy (what the file load does) and verified by the native reader (one copy and
one pass of their XXH3-128 check over both cores: a verified restore cannot go
faster; the same files re-digested with blake3 give the floor of a bank made before
format version 4), and memcpy for the hot tier; and where a reopened restore's own
time goes (`Hit.timings`: the index lookup, allocating its destination arrays,
reading and verifying the payloads into them). Time to first token (TTFT) adds the
first prefill token; its floor is that forward pass alone, on a cache already in
memory with room.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache, build_model
from cas_bank.runtime.cache_io import fill_cache
from cas_bank.runtime.process import freeze_startup_objects, server_settings
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from benchmarks.ceilings import (
    median,
    profile_top,
)
from benchmarks.restore_figures import case_figures
from benchmarks.restore_floors import (
    case_floors,
    first_token,
    hot_copy_floor,
    reopened_stages,
    store_later_samples,
)
from benchmarks.ttft import eval_cache, kv_bytes
from cas_bank import Bank, BankConfig
from cas_bank.arrays import dtype_named


@dataclass(frozen=True)
class RestoreSettings:
    models: tuple[str, ...] = ("medium-qwen3", "medium-hybrid")
    lengths: tuple[int, ...] = (1024, 4096)
    repeats: int = 15  # the forward pass's spread on this host: 7 left medians 10% apart
    block_size: int = 64


def _random(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> mx.array:
    a = mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype_named(dtype).mx_dtype)
    mx.eval(a)
    return a


def synthetic_cache(
    pc: PrefixCache, n: int, rng: np.random.Generator
) -> tuple[list[Any], dict[int, Any]]:
    """A cache of `pc`'s model holding `n` tokens of random KV (and random recurrent
    states), and the states at boundary `n` as `PrefixCache.store` takes them."""
    cache = pc.new_cache()
    state: list[Any] = []
    for entry, ls in zip(cache, pc.spec.layers, strict=True):
        arrays = [
            _random(a.with_tokens(n) if ls.kind == "attention" else a.shape, a.dtype, rng)
            for a in ls.arrays
        ]
        if ls.kind == "attention":
            if ls.quantization is not None:
                raise ValueError("synthetic caches are for plain KV only")
            entry.keys, entry.values = arrays
            entry.offset = n
            state.append(None)
        else:
            entry.cache = list(arrays)
            state.append(tuple(arrays))
    return cache, ({n: state} if pc.spec.is_hybrid else {})


def _first_update(cache: list[Any]) -> None:
    """What the first prefill chunk does to the KV cache alone, without the model: one
    token appended to every attention layer (mlx-lm's `update_and_fetch`), evaluated.
    A cache whose arrays hold exactly the prefix copies it whole here; one with room
    writes in place."""
    out: list[Any] = []
    for entry in cache:
        keys = getattr(entry, "keys", None)
        if keys is None:
            continue
        one = mx.zeros((*keys.shape[:-2], 1, keys.shape[-1]), dtype=keys.dtype)
        out += entry.update_and_fetch(one, one)
    mx.eval(out)


def _then(pc: PrefixCache, cache: list[Any], token: int, then: str | None) -> None:
    """After a restore (or load): nothing, the first prefill token, or the first update."""
    if then == "token":
        first_token(pc, cache, token)
    elif then == "update":
        _first_update(cache)


@dataclass
class RestoreCase:
    """One model and length, stored: the bank at `path` (closed), the file mlx-lm saved,
    and the hot bank (the process that stored it, kept open, on a copy of the bank)."""

    name: str
    length: int
    lm: Any
    prompt: np.ndarray
    path: Path
    file: Path
    keys: list[bytes]
    hybrid: bool
    nbytes: int
    store_s: float
    hot_bank: Bank
    hpc: PrefixCache
    later: list[tuple[float, float]]

    @property
    def last(self) -> int:
        return int(self.prompt[-1])


def measure(name: str, length: int, s: RestoreSettings, workdir: Path) -> dict[str, Any]:
    """File load, reopened-bank restore and hot restore of `length` tokens of `name`'s
    cache, interleaved (one of each per round, medians), alone, with the first
    prefill token (time to first token) and with the first cache update alone."""
    case = _prepare(name, length, s, workdir)
    lm = case.lm
    freeze_startup_objects()  # as the servers run: no full collection over the model
    try:
        m, hot_hits = _timed(_ways(case, s), case, s, _forward_alone(case))
    finally:
        gc.unfreeze()  # the next case's model is another: this one may go
    profile_hot = profile_top(lambda: eval_cache(case.hpc.restore(case.prompt)[0]), 2, 6)
    copy_floor_t = hot_copy_floor(case.hpc, case.prompt, length, s)
    case.hot_bank.close()
    with Bank.open(case.path, BankConfig(block_size=s.block_size, hot_bytes=0)) as bank:
        pc = PrefixCache(bank, lm)
        profile_rocks = profile_top(lambda: eval_cache(pc.restore(case.prompt)[0]), 2, 6)
    floors = case_floors(case, s)
    floors["hot_copy_floor_s"] = median(copy_floor_t)
    stages = reopened_stages(case.path, lm, case.prompt, s)
    return case_figures(case, m, hot_hits, floors, m["forward"], stages) | {
        "profile_rocks": profile_rocks,
        "profile": profile_hot,
    }


def _prepare(name: str, length: int, s: RestoreSettings, workdir: Path) -> RestoreCase:
    """`name`'s synthetic cache of `length` tokens stored in a bank and saved by mlx-lm,
    the hot bank holding its lease, and the background store's samples."""
    lm = build_model(name)
    rng = np.random.default_rng(length)
    prompt = rng.integers(0, 256, length + 1).astype(np.uint32)
    path = workdir / f"bank-{name}-{length}"
    file = workdir / f"{name}-{length}.safetensors"
    with Bank.open(path, BankConfig(block_size=s.block_size)) as bank:
        pc = PrefixCache(bank, lm)
        cache, states = synthetic_cache(pc, length, rng)
        nbytes = kv_bytes(cache)
        t0 = time.perf_counter()
        pc.store(prompt[:-1], cache, states, end=False)
        store_s = time.perf_counter() - t0
        save_prompt_cache(str(file), cache)
        keys = pc.namespace.chain(prompt[:-1])
        hybrid = pc.spec.is_hybrid
    # The hot bank: the process that stored the prefix (its lease), kept open, on a
    # copy of the bank (the reopened way needs the directory's lock in turn).
    hot_path = workdir / f"bank-{name}-{length}-hot"
    shutil.copytree(path, hot_path)
    # Leases big enough for the prefix (a 16k-token one is 400 MB, over the default
    # 256 MiB): the hot way measures a prefix held in memory.
    hot_bytes = max(BankConfig().hot_bytes, 2 * nbytes)
    hot_bank = Bank.open(hot_path, BankConfig(block_size=s.block_size, hot_bytes=hot_bytes))
    hpc = PrefixCache(hot_bank, lm)
    hpc.store(prompt[:-1], cache, states, end=False)
    later = store_later_samples(
        workdir / f"later-{name}-{length}", lm, prompt[:-1], cache, states, s
    )
    return RestoreCase(
        name, length, lm, prompt, path, file, list(keys), hybrid, nbytes, store_s,
        hot_bank, hpc, later,
    )  # fmt: skip


def _ways(case: RestoreCase, s: RestoreSettings) -> dict[str, Callable[[str | None], float]]:
    """The five ways to a cache of the prefix, each timed with what follows it (`_then`):
    mlx-lm's file, a reopened bank, the hot bank with room (copied ahead, and with the
    copy on the path), its lease handed out."""
    return {
        "file": partial(_file_way, case),
        "reopened": partial(_reopened_way, case, s.block_size),
        "hot": partial(_hot_way, case),
        "on_path": partial(_on_path_way, case),
        "handout": partial(_handout_way, case),
    }


def _file_way(case: RestoreCase, then: str | None) -> float:
    t0 = time.perf_counter()
    loaded = load_prompt_cache(str(case.file))
    eval_cache(loaded)
    _then(case.hpc, loaded, case.last, then)
    return time.perf_counter() - t0


def _reopened_way(case: RestoreCase, block_size: int, then: str | None) -> float:
    with Bank.open(case.path, BankConfig(block_size=block_size)) as bank:
        rpc = PrefixCache(bank, case.lm)
        bank.resources.settle()  # its spares made ahead (`Spares.make_ahead`)
        t0 = time.perf_counter()
        restored, n = rpc.restore(case.prompt)
        eval_cache(restored)
        _then(rpc, restored, case.last, then)
        took = time.perf_counter() - t0
        if n != case.length:
            raise RuntimeError(f"{case.name}: restored {n} of {case.length} tokens")
        return took


def _hot_way(case: RestoreCase, then: str | None) -> float:
    t0 = time.perf_counter()
    restored, _ = case.hpc.restore(case.prompt)
    eval_cache(restored)
    _then(case.hpc, restored, case.last, then)
    return time.perf_counter() - t0


def _on_path_way(case: RestoreCase, then: str | None) -> float:
    """The hot way with the lease copied on the restore's path: copies ahead off
    (`Spares.copy_ahead` False), as a lease's first two restores
    with room go, and every restore of a runtime that turns them off."""
    spares = case.hpc.bank.resources.spares
    ahead, spares.copy_ahead = spares.copy_ahead, False
    try:
        return _hot_way(case, then)
    finally:
        spares.copy_ahead = ahead


def _handout_way(case: RestoreCase, then: str | None) -> float:
    """The lease handed out as it is (no room asked for): no copy, so the first
    prefill token copies the prefix (mlx-lm's concatenation) to write after it."""
    hpc = case.hpc
    t0 = time.perf_counter()
    hit = hpc.namespace.restore(case.prompt[:-1])
    if hit is None or hit.tokens != case.length:
        raise RuntimeError(f"{case.name}: the lease handed out {hit and hit.tokens} tokens")
    restored = hpc.new_cache()
    fill_cache(hpc.spec, restored, hit.layers, hit.tokens)
    eval_cache(restored)
    _then(hpc, restored, case.last, then)
    return time.perf_counter() - t0


def _forward_alone(case: RestoreCase) -> Callable[[], float]:
    """TTFT's floor: the first prefill token alone, on a cache restored with room from
    the hot bank (untimed, its refill made first: nothing runs beside the pass)."""

    def forward() -> float:
        restored, _ = case.hpc.restore(case.prompt)
        eval_cache(restored)
        case.hot_bank.resources.settle()
        t0 = time.perf_counter()
        first_token(case.hpc, restored, case.last)
        return time.perf_counter() - t0

    return forward


_HOT_WAYS = ("hot", "handout", "on_path")  # the ways restoring from the hot bank
_THEN = {"": None, "_ttft": "token", "_update": "update"}


def _timed(
    ways: dict[str, Callable[[str | None], float]],
    case: RestoreCase,
    s: RestoreSettings,
    forward: Callable[[], float],
) -> tuple[dict[str, float], float]:
    """Medians of every way with every follow-up (`"hot_ttft"`...) and of the forward
    pass alone (`"forward"`, TTFT's floor), one of each per round, the ways in an
    order rotated each round; the file's TTFT over each way's TTFT and over the
    forward pass, as the median of each round's ratio (`"file_over_hot_ttft"`...);
    and the hot tier's hits per hot request.

    The forward pass is most of a TTFT, and on this host it runs at two speeds some
    seconds each (the same single-token pass 113-126 or 145-180 ms at medium-qwen3 4k,
    nothing else running): a median of each way's own samples compares spells, so the
    ratios pair the samples of one round, taken within a few seconds. The floor is
    timed in the rounds too: measured apart it met other spells than the ways did (it
    once measured slower than the hot TTFT it bounds)."""
    times: dict[str, list[float]] = {f"{w}{t}": [] for w in ways for t in _THEN}
    times["forward"] = []
    before, floor_hits = case.hot_bank.stats().hot_hits, 0
    order = list(ways)
    for r in range(s.repeats):
        for way in order[r % len(order) :] + order[: r % len(order)]:
            for suffix, after in _THEN.items():
                # As in a runtime, where a forward pass at least follows each restore:
                # the spares the last restore asked for are made before the next one.
                case.hot_bank.resources.settle()
                times[f"{way}{suffix}"].append(ways[way](after))
        case.hot_bank.resources.settle()
        hits = case.hot_bank.stats().hot_hits
        times["forward"].append(forward())
        floor_hits += case.hot_bank.stats().hot_hits - hits  # not a way's: not counted
    hot_ways = sum(1 for way in ways if way in _HOT_WAYS)
    hits = case.hot_bank.stats().hot_hits - before - floor_hits
    hot_hits = hits / (hot_ways * len(_THEN) * s.repeats)
    m = {k: median(v) for k, v in times.items()}
    for key in [f"{w}_ttft" for w in ways] + ["forward"]:
        pairs = zip(times["file_ttft"], times[key], strict=True)
        m[f"file_over_{key}"] = median([f / t for f, t in pairs])
    return m, hot_hits


def run(workdir: Path, s: RestoreSettings) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    cases = []
    for name in s.models:
        for length in s.lengths:
            cases.append(measure(name, length, s, workdir))
    return {"settings": asdict(s), "cases": cases}


def tiny_settings() -> RestoreSettings:
    return RestoreSettings(models=("tiny-qwen3", "tiny-hybrid"), lengths=(64,), repeats=1)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the restore-at-size benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.restore", description=main.__doc__)
    p.add_argument("--models", default=",".join(RestoreSettings.models))
    p.add_argument("--lengths", default=",".join(map(str, RestoreSettings.lengths)))
    p.add_argument("--repeats", type=int, default=RestoreSettings.repeats, help="rounds")
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    args = p.parse_args(argv)
    s = (
        tiny_settings()
        if args.tiny
        else RestoreSettings(
            models=tuple(args.models.split(",")),
            lengths=tuple(int(x) for x in args.lengths.split(",")),
            repeats=args.repeats,
        )
    )
    if not args.tiny:
        server_settings()  # as cas-bank serve runs (for the file load too)
    with tempfile.TemporaryDirectory(prefix="cas_bank_restore_") as tmp:
        res = run(Path(tmp), s)
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
