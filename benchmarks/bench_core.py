"""The core bank against its ceilings: store and restore throughput, reopen time, lz4.

    .venv/bin/python -m benchmarks.bench_core [--blocks 32] [--repeats 3]
        [--reopen-blocks 100000 | --skip-reopen] [--profile]

Store and restore move 64-token blocks of a 7B-class layout (32 layers, 8 KV heads,
head_dim 128, fp16: 8 MiB per block). Each is printed beside its ceiling, measured in
the same run on the same bytes:
- store:   raw rocksdict put of the same payloads (one WriteBatch, the bank's own
           RocksDB options) + one memcpy of those bytes (cutting blocks out of the
           cache buffers must copy them once);
- restore: raw rocksdict get of the same payloads (the bank's options, read checksum
           off) + one memcpy into a preallocated array (assembling into MLX memory).
`fraction` is ceiling time / measured time (1.0 = at the ceiling). Figures are medians
of `--repeats` runs; this machine is noisy, so compare within one run only.

Reopen: `Bank.open` of a bank holding 1k and (by default) 100k small blocks; opening
must not scan, so the ratio should stay near 1.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lz4.block
import mlx.core as mx
import numpy as np

from benchmarks.ceilings import median, sample
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks import codec
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.spec import BlockCutter, check_layers

GB = 1e9
MiB = 1 << 20
BLOCK = 64  # tokens per block


def seven_b_spec() -> ModelSpec:
    return ModelSpec(
        name="bench-7b-layout",
        layers=tuple(LayerSpec.attention(8, 128, "float16") for _ in range(32)),
        weights_digest="bench",
    )


def timed(
    fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None
) -> float:
    """Median seconds of `repeats` calls of `fn`, each after an untimed `setup()`."""
    return median(sample(fn, repeats, setup))


def memcpy_seconds(chunks: Sequence[bytes], repeats: int) -> float:
    """One copy of every chunk into memory allocated beforehand."""
    total = sum(len(c) for c in chunks)
    dest = np.empty(total, dtype=np.uint8)
    dest[:] = 1  # fault the pages in before timing
    srcs = [np.frombuffer(c, dtype=np.uint8) for c in chunks]

    def run() -> None:
        off = 0
        for s in srcs:
            np.copyto(dest[off : off + len(s)], s)
            off += len(s)

    return timed(run, repeats)


def digest_seconds(chunks: Sequence[bytes], repeats: int) -> float:
    """The digest check of every payload, as the codec runs it."""
    return timed(lambda: [codec.verify(c) for c in chunks], repeats)


class Row:
    """One line of the results table."""

    def __init__(self, what: str, nbytes: int, seconds: float, ceiling: float | None = None):
        self.what, self.nbytes, self.seconds, self.ceiling = what, nbytes, seconds, ceiling

    def __str__(self) -> str:
        rate = self.nbytes / self.seconds / GB if self.seconds else float("inf")
        frac = f"{self.ceiling / self.seconds:8.2f}" if self.ceiling else " " * 8
        return f"  {self.what:<44} {self.seconds * 1e3:10.1f} ms {rate:8.2f} GB/s {frac}"


def header() -> str:
    return f"  {'what':<44} {'median':>13} {'rate':>13} {'fraction':>8}"


# -- store and restore -------------------------------------------------------------
class StoreRestore:
    """The 7B-class workload: one prompt of `n_blocks` blocks, its KV, its payloads."""

    def __init__(self, root: Path, n_blocks: int) -> None:
        self.root = root
        self.spec = seven_b_spec()
        self.n_blocks = n_blocks
        self.n = n_blocks * BLOCK
        rng = np.random.default_rng(0)
        self.tokens = [int(t) for t in rng.integers(0, 32000, self.n)]
        mx.random.seed(0)
        self.layers = [
            tuple(mx.random.normal((1, 8, self.n, 128)).astype(mx.float16) for _ in "kv")
            for _ in self.spec.layers
        ]
        mx.eval(*[a for kv in self.layers for a in kv])
        self.kv_bytes = self.n * self.spec.token_bytes
        self.config = BankConfig(block_size=BLOCK, hot_bytes=0)
        self.bank_dir = root / "bank"
        self._dirs = 0
        self.store_once(self.bank_dir)  # the bank that restores read
        with RocksStore(self.bank_dir, mode="read_only") as raw:
            self.keys = [k for k, _ in raw.iterate(Family.HEADERS, values=False)]
            got = raw.get_many(Family.BLOCKS, self.keys)
        self.payloads = [p for p in got if p is not None]
        assert len(self.payloads) == n_blocks
        self.payload_bytes = sum(len(p) for p in self.payloads)

    def fresh_dir(self) -> Path:
        self._dirs += 1
        return self.root / f"scratch-{self._dirs}"

    def store_once(self, path: Path | None = None) -> float:
        """Seconds of one `Namespace.store` into a new bank (open and close untimed)."""
        path = path or self.fresh_dir()
        with Bank.open(path, self.config) as bank:
            ns = bank.namespace(self.spec)
            t0 = time.perf_counter()
            ns.store(self.tokens, self.layers)
            took = time.perf_counter() - t0
        if path != self.bank_dir:
            shutil.rmtree(path, ignore_errors=True)
        return took

    def raw_put_once(self) -> float:
        """Seconds of putting the same payloads in one batch, the bank's options."""
        path = self.fresh_dir()
        with RocksStore(path) as raw:
            t0 = time.perf_counter()
            raw.put_batch(
                [(Family.BLOCKS, k, p) for k, p in zip(self.keys, self.payloads, strict=True)]
            )
            took = time.perf_counter() - t0
        shutil.rmtree(path, ignore_errors=True)
        return took

    def encode_once(self) -> float:
        """Seconds of the CPU side of a store: cut, copy, digest every block."""
        arrays = check_layers(self.spec, self.layers, self.n)
        t0 = time.perf_counter()
        cutter = BlockCutter(self.spec, arrays, BLOCK)
        kept = [cutter.payload(i, "auto", "xxh3") for i in range(self.n_blocks)]
        took = time.perf_counter() - t0
        del kept
        return took


