"""The lookup of a restore right after a reopen: chain records against headers.

    .venv/bin/python -m benchmarks.lookup [--rounds 15] [--others 256] [--parts] [--json]

Every restore first looks its prompt up (`Hit.timings.lookup_s`: the chain's hashes,
the index reads, the end record and partial block, the probe of memory). After a
reopen nothing is cached: each record it reads comes from RocksDB's files. This stores
conversations of 1k, 4k and 16k tokens at the default block size (64), and one of 16k
+ 320 whose next turn comes with 320 new tokens (its stored chain ends inside a
segment: the lookup goes past what is stored), in a bank that also holds `--others`
other prompts of 1k tokens (so that a chain's headers lie apart in the table, as in a
bank in use; 0: a bank of those alone), closes it, and then, each round and for each
conversation, opens it and restores the conversation as `PrefixCache.restore` does
(`Namespace.restore(prompt[:-1], room_for=len(prompt))`), taking the lookup's time:

- `prefixes`: as a restore does now: the prefix records first (`index.prefixes`: one
  multi-get keyed by the prompt's tokens, hashed a segment of 64 blocks at a time; no
  block's chain hash computed), then the namespace's epoch;
- `records`: as it did before the prefix records, and does past them: the chain hashes
  of every block, then the chain records (`index.chain_records.read_runs`, one
  multi-get of the segments' records), headers only past them;
- `headers`: as it did before the chain records, and does in a bank written before
  them: one multi-get of every header (a chain over `WHOLE_CHAIN_READ` blocks cut to
  its stored length by a binary search of point reads first).

The ways alternate, their order rotated each round, on the same bank. Medians side
by side (and the ratios to `prefixes`), and beside them the lookup of the restore that follows in
the same process (hot: what the first one read is in the hot tier). `--parts` adds
where a reopened 16k-token lookup's time goes, phase by phase, as
`restore.restoring._plan` runs them, and within the prefix records the prompt's keys
hashed (`prefix_keys`) and the records decoded (`decode_prefix_record`, the headers
made); the rest of that phase is the multi-get below the hot tier, the tier's
bookkeeping and the records' checks. (Each of those calls timed adds ~0.3 us to it.)

The payloads are small (one attention layer, one KV head of dim 32, fp16): this is
about the index, not about bytes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.ceilings import median
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.index import chain, chain_records, prefixes
from cas_bank.index.ends import plan_end
from cas_bank.index.partial import find_partial
from cas_bank.index.prefixes import read_prefixes
from cas_bank.index.view import read_view

SPEC = ModelSpec(
    name="lookup-bench",
    layers=(LayerSpec.attention(kv_heads=1, head_dim=32, dtype="float16"),),
    weights_digest="lookup-bench-weights",
)
BLOCK = 64
# (tokens stored, new tokens of the prompt restored): a stored chain asked as it is,
# and a next turn.
CASES = ((1024, 0), (4096, 0), (16384, 0), (16384 + 320, 320))
WAYS = ("prefixes", "records", "headers")


def _kv(tokens: int, rng: np.random.Generator) -> list[Any]:
    k = mx.array(rng.standard_normal((1, 1, tokens, 32)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, 1, tokens, 32)).astype(np.float16))
    mx.eval(k, v)
    return [(k, v)]


def build(
    path: Path, cases: Sequence[tuple[int, int]], others: int
) -> dict[tuple[int, int], np.ndarray]:
    """The bank: `others` prompts of 1k tokens, then one conversation of each case,
    its first `n` tokens stored; its prompt `new` tokens longer and one more (the
    token a restore leaves to prefill)."""
    rng = np.random.default_rng(0)
    prompts: dict[tuple[int, int], np.ndarray] = {}
    with Bank.open(path, BankConfig(block_size=BLOCK)) as bank:
        ns = bank.namespace(SPEC)
        kv = _kv(max([n for n, _ in cases] + [1024]), rng)
        for _ in range(others):
            toks = rng.integers(0, 1 << 17, 1024, dtype=np.uint32)
            ns.store(toks, [(k[..., :1024, :], v[..., :1024, :]) for k, v in kv])
        for n, new in cases:
            prompt = rng.integers(0, 1 << 17, n + new + 1, dtype=np.uint32)
            ns.store(prompt[:n], [(k[..., :n, :], v[..., :n, :]) for k, v in kv])
            prompts[(n, new)] = prompt
    return prompts


@contextmanager
def looked_up(way: str) -> Iterator[None]:
    """The lookup as `way` names it: without the prefix records (`records`), without
    them and the chain records (`headers`: `longest_chain` finds none)."""
    names = ("read_prefixes", "read_runs")  # as the lookup (`index.chain`) calls them
    kept = {name: getattr(chain, name) for name in names}
    if way != "prefixes":
        setattr(chain, "read_prefixes", lambda *args: ([], []))  # noqa: B010
    if way == "headers":
        setattr(chain, "read_runs", lambda *args: ([], False))  # noqa: B010
    try:
        yield
    finally:
        for name, fn in kept.items():
            setattr(chain, name, fn)


def reopened_lookup(path: Path, prompt: np.ndarray, way: str, stored: int) -> tuple[float, float]:
    """Seconds of a restore's lookup right after opening the bank, and of the next
    restore's (hot: what the first one read is in the hot tier); each restores the
    `stored` tokens."""
    with Bank.open(path, BankConfig(block_size=BLOCK)) as bank:
        ns = bank.namespace(SPEC)
        took = []
        for _ in range(2):
            bank.resources.settle()  # the spares the restore before asked for: made
            with looked_up(way):
                hit = ns.restore(prompt[:-1], room_for=len(prompt))
            if hit is None or hit.timings is None or hit.tokens != stored:
                raise RuntimeError(f"restored {hit and hit.tokens} of {stored} tokens")
            took.append(hit.timings.lookup_s)
            del hit
        return took[0], took[1]


@contextmanager
def timed_calls(module: Any, names: Sequence[str], spent: dict[str, float]) -> Iterator[None]:
    """While inside, each call of `module`'s functions `names` (as its own functions
    find them, by the module's name) adds its seconds to `spent[name]`."""
    kept = {name: getattr(module, name) for name in names}

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out

        return call

    for name, fn in kept.items():
        setattr(module, name, timer(name, fn))
    try:
        yield
    finally:
        for name, fn in kept.items():
            setattr(module, name, fn)


