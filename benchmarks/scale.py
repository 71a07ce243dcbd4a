"""Scale: a bank of a million blocks against one of a thousand.

What it measures, all through the public `Bank` / `Namespace` API:
- store throughput: blocks per second while `Namespace.store` writes the big bank
  in batches of `batch_tokens` tokens (each batch a new chain), beside a raw
  rocksdict write of the very same records (the ceiling);
- reopen: `Bank.open` of the big bank against a small one (medians), beside a raw
  rocksdict open of each (the ceiling). The target: at most 2x the small bank's;
- lookup: `Namespace.match` of a 32k-token prompt that the big bank holds whole
  (and of one it does not hold), p50/p99, beside the ceiling of its two parts:
  blake3 over the chain and one raw multi-get of the headers. The target: <= 1 ms p50.
  A row at the default block size (64) shows how the lookup scales with blocks.

The payloads are small on purpose (one attention layer, 1 KV head of dim 4, fp16):
this is about the index, not about bytes. Default: 1M blocks of 16 tokens, which
took about 20-40 s to write on the 2-core machine this was written on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import numpy as np

from benchmarks.ceilings import (
    dir_bytes,
    median,
    percentile,
    profile_top,
    raw_db,
    raw_open_samples,
    raw_put_samples,
    sample,
)
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec, Namespace
from cas_bank.blocks.hashing import BLOCK_CONTEXT
from cas_bank.blocks.store import Family

SPEC = ModelSpec(
    name="scale-bench",
    layers=(LayerSpec.attention(kv_heads=1, head_dim=4, dtype="float16"),),
    weights_digest="scale-bench-weights",
)


@dataclass(frozen=True)
class ScaleSettings:
    blocks: int = 1_000_000
    small_blocks: int = 1_000
    block_size: int = 16
    batch_tokens: int = 65_536
    lookup_tokens: int = 32_768
    lookups: int = 200
    reopens: int = 7
    ceiling_batches: int = 16  # raw-write ceiling over this many batches' records


def _config(block_size: int) -> BankConfig:
    # No hot tier: every figure here is about RocksDB and the index.
    return BankConfig(block_size=block_size, hot_bytes=0, compression="none")


def _kv(tokens: int, rng: np.random.Generator) -> list[Any]:
    k = mx.array(rng.standard_normal((1, 1, tokens, 4)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, 1, tokens, 4)).astype(np.float16))
    mx.eval(k, v)
    return [(k, v)]


def build(path: Path, n_blocks: int, s: ScaleSettings, seed: int) -> dict[str, Any]:
    """Write `n_blocks` blocks in batches of chains; the first batch starts with the
    lookup prompt. Returns the prompt, per-batch seconds and totals."""
    rng = np.random.default_rng(seed)
    per_batch = max(1, s.batch_tokens // s.block_size)
    kv = _kv(per_batch * s.block_size, rng)
    seconds: list[float] = []
    blocks: list[int] = []
    prompt = None
    with Bank.open(path, _config(s.block_size)) as bank:
        ns = bank.namespace(SPEC)
        left = n_blocks
        while left > 0:
            nb = min(per_batch, left)
            toks = rng.integers(0, 1 << 31, nb * s.block_size, dtype=np.uint32)
            if prompt is None:
                prompt = toks[: s.lookup_tokens].copy()
            layers = (
                kv
                if nb == per_batch
                else [
                    (kv[0][0][..., : nb * s.block_size, :], kv[0][1][..., : nb * s.block_size, :])
                ]
            )
            t0 = time.perf_counter()
            report = ns.store(toks, layers)
            seconds.append(time.perf_counter() - t0)
            blocks.append(report.blocks_written)
            left -= nb
    with Bank.open(path, _config(s.block_size)) as bank:
        stats = bank.stats()  # after a close: every memtable flushed
    assert prompt is not None
    return {
        "prompt": prompt,
        "seconds": seconds,
        "blocks": blocks,
        "disk_bytes": stats.disk_bytes,
        "dir_bytes": dir_bytes(path),
        "stored_blocks": stats.blocks,
    }


def _open_samples(path: Path, repeats: int, block_size: int = 16) -> list[float]:
    out: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bank = Bank.open(path, _config(block_size))
        out.append(time.perf_counter() - t0)
        bank.close()
    return out


def _raw_lookup_ceiling(
    path: Path, ns_root: bytes, prompt: np.ndarray, block_size: int, n: int
) -> list[float]:
    """blake3 over the chain plus one raw multi-get of its headers (no decoding)."""
    data = prompt.astype("<u4").tobytes()
    step = block_size * 4
    nblocks = len(prompt) // block_size

    def chain() -> list[bytes]:
        parent = ns_root
        out = []
        for i in range(nblocks):
            h = blake3.blake3(derive_key_context=BLOCK_CONTEXT)
            h.update(parent)
            h.update(data[i * step : (i + 1) * step])
            parent = h.digest()
            out.append(parent)
        return out

    keys = chain()
    with raw_db(path) as (_db, cfs):
        headers = cfs[Family.HEADERS]

        def lookup() -> None:
            chain()
            headers.get(keys)

        return sample(lookup, n)


def _records(path: Path, n_blocks: int) -> list[tuple[Family, bytes, bytes]]:
    """The first `n_blocks` headers and payloads as stored (for the raw-write ceiling)."""
    out: list[tuple[Family, bytes, bytes]] = []
    with raw_db(path) as (_db, cfs):
        for fam in (Family.HEADERS, Family.BLOCKS):
            for i, (k, v) in enumerate(cfs[fam].items()):
                if i >= n_blocks:
                    break
                out.append((fam, bytes(k), bytes(v)))
    return out


def _lookup(ns: Namespace, prompt: np.ndarray, n: int) -> dict[str, Any]:
    ts = sample(lambda: ns.match(prompt), n)
    return {"p50_s": median(ts), "p99_s": percentile(ts, 99), "samples": len(ts)}


def run(workdir: Path, s: ScaleSettings) -> dict[str, Any]:
    """Build both banks, measure, and return every figure (JSON-ready)."""
    workdir.mkdir(parents=True, exist_ok=True)
    big, small, side = workdir / "big", workdir / "small", workdir / "bs64"
    t0 = time.perf_counter()
    built = build(big, s.blocks, s, seed=1)
    build_s = time.perf_counter() - t0
    small_built = build(small, s.small_blocks, s, seed=2)
    phases = {"build": time.perf_counter() - t0}
    prompt: np.ndarray = built["prompt"]
    t0 = time.perf_counter()
    store = _store_figures(workdir, big, built, s)
    phases["store_ceiling"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reopen = _reopen_figures(big, small, s)
    phases["reopen"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lookup = _lookup_figures(big, prompt, s)
    phases["lookup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lookup["bs64"] = _lookup_bs64(side, prompt, s)
    phases["lookup_bs64"] = time.perf_counter() - t0
    return {
        "settings": asdict(s),
        "build_s": build_s,
        "big_blocks": built["stored_blocks"],
        "small_blocks": small_built["stored_blocks"],
        "big_disk_bytes": built["disk_bytes"],
        "big_dir_bytes": built["dir_bytes"],
        "phases_s": phases,
        "store": store,
        "reopen": reopen,
        "lookup": lookup,
    }


def _store_figures(
    workdir: Path, big: Path, built: dict[str, Any], s: ScaleSettings
) -> dict[str, Any]:
    """Store throughput against a raw write of the same records in the same batch sizes."""
    secs, blocks = built["seconds"], built["blocks"]
    per_batch = [b / t for b, t in zip(blocks, secs, strict=True) if t > 0]
    n_ceiling = min(len(blocks), s.ceiling_batches) * max(1, s.batch_tokens // s.block_size)
    records = _records(big, n_ceiling)
    bsz = max(1, s.batch_tokens // s.block_size)
    hdr = [r for r in records if r[0] is Family.HEADERS]
    pay = [r for r in records if r[0] is Family.BLOCKS]
    batches = [hdr[i : i + bsz] + pay[i : i + bsz] for i in range(0, len(hdr), bsz)]
    raw_secs = raw_put_samples(workdir / "raw-put", batches)
    del records, pay, batches
    raw_bps = len(hdr) / sum(raw_secs)
    store_bps = sum(blocks) / sum(secs)
    return {
        "blocks_per_s": store_bps,
        "batch_p50_blocks_per_s": median(per_batch),
        "first_batches_blocks_per_s": sum(blocks[:8]) / sum(secs[:8]),
        "last_batches_blocks_per_s": sum(blocks[-8:]) / sum(secs[-8:]),
        "raw_put_blocks_per_s": raw_bps,
        "fraction_of_raw": store_bps / raw_bps,
        "ceiling_blocks": len(hdr),
    }


def _reopen_figures(big: Path, small: Path, s: ScaleSettings) -> dict[str, Any]:
    """Reopening the bank and raw rocksdict, big and small, interleaved: one open of
    each at a time, so that the machine's drift hits both alike."""
    opens: dict[str, list[float]] = {"big_s": [], "small_s": [], "raw_big_s": [], "raw_small_s": []}
    for _ in range(s.reopens):
        opens["big_s"] += _open_samples(big, 1, s.block_size)
        opens["small_s"] += _open_samples(small, 1, s.block_size)
        opens["raw_big_s"] += raw_open_samples(big, 1)
        opens["raw_small_s"] += raw_open_samples(small, 1)
    reopen: dict[str, Any] = {k: median(v) for k, v in opens.items()}
    reopen["ratio"] = reopen["big_s"] / reopen["small_s"]
    reopen["fraction_of_raw"] = reopen["raw_big_s"] / reopen["big_s"]
    reopen["profile"] = profile_top(lambda: Bank.open(big, _config(s.block_size)).close(), 3, 6)
    return reopen