def bench_store_restore(root: Path, n_blocks: int, repeats: int, profile: bool) -> list[Row]:
    w = StoreRestore(root, n_blocks)
    # Interleaved, so that both sides of each ratio see the same machine load.
    stores, puts, encodes = [], [], []
    for _ in range(repeats):
        stores.append(w.store_once())
        puts.append(w.raw_put_once())
        encodes.append(w.encode_once())
    t_store, t_put = statistics.median(stores), statistics.median(puts)
    t_encode = statistics.median(encodes)
    t_copy = memcpy_seconds(w.payloads, repeats + 2)
    t_hash = digest_seconds(w.payloads, repeats + 2)

    # Restore: a reopened bank without the hot tier (every payload read from RocksDB),
    # and raw gets of the same keys from the same database, interleaved.
    restores, gets = [], []
    with Bank.open(w.bank_dir, w.config) as bank:
        ns = bank.namespace(w.spec)
        hit = ns.restore(w.tokens)
        assert hit is not None and hit.tokens == w.n
        del hit
        raw = bank.store
        for _ in range(repeats + 2):
            restores.append(timed(lambda: ns.restore(w.tokens), 1))
            gets.append(timed(lambda: [raw.get(Family.BLOCKS, k) for k in w.keys], 1))
        if profile:
            print_profile("restore", lambda: ns.restore(w.tokens))
    t_restore, t_get = statistics.median(restores), statistics.median(gets)

    with Bank.open(w.bank_dir, BankConfig(hot_bytes=2 * w.payload_bytes)) as bank:
        ns = bank.namespace(w.spec)
        ns.restore(w.tokens)
        t_hot = timed(lambda: ns.restore(w.tokens), repeats + 2)
    if profile:
        path = w.fresh_dir()
        with Bank.open(path, w.config) as bank:
            print_profile("store", lambda: bank.namespace(w.spec).store(w.tokens, w.layers))
        shutil.rmtree(path, ignore_errors=True)

    print(
        f"\nstore / restore: {n_blocks} blocks x {BLOCK} tokens, 32 layers x 8 KV heads x 128 "
        f"fp16 ({w.spec.token_bytes * BLOCK / MiB:.0f} MiB/block); payloads "
        f"{w.payload_bytes / MiB:.0f} MiB; fraction = ceiling time / time"
    )
    kv, pb = w.kv_bytes, w.payload_bytes
    return [
        Row("store (Namespace.store, WAL on)", kv, t_store, t_put + t_copy),
        Row("  ceiling: raw put batch + memcpy", kv, t_put + t_copy),
        Row("    raw rocksdict put (one WriteBatch)", pb, t_put),
        Row("    memcpy of the payloads", pb, t_copy),
        Row("  of which cut + encode + digest (cas_bank)", kv, t_encode),
        Row("restore (Namespace.restore, no hot tier)", kv, t_restore, t_get + t_copy),
        Row("  ceiling: raw get + memcpy", kv, t_get + t_copy),
        Row("    raw rocksdict get (one per block)", pb, t_get),
        Row("    payload digest check (blake3)", pb, t_hash),
        Row("restore from the hot tier (vs memcpy)", kv, t_hot, t_copy),
    ]


def print_profile(what: str, fn: Callable[[], object]) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print(f"\n-- cProfile of one {what} (by own time) --")
    print("\n".join(out.getvalue().splitlines()[4:24]))


