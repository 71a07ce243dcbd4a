"""Capacity and speed: the hot tier against RocksDB and memcpy; what eviction
bookkeeping costs a restore; what building the leaf index and evicting cost.

    .venv/bin/python -m benchmarks.bench_capacity [--blocks 16] [--repeats 7] [--json]

1. Restore of one prefix (`--blocks` 64-token blocks of an 8-layer, 8-KV-head,
   head_dim 128 fp16 layout: 2 MiB per block) three ways, medians, in one run:
   - hot: from the hot tier (no RocksDB read, no digest check);
   - RocksDB: the same prefix with the hot tier off (RocksDB reads, page cache warm,
     blake3 check of every payload);
   - ceilings on the same bytes: memcpy into a preallocated array, and allocation +
     copy (a restore hands back fresh arrays, so it must allocate).
2. The bookkeeping eviction adds to a restore: restores with `max_bytes` set (leaf
   index built, nothing evicted) against unset, from the hot tier (where fixed costs
   weigh most) on small blocks (16 tokens, 2 layers: 16 KiB per block).
3. Building the leaf index (the first eviction's walk of headers and access records)
   for N blocks, and evicting them, per block.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.ceilings import gbps, median, memcpy_samples, sample
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.evict.eviction import evict_to_budget, leaf_index

MiB = 1 << 20


def layout(layers: int, kv_heads: int, head_dim: int, name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=tuple(
            LayerSpec.attention(kv_heads=kv_heads, head_dim=head_dim, dtype="float16")
            for _ in range(layers)
        ),
        weights_digest="bench-" + name,
    )


def kv(spec: ModelSpec, tokens: int, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    for ls in spec.layers:
        pair = tuple(
            mx.array(rng.standard_normal(s.with_tokens(tokens), dtype=np.float32)).astype(
                mx.float16
            )
            for s in ls.arrays
        )
        mx.eval(*pair)
        out.append(pair)
    return out


def restore_eval(ns: Any, tokens: list[int]) -> int:
    hit = ns.restore(tokens)
    assert hit is not None, "the prefix must be stored"
    mx.eval(*[a for layer in hit.layers if layer is not None for a in layer])
    return int(hit.tokens)


def alloc_copy_samples(nbytes: int, repeats: int) -> list[float]:
    """A fresh array each time, then one copy: what a restore minimally does."""
    src = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    return sample(lambda: src.copy(), repeats)


# -- 1. hot vs RocksDB vs memcpy -------------------------------------------------------
def hot_vs_rocks(root: Path, blocks: int, repeats: int) -> dict[str, Any]:
    spec = layout(8, 8, 128, "bench-8x8x128")
    bs = 64
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 30000, blocks * bs + 1)]
    path = root / "hot"
    with Bank.open(path, BankConfig(block_size=bs, hot_bytes=0)) as bank:
        bank.namespace(spec).store(tokens, kv(spec, len(tokens)))
        nbytes = bank.stats().payload_bytes
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        restore_eval(ns, tokens)  # page cache warm: compare the code paths, not the disk
        rocks = sample(lambda: restore_eval(ns, tokens), repeats)
    with Bank.open(path, BankConfig(hot_bytes=4 * nbytes)) as bank:
        ns = bank.namespace(spec)
        restore_eval(ns, tokens)  # fills the tier
        before = bank.stats().hot_hits
        hot = sample(lambda: restore_eval(ns, tokens), repeats)
        hot_hits = (bank.stats().hot_hits - before) / repeats
    mem = memcpy_samples(nbytes, repeats)
    alloc = alloc_copy_samples(nbytes, repeats)
    m = {k: median(v) for k, v in (("hot", hot), ("rocks", rocks), ("mem", mem), ("alloc", alloc))}
    return {
        "prefix_bytes": nbytes,
        "blocks": blocks,
        "hot_hits_per_restore": hot_hits,
        "seconds": m,
        "gbps": {k: gbps(nbytes, v) for k, v in m.items()},
        "ratios": {
            "hot_speedup_over_rocksdb": m["rocks"] / m["hot"],
            "hot_fraction_of_memcpy": m["mem"] / m["hot"],
            "hot_fraction_of_alloc_copy": m["alloc"] / m["hot"],
            "rocksdb_fraction_of_memcpy": m["mem"] / m["rocks"],
        },
    }


# -- 2. bookkeeping on the restore path ------------------------------------------------
def bookkeeping(root: Path, repeats: int) -> dict[str, Any]:
    spec = layout(2, 8, 64, "bench-small")
    bs, blocks = 16, 256
    tokens = list(range(blocks * bs))
    arrays = kv(spec, len(tokens))
    stored = 0
    for name in ("unset", "set"):  # two copies: one RocksDB directory per open bank
        with Bank.open(root / name, BankConfig(block_size=bs, hot_bytes=0)) as bank:
            bank.namespace(spec).store(tokens, arrays)
            stored = bank.stats().payload_bytes
    out: dict[str, list[float]] = {"unset": [], "set": []}
    banks = {
        "unset": Bank.open(root / "unset", BankConfig(hot_bytes=64 * MiB)),
        "set": Bank.open(root / "set", BankConfig(hot_bytes=64 * MiB, max_bytes=2 * stored)),
    }
    try:
        evict_to_budget(banks["set"], 2 * stored)  # builds the leaf index, evicts nothing
        assert banks["set"].access.index is not None and banks["set"].stats().blocks == blocks
        spaces = {k: b.namespace(spec) for k, b in banks.items()}
        for ns in spaces.values():
            restore_eval(ns, tokens)
        for _ in range(repeats):  # interleaved, so drift hits both alike
            for k, ns in spaces.items():
                out[k] += sample(lambda ns=ns: restore_eval(ns, tokens), 3)
        # The bookkeeping alone: recording one restore's uses (and the index update).
        hashes = spaces["set"].chain(tokens)
        touch = {
            k: median(sample(lambda b=b: b.access.touch(hashes), 50)) for k, b in banks.items()
        }
    finally:
        for b in banks.values():
            b.close()
    m = {k: median(v) for k, v in out.items()}
    return {
        "blocks_per_restore": blocks,
        "restore_s": m,
        "set_over_unset": m["set"] / m["unset"],
        "touch_us_per_restore": {k: v * 1e6 for k, v in touch.items()},
        "touch_share_of_restore_set": touch["set"] / m["set"],
    }


# -- 3. leaf index build and eviction --------------------------------------------------
def index_and_evict(root: Path, n_blocks: int) -> dict[str, Any]:
    spec = layout(1, 1, 8, "bench-tiny")
    bs, per_chain = 4, 100
    path = root / "index"
    with Bank.open(path, BankConfig(block_size=bs, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        arrays = kv(spec, per_chain * bs)
        for c in range(n_blocks // per_chain):
            ns.store([c] * (per_chain * bs), arrays)
        blocks = bank.stats().blocks
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:
        t0 = time.perf_counter()
        leaf_index(bank.store, bank.access)
        build = time.perf_counter() - t0
        total = bank.stats().payload_bytes
        t0 = time.perf_counter()
        report = evict_to_budget(bank, total // 2)
        evict = time.perf_counter() - t0
    return {
        "blocks": blocks,
        "index_build_s": build,
        "index_build_us_per_block": build / blocks * 1e6,
        "evicted_blocks": report.blocks_evicted,
        "evict_s": evict,
        "evict_us_per_block": evict / max(report.blocks_evicted, 1) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16, help="2 MiB blocks in the prefix")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--index-blocks", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cas_bank_bench_capacity_") as tmp:
        root = Path(tmp)
        results = {
            "hot_vs_rocksdb": hot_vs_rocks(root, args.blocks, args.repeats),
            "bookkeeping": bookkeeping(root, args.repeats),
            "index_and_evict": index_and_evict(root, args.index_blocks),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    h, b, e = results["hot_vs_rocksdb"], results["bookkeeping"], results["index_and_evict"]
    print(
        f"1. restore of a {h['prefix_bytes'] / MiB:.0f} MiB prefix ({h['blocks']} blocks), medians"
    )
    for k, label in (
        ("hot", "hot tier"),
        ("rocks", "RocksDB (warm page cache)"),
        ("alloc", "ceiling: allocate + copy"),
        ("mem", "ceiling: memcpy"),
    ):
        print(f"   {label:28s} {h['seconds'][k] * 1e3:8.2f} ms  {h['gbps'][k]:6.2f} GB/s")
    r = h["ratios"]
    print(
        f"   hot / RocksDB speedup {r['hot_speedup_over_rocksdb']:.2f}x; hot at "
        f"{r['hot_fraction_of_memcpy']:.2f} of memcpy, {r['hot_fraction_of_alloc_copy']:.2f} "
        f"of allocate+copy; RocksDB at {r['rocksdb_fraction_of_memcpy']:.2f} of memcpy; "
        f"hot hits per restore {h['hot_hits_per_restore']:.0f}"
    )
    print(f"2. eviction bookkeeping on the restore path ({b['blocks_per_restore']} blocks, hot)")
    print(
        f"   restore, max_bytes unset {b['restore_s']['unset'] * 1e3:.2f} ms, set "
        f"{b['restore_s']['set'] * 1e3:.2f} ms: set/unset {b['set_over_unset']:.3f}"
    )
    t = b["touch_us_per_restore"]
    print(
        f"   recording the uses: {t['unset']:.0f} us unset, {t['set']:.0f} us set "
        f"({b['touch_share_of_restore_set']:.1%} of a restore)"
    )
    print(
        f"3. leaf index over {e['blocks']} blocks: built in {e['index_build_s'] * 1e3:.0f} ms "
        f"({e['index_build_us_per_block']:.1f} us/block); evicting {e['evicted_blocks']} "
        f"took {e['evict_s'] * 1e3:.0f} ms ({e['evict_us_per_block']:.1f} us/block)"
    )


if __name__ == "__main__":
    main()