def _lookup_figures(big: Path, prompt: np.ndarray, s: ScaleSettings) -> dict[str, Any]:
    """Lookup of the 32k prompt, held whole by the big bank, and of one it lacks."""
    miss_prompt = np.random.default_rng(99).integers(0, 1 << 31, len(prompt), dtype=np.uint32)
    with Bank.open(big, _config(s.block_size)) as bank:
        ns = bank.namespace(SPEC)
        matched = ns.match(prompt)
        hit = _lookup(ns, prompt, s.lookups)
        miss = _lookup(ns, miss_prompt, max(5, s.lookups // 4))
        root = ns.root
        profile = profile_top(lambda: ns.match(prompt), repeats=20, top=8)
    ceiling = _raw_lookup_ceiling(big, root, prompt, s.block_size, s.lookups)
    return {
        "tokens": len(prompt),
        "block_size": s.block_size,
        "blocks": len(prompt) // s.block_size,
        "matched_tokens": matched,
        "hit": hit,
        "miss": miss,
        "ceiling_p50_s": median(ceiling),
        "fraction_of_ceiling": median(ceiling) / hit["p50_s"],
        "profile": profile,
    }


def _lookup_bs64(side: Path, prompt: np.ndarray, s: ScaleSettings) -> dict[str, Any]:
    """The same lookup at the default block size (a small side bank holding the prompt)."""
    with Bank.open(side, _config(64)) as bank:
        ns64 = bank.namespace(SPEC)
        ns64.store(prompt, _kv(len(prompt), np.random.default_rng(3)))
        hit64 = _lookup(ns64, prompt, s.lookups)
        root64 = ns64.root
    ceiling64 = _raw_lookup_ceiling(side, root64, prompt, 64, s.lookups)
    return {
        "blocks": len(prompt) // 64,
        "hit": hit64,
        "ceiling_p50_s": median(ceiling64),
        "fraction_of_ceiling": median(ceiling64) / hit64["p50_s"],
    }


def tiny_settings() -> ScaleSettings:
    """The smallest run that still exercises every figure (the smoke test's)."""
    return ScaleSettings(
        blocks=600,
        small_blocks=100,
        batch_tokens=1024,
        lookup_tokens=2048,
        lookups=5,
        reopens=2,
        ceiling_batches=2,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the scale benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=main.__doc__)
    p.add_argument("--blocks", type=int, default=ScaleSettings.blocks)
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.blocks < 1:
        p.error(f"--blocks must be >= 1, got {args.blocks}")
    s = tiny_settings() if args.tiny else ScaleSettings(blocks=args.blocks)
    with tempfile.TemporaryDirectory(prefix="cas_bank_scale_", dir=args.workdir) as tmp:
        res = run(Path(tmp), s)
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