# -- reopen ------------------------------------------------------------------------
def tiny_spec() -> ModelSpec:
    return ModelSpec(
        name="bench-tiny", layers=(LayerSpec.attention(1, 8, "float16"),), weights_digest="t"
    )


def build_small_bank(path: Path, n_blocks: int) -> float:
    """A bank of `n_blocks` small blocks (4 tokens, 64-byte KV each); returns seconds."""
    spec = tiny_spec()
    per_prompt = 250
    kv = mx.zeros((1, 1, per_prompt * 4, 8), dtype=mx.float16) + 1
    layers = [(kv, kv)]
    t0 = time.perf_counter()
    with Bank.open(path, BankConfig(block_size=4, hot_bytes=0)) as bank:
        ns = bank.namespace(spec)
        for p in range(n_blocks // per_prompt):
            tokens = [p + 1_000_000] + [7] * (per_prompt * 4 - 1)  # a distinct first token
            ns.store(tokens, layers)
    return time.perf_counter() - t0


def open_seconds(path: Path, repeats: int, probe: list[int] | None = None) -> float:
    """Median seconds of `Bank.open` (and a `match` of `probe`, if given); close untimed."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bank = Bank.open(path)
        if probe is not None:
            bank.namespace(tiny_spec()).match(probe)
        out.append(time.perf_counter() - t0)
        bank.close()
    return statistics.median(out)


def bench_reopen(root: Path, sizes: Sequence[int], repeats: int) -> list[str]:
    lines = [f"  {'blocks':>8} {'build':>9} {'open':>9} {'open+match':>11} {'ratio':>6}"]
    base = None
    probe = [1_000_000] + [7] * 999
    for size in sizes:
        path = root / f"reopen-{size}"
        build = build_small_bank(path, size)
        open_seconds(path, 1)  # the first open after the build replays nothing new
        t_open = open_seconds(path, repeats + 4)
        t_match = open_seconds(path, repeats + 4, probe)
        base = base or t_open
        lines.append(
            f"  {size:>8} {build:>8.1f}s {t_open * 1e3:>7.1f}ms {t_match * 1e3:>9.1f}ms "
            f"{t_open / base:>6.2f}"
        )
        shutil.rmtree(path, ignore_errors=True)
    return lines


# -- lz4 on KV ---------------------------------------------------------------------
def lz4_ratio(data: bytes) -> float:
    return len(data) / len(lz4.block.compress(data, store_size=False))


def bench_lz4() -> list[str]:
    """lz4's ratio on fp16/bf16 KV: random normal, and a tiny mlx-lm model's real cache."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(4 * MiB // 2).astype(np.float16).tobytes()
    lines = [f"  random normal fp16 (4 MiB): ratio {lz4_ratio(normal):.3f}"]
    from cas_bank.runtime.models import build_model
    from mlx_lm.models.cache import make_prompt_cache

    for dtype in (mx.float16, mx.bfloat16):
        model = build_model("tiny-qwen3", seed=0, dtype=dtype).model
        cache = make_prompt_cache(model)
        tokens = mx.array([[int(t) for t in rng.integers(0, 256, 512)]])
        model(tokens, cache=cache)
        parts = []
        for c in cache:
            for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :]):
                a = a.view(mx.uint16)
                mx.eval(a)
                parts.append(np.array(a).tobytes())
        data = b"".join(parts)
        name = "fp16" if dtype == mx.float16 else "bf16"
        lines.append(
            f"  tiny-qwen3 (random weights) KV cache, {name}, 512 tokens "
            f"({len(data) / MiB:.1f} MiB): ratio {lz4_ratio(data):.3f}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=32, help="64-token blocks per store (8 MiB each)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    ap.add_argument("--reopen-blocks", type=int, default=100_000, help="the large bank's blocks")
    ap.add_argument("--skip-reopen", action="store_true", help="skip the reopen figures")
    ap.add_argument("--profile", action="store_true", help="cProfile one store and one restore")
    ap.add_argument("--dir", type=Path, default=None, help="where to put the banks (a tmp dir)")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        ap.error("--blocks and --repeats must be >= 1")

    root = Path(tempfile.mkdtemp(prefix="cas_bank_bench_", dir=args.dir))
    try:
        rows = bench_store_restore(root, args.blocks, args.repeats, args.profile)
        print(header())
        for r in rows:
            print(r)
        if not args.skip_reopen:
            sizes = (
                [1000, args.reopen_blocks] if args.reopen_blocks > 1000 else [args.reopen_blocks]
            )
            print("\nreopen: Bank.open of a bank of small blocks (median; ratio to the first)")
            for line in bench_reopen(root, sizes, args.repeats):
                print(line)
        print("\nlz4 on KV (uncompressed size / compressed size)")
        for line in bench_lz4():
            print(line)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