PREFIX_PARTS = ("prefix_keys", "decode_prefix_record")  # timed within the prefix records


def reopened_parts(path: Path, prompt: np.ndarray, way: str) -> dict[str, float]:
    """A reopened lookup's phases, as `restore.restoring._plan` runs them (each on
    what the phases before it left warm), and within the prefix records
    `PREFIX_PARTS` (keyed `in prefix records: <name>`, left out of `total`)."""
    parts: dict[str, float] = {}
    within: dict[str, float] = {}
    with Bank.open(path, BankConfig(block_size=BLOCK)) as bank:
        ns = bank.namespace(SPEC)
        # As `reopened_lookup`: the spares a reopened bank makes from its open on, made
        # first (their thread took turns with the phases: 16k prefix records 0.32 ms
        # timed here against 0.28 for the whole lookup in `reopened_lookup`).
        bank.resources.settle()
        toks = prompt[:-1]

        def timed(name: str, fn: Callable[[], Any]) -> Any:
            t0 = time.perf_counter()
            out = fn()
            parts[name] = time.perf_counter() - t0
            return out

        view = timed("read view", lambda: read_view(bank))
        n = len(toks) // BLOCK
        blocks = np.ascontiguousarray(toks[: n * BLOCK])
        hashes: list[Any] = []
        runs: list[chain.Header] = []
        if way == "prefixes":
            with timed_calls(prefixes, PREFIX_PARTS, within):
                hashes, runs = timed(
                    "prefix records",
                    lambda: read_prefixes(view, ns.root, blocks.data.cast("B"), 4 * BLOCK),
                )
        ended = len(runs) == n
        if not ended:
            hashes = timed("chain hashes", lambda: ns.chain(toks))
        if way == "records":
            runs, ended = timed(
                "chain records",
                lambda: chain_records.read_runs(view, ns.root, hashes, blocks),
            )
        parent = runs[-1].chain_hash if runs else ns.root
        rest: list[chain.Header] = []
        if not ended:  # the headers past the records (all of them: the `headers` way)
            rest = timed("headers", lambda: chain.headers_after(view, parent, hashes, len(runs)))
        m = len(runs) + len(rest)
        if m != len(hashes):
            raise RuntimeError(f"matched {m} of {len(hashes)} blocks")
        timed(
            "end record",
            lambda: plan_end(
                view, ns.spec, ns.root, hashes, toks, m, BLOCK, m * BLOCK, bank.counters
            ),
        )
        timed("partial block", lambda: find_partial(view, ns.root, hashes, toks, m, BLOCK))
        parts["total"] = sum(parts.values())
    parts.update({f"in prefix records: {name}": s for name, s in within.items()})
    return parts


