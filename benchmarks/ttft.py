"""Time to first token, four ways, for the same prompt, and the bytes each keeps.

For every model and prompt length L the prompt has L+1 tokens (L a multiple of the
block size), so that both ways that reuse a cache restore the same L tokens and
prefill the same one token: the comparison is of the restore, not of the tail.
(With another length cas_bank also prefills the partial block, up to block_size-1
tokens, which the mlx-lm file would hold.)

- cold: `model(prompt)` in chunks of 2048 (mlx-lm's `prefill_step_size`), logits of
  the last token evaluated;
- mlx-lm file: `save_prompt_cache` of the first L tokens' cache, then per request
  `load_prompt_cache` + the forward of the last token (what mlx-lm users do today);
- cas_bank, RocksDB: the bank is closed and reopened before every request (the page
  cache stays warm, as it does for the file), then `PrefixCache.restore` +
  `PrefixCache.prefill` of the rest;
- cas_bank, hot tier: the same request again in the same process.

Every way's logits are compared with the cold prefill's (a fast wrong answer is
worth nothing). Ceilings, on the very bytes the restore read: a raw rocksdict get of
the same keys after a reopen plus a memcpy of as many bytes (RocksDB restore), a
memcpy (hot restore). `store_overhead` measures what storing adds to a cold prefill.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import LoadedModel, PrefixCache, build_model
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from benchmarks.ceilings import (
    dir_bytes,
    median,
    memcpy_samples,
    profile_top,
    raw_read_samples,
    speed_fraction,
)
from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family

PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size: chunks of a cold prefill
WAYS = ("cold", "mlx_lm_file", "cas_bank_rocksdb", "cas_bank_hot")


@dataclass(frozen=True)
class TTFTSettings:
    models: tuple[str, ...] = ("tiny-qwen3", "tiny-hybrid")
    lengths: tuple[int, ...] = (1024, 4096)
    repeats: int = 5  # restores and file loads (cheap)
    cold_repeats: int = 3  # cold prefills (seconds each at 4k on this CPU)
    block_size: int = 64
    logits_atol: float = 1e-3


# -- the mlx-lm side -------------------------------------------------------------------
def cold_prefill(model: Any, tokens: np.ndarray, cache: list[Any] | None = None) -> mx.array:
    """Prefill `tokens` into `cache` (a new one if None) in mlx-lm's chunks; last logits."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = None
    for lo in range(0, len(tokens), PREFILL_STEP):
        logits = model(mx.array(tokens[lo : lo + PREFILL_STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])
    assert logits is not None
    last = logits[0, -1]
    mx.eval(last)
    return last


def eval_cache(cache: Sequence[Any]) -> None:
    """Force every array of a cache (mx.load and restores may be lazy)."""
    mx.eval([c.state for c in cache])


def trimmed(cache: Sequence[Any]) -> list[Any]:
    """The cache with KV buffers cut to their offset, as a session file should hold it.

    mlx-lm's `KVCache.state` is the whole buffer, rounded up to 256 tokens; cutting it
    favours the file in every byte count here.
    """
    out: list[Any] = []
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None and c.keys.shape[-2] != c.offset:
            t = KVCache()
            t.keys, t.values, t.offset = (
                c.keys[..., : c.offset, :],
                c.values[..., : c.offset, :],
                c.offset,
            )
            out.append(t)
        else:
            out.append(c)
    return out


def kv_bytes(cache: Sequence[Any]) -> int:
    """Bytes of a cache's arrays (trimmed), what a restore has to produce."""
    total = 0
    for c in trimmed(cache):
        # state: (keys, values, offset) for KV; ([conv, recurrent], padding, lengths) for GDN.
        total += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    return total


# -- one model, one length -------------------------------------------------------------
@dataclass
class Case:
    model: str
    tokens: int
    restored: dict[str, int] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    restore_s: dict[str, float] = field(default_factory=dict)
    bytes_on_disk: dict[str, int] = field(default_factory=dict)
    logits_max_diff: dict[str, float] = field(default_factory=dict)
    kv_bytes: int = 0
    ceilings: dict[str, float] = field(default_factory=dict)
    fractions: dict[str, float] = field(default_factory=dict)
    store: dict[str, float] = field(default_factory=dict)
    hot_hits_per_request: float = 0.0
    profile: list[dict[str, Any]] = field(default_factory=list)  # hot restore
    profile_rocks: list[dict[str, Any]] = field(default_factory=list)  # restore, no hot tier


def _bank(path: Path, s: TTFTSettings, hot_for: int = 0) -> Bank:
    """The bank, its hot tier big enough to hold `hot_for` bytes of KV twice (a 16k-token
    prefix of medium-qwen3 is 403 MB, over the default 256 MiB), as `benchmarks.restore`
    sizes its own."""
    hot_bytes = max(BankConfig().hot_bytes, 2 * hot_for)
    return Bank.open(path, BankConfig(block_size=s.block_size, hot_bytes=hot_bytes))


def _pc(bank: Bank, lm: LoadedModel) -> PrefixCache:
    return PrefixCache(bank, lm, chunk_size=PREFILL_STEP)


def _restore_run(pc: PrefixCache, prompt: np.ndarray) -> tuple[float, float, int, mx.array]:
    """One cas_bank request: (restore seconds, ttft seconds, tokens restored, logits)."""
    t0 = time.perf_counter()
    cache, n = pc.restore(prompt)
    eval_cache(cache)
    t1 = time.perf_counter()
    logits = pc.prefill(prompt, cache, start=n)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, n, logits


def measure_case(lm: LoadedModel, length: int, s: TTFTSettings, workdir: Path) -> Case:
    """All four ways for one model and one prompt of `length` + 1 tokens."""
    if length % s.block_size:
        raise ValueError(f"length {length} is not a multiple of block_size {s.block_size}")
    case = Case(model=lm.name, tokens=length + 1)
    prompt = np.random.default_rng(length).integers(0, 256, length + 1).astype(np.uint32)
    workdir.mkdir(parents=True, exist_ok=True)
    ref = _cold_way(case, lm, prompt, s)
    _file_way(case, lm, prompt, s, workdir, ref)
    path = workdir / f"bank-{lm.name}-{length}"
    keys, hybrid = _storing_prefill(case, lm, prompt, s, path)
    _bank_ways(case, lm, prompt, s, path, ref)
    _ceilings(case, s, path, keys, hybrid)
    return case


def _cold_way(case: Case, lm: LoadedModel, prompt: np.ndarray, s: TTFTSettings) -> mx.array:
    """(a) cold prefill; its last logits are the reference every other way matches."""
    cold_t: list[float] = []
    ref = None
    for _ in range(s.cold_repeats):
        t0 = time.perf_counter()
        ref = cold_prefill(lm.model, prompt)
        cold_t.append(time.perf_counter() - t0)
    assert ref is not None
    case.ttft_s["cold"] = median(cold_t)
    case.restored["cold"] = 0
    return ref


def _file_way(
    case: Case, lm: LoadedModel, prompt: np.ndarray, s: TTFTSettings, workdir: Path, ref: mx.array
) -> None:
    """(b) mlx-lm's per-session file of the first `length` tokens."""
    model, length = lm.model, len(prompt) - 1
    file = workdir / f"{lm.name}-{length}.safetensors"
    cache = make_prompt_cache(model)
    cold_prefill(model, prompt[:-1], cache)
    case.kv_bytes = kv_bytes(cache)
    save_prompt_cache(str(file), trimmed(cache))
    del cache
    case.bytes_on_disk["mlx_lm_file"] = file.stat().st_size
    load_t, ttft_t = [], []
    for _ in range(s.repeats):
        t0 = time.perf_counter()
        loaded = load_prompt_cache(str(file))
        eval_cache(loaded)
        t1 = time.perf_counter()
        logits = model(mx.array(prompt[-1:])[None], cache=loaded)[0, -1]
        mx.eval(logits)
        ttft_t.append(time.perf_counter() - t0)
        load_t.append(t1 - t0)
    case.restore_s["mlx_lm_file"] = median(load_t)
    case.ttft_s["mlx_lm_file"] = median(ttft_t)
    case.restored["mlx_lm_file"] = length
    case.logits_max_diff["mlx_lm_file"] = float(mx.max(mx.abs(logits - ref)))


def _storing_prefill(
    case: Case, lm: LoadedModel, prompt: np.ndarray, s: TTFTSettings, path: Path
) -> tuple[list[bytes], bool]:
    """The storing prefill: what a first request costs with the bank (and what storing
    adds). Returns the prompt's chain and whether the model is hybrid."""
    with _bank(path, s) as bank:
        pc = _pc(bank, lm)
        cache, n = pc.restore(prompt)
        t0 = time.perf_counter()
        pc.prefill(prompt, cache, start=n)
        first = time.perf_counter() - t0
        rep = pc.last_prefill
        assert rep is not None
        case.store = {
            "prefill_with_store_s": first,
            "forward_s": rep.forward_s,
            "store_s": rep.store_s,
        }
        keys = list(pc.namespace.chain(prompt[:-1]))
        hybrid = pc.spec.is_hybrid
    case.bytes_on_disk["cas_bank_rocksdb"] = dir_bytes(path)
    return keys, hybrid


def _bank_ways(
    case: Case, lm: LoadedModel, prompt: np.ndarray, s: TTFTSettings, path: Path, ref: mx.array
) -> None:
    """(c) restore from RocksDB after a reopen; (d) the same again, from the hot tier."""
    rocks_r, rocks_t, hot_r, hot_t = [], [], [], []
    for _ in range(s.repeats):
        with _bank(path, s) as bank:
            pc = _pc(bank, lm)
            before = bank.stats().hot_hits
            r, t, n, logits = _restore_run(pc, prompt)
            if bank.stats().hot_hits != before:
                raise RuntimeError("a restore right after a reopen was served by the hot tier")
            rocks_r.append(r)
            rocks_t.append(t)
    case.restored["cas_bank_rocksdb"] = n
    with Bank.open(path, BankConfig(block_size=s.block_size, hot_bytes=0)) as bank:
        pc = _pc(bank, lm)
        case.profile_rocks = profile_top(lambda: pc.restore(prompt), repeats=3, top=6)
    case.logits_max_diff["cas_bank_rocksdb"] = float(mx.max(mx.abs(logits - ref)))
    with _bank(path, s, hot_for=case.kv_bytes) as bank:
        pc = _pc(bank, lm)
        _restore_run(pc, prompt)  # fills the hot tier's decoded views
        before = bank.stats().hot_hits
        for _ in range(s.repeats):
            r, t, n, logits = _restore_run(pc, prompt)
            hot_r.append(r)
            hot_t.append(t)
        case.hot_hits_per_request = (bank.stats().hot_hits - before) / s.repeats
        if not case.hot_hits_per_request:
            raise RuntimeError("the hot way's restores were not served by the hot tier")
        case.profile = profile_top(lambda: pc.restore(prompt), repeats=3, top=6)
    case.restored["cas_bank_hot"] = n
    case.logits_max_diff["cas_bank_hot"] = float(mx.max(mx.abs(logits - ref)))
    for way, rs, ts in (("cas_bank_rocksdb", rocks_r, rocks_t), ("cas_bank_hot", hot_r, hot_t)):
        case.restore_s[way] = median(rs)
        case.ttft_s[way] = median(ts)


def _ceilings(case: Case, s: TTFTSettings, path: Path, keys: list[bytes], hybrid: bool) -> None:
    """Ceilings on the same bytes: raw get of the restored blocks (+ the one state),
    memcpy; and the case's fractions of them."""
    nb = case.restored["cas_bank_rocksdb"] // s.block_size
    read_keys = {Family.BLOCKS: list(keys[:nb])}
    if hybrid and nb:
        read_keys[Family.STATES] = [keys[nb - 1]]
    raw_t, raw_bytes = raw_read_samples(path, read_keys, s.repeats)
    mem_t = memcpy_samples(case.kv_bytes, max(7, s.repeats))
    case.ceilings = {
        "raw_read_s": median(raw_t),
        "raw_read_bytes": raw_bytes,
        "memcpy_s": median(mem_t),
        "raw_read_plus_memcpy_s": median(raw_t) + median(mem_t),
    }
    case.fractions = {
        "rocksdb_restore_of_ceiling": speed_fraction(
            case.restore_s["cas_bank_rocksdb"], case.ceilings["raw_read_plus_memcpy_s"]
        ),
        "hot_restore_of_memcpy": speed_fraction(
            case.restore_s["cas_bank_hot"], case.ceilings["memcpy_s"]
        ),
        "file_load_over_rocksdb_restore": case.restore_s["mlx_lm_file"]
        / case.restore_s["cas_bank_rocksdb"],
        "store_share_of_prefill": case.store["store_s"] / case.store["forward_s"],
    }


def check(case: Case, atol: float) -> list[str]:
    """Problems with a case: a way that restored the wrong amount or gave other logits."""
    problems = []
    for way, n in case.restored.items():
        if way != "cold" and n != case.tokens - 1:
            problems.append(
                f"{case.model} {case.tokens}: {way} restored {n} of {case.tokens - 1} tokens"
            )
    for way, d in case.logits_max_diff.items():
        if not d <= atol:
            problems.append(f"{case.model} {case.tokens}: {way} logits differ from cold by {d:.2e}")
    return problems


# -- what storing adds to a cold prefill -----------------------------------------------
def store_overhead(
    model_name: str, length: int, repeats: int, workdir: Path, block_size: int = 64
) -> dict[str, Any]:
    """Cold prefill without a bank against `PrefixCache.prefill` (storing inline) into
    an empty bank, interleaved (A, B, A, B, ...) so that the machine's drift hits both alike."""
    lm = build_model(model_name)
    prompt = np.random.default_rng(7).integers(0, 256, length).astype(np.uint32)
    without, with_bank, store_s, forward_s = [], [], [], []
    cold_prefill(lm.model, prompt[:64])  # warm-up: first-call costs are no part of either side
    for i in range(repeats):
        t0 = time.perf_counter()
        cold_prefill(lm.model, prompt)
        without.append(time.perf_counter() - t0)
        with Bank.open(workdir / f"overhead-{i}", BankConfig(block_size=block_size)) as bank:
            # Inline: the store's own cost (the background writer's is in server_store).
            pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP, background=False)
            cache = pc.new_cache()
            t0 = time.perf_counter()
            pc.prefill(prompt, cache, start=0)
            with_bank.append(time.perf_counter() - t0)
            rep = pc.last_prefill
            assert rep is not None
            store_s.append(rep.store_s)
            forward_s.append(rep.forward_s)
    return {
        "model": model_name,
        "tokens": length,
        "repeats": repeats,
        "without_bank_s": median(without),
        "with_bank_s": median(with_bank),
        "added": median(with_bank) / median(without) - 1.0,
        "store_s": median(store_s),
        "forward_s": median(forward_s),
        "store_share": median(store_s) / median(forward_s),
        "samples": {"without": without, "with": with_bank},
    }


def run(workdir: Path, s: TTFTSettings) -> dict[str, Any]:
    cases: list[Case] = []
    problems: list[str] = []
    for name in s.models:
        lm = build_model(name)
        for length in s.lengths:
            t0 = time.perf_counter()
            case = measure_case(lm, length, s, workdir / name)
            print(
                f"  ttft {name} {length + 1} tokens: {time.perf_counter() - t0:.1f} s", flush=True
            )
            problems += check(case, s.logits_atol)
            cases.append(case)
    return {"settings": asdict(s), "cases": [asdict(c) for c in cases], "problems": problems}


def tiny_settings() -> TTFTSettings:
    return TTFTSettings(
        models=("tiny-qwen3", "tiny-hybrid"), lengths=(64,), repeats=1, cold_repeats=1
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the TTFT benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ttft", description=main.__doc__)
    p.add_argument("--models", default=",".join(TTFTSettings.models))
    p.add_argument("--lengths", default=",".join(map(str, TTFTSettings.lengths)))
    p.add_argument("--repeats", type=int, default=TTFTSettings.repeats)
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    args = p.parse_args(argv)
    if args.tiny:
        s = tiny_settings()
    else:
        s = TTFTSettings(
            models=tuple(args.models.split(",")),
            lengths=tuple(int(x) for x in args.lengths.split(",")),
            repeats=args.repeats,
        )
    with tempfile.TemporaryDirectory(prefix="cas_bank_ttft_") as tmp:
        res = run(Path(tmp), s)
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