def run(workdir: Path, rounds: int, others: int, parts: bool) -> dict[str, Any]:
    """Build the bank and measure every length every way; returns the figures."""
    path = workdir / "bank"
    t0 = time.perf_counter()
    prompts = build(path, CASES, others)
    built_s = time.perf_counter() - t0
    samples: dict[tuple[tuple[int, int], str], list[float]] = {
        (c, w): [] for c in CASES for w in WAYS
    }
    hot: dict[tuple[tuple[int, int], str], list[float]] = {(c, w): [] for c in CASES for w in WAYS}
    phases: dict[str, dict[str, list[float]]] = {w: {} for w in WAYS}
    for r in range(rounds):
        order = WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]
        for case in CASES:
            for way in order:
                reopened, again = reopened_lookup(path, prompts[case], way, case[0])
                samples[(case, way)].append(reopened)
                hot[(case, way)].append(again)
        if parts:
            for way in order:
                for name, s in reopened_parts(path, prompts[(16384, 0)], way).items():
                    phases[way].setdefault(name, []).append(s)
    rows = []
    for case in CASES:
        med = {w: median(samples[(case, w)]) for w in WAYS}
        n, new = case
        row: dict[str, Any] = {"tokens": n, "new": new, "blocks": n // BLOCK}
        for w in WAYS:
            row[f"{w}_ms"] = 1e3 * med[w]
            row[f"hot_{w}_ms"] = 1e3 * median(hot[(case, w)])
            row[f"{w}_range_ms"] = _range_ms(samples[(case, w)])
            row[f"{w}_ratio"] = med[w] / med["prefixes"]
        rows.append(row)
    return {
        "rounds": rounds,
        "others": others,
        "build_s": built_s,
        "rows": rows,
        "parts_ms": {w: {k: 1e3 * median(v) for k, v in p.items()} for w, p in phases.items() if p},
    }


def _label(row: dict[str, Any]) -> str:
    """A row's tokens: stored, and `+new` for a next turn."""
    return f"{row['tokens']}+{row['new']}" if row["new"] else str(row["tokens"])


def _range_ms(xs: Sequence[float]) -> tuple[float, float]:
    return 1e3 * min(xs), 1e3 * max(xs)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the medians of a reopened restore's lookup: with prefix records, with chain
    records only, and with headers only."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.lookup", description=main.__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--others", type=int, default=256, help="other 1k-token prompts in the bank")
    p.add_argument("--parts", action="store_true", help="where a 16k-token lookup's time goes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cas_bank_lookup_") as tmp:
        out = run(Path(tmp), args.rounds, args.others, args.parts)
    print(
        f"lookup after a reopen, block size {BLOCK}, {args.others} other prompts in the bank, "
        f"medians of {args.rounds} rounds (ms)"
    )
    print(
        f"{'tokens':>11} {'blocks':>6} {'headers':>9} {'records':>9} {'prefixes (now)':>15} "
        f"{'headers/now':>12} {'records/now':>12} {'hot: headers':>13} {'records':>8} {'now':>7}"
    )
    for row in out["rows"]:
        print(
            f"{_label(row):>11} {row['blocks']:>6} {row['headers_ms']:>9.3f} "
            f"{row['records_ms']:>9.3f} {row['prefixes_ms']:>15.3f} "
            f"{row['headers_ratio']:>11.2f}x {row['records_ratio']:>11.2f}x "
            f"{row['hot_headers_ms']:>13.3f} {row['hot_records_ms']:>8.3f} "
            f"{row['hot_prefixes_ms']:>7.3f}"
        )
    for way, phases in out["parts_ms"].items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        print(f"  16k parts ({way}), ms: {shown}")
    if args.json:
        print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
