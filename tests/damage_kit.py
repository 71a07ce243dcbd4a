"""Banks damaged on disk, for the damage tests and the fault campaign (`tests/torture.py`).

`build` writes a real bank whose payloads live in BlobDB files (16 attention layers,
4-token blocks: 4 KiB a block); `family_tables` finds which table file holds which
family; `flip` overwrites bytes of a file; `check_bank` opens a damaged copy and
restores every prompt, checking each hit bit for bit against the prompt's own KV.
It returns what happened as one word, or raises AssertionError on wrong data.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
from conftest import attention_spec, kv_prefix_bits, layers_bits, prefix_layers, tokens_of

from cas_bank import Bank, BankConfig, CasBankError, ModelSpec
from cas_bank.maintenance.verify import verify

B = 4


def wide_spec() -> ModelSpec:
    spec = attention_spec("float16", n_layers=2)
    return ModelSpec(name="wide", layers=spec.layers * 8, weights_digest="w-wide")


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    """`n` prompts of 10 blocks; pairs share their first 4 blocks."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        head = tokens_of(np.random.default_rng([seed, i // 2]), 4 * B)
        out.append(head + tokens_of(rng, 6 * B))
    return out


def build(
    path: Path, spec: ModelSpec | None = None, n: int = 12, check: str | None = None
) -> list[list[int]]:
    spec = spec or wide_spec()
    ps = prompts(n)
    config = BankConfig(block_size=B, hot_bytes=0, payload_check=check)  # type: ignore[arg-type]
    with Bank.open(path, config) as bank:
        ns = bank.namespace(spec)
        for p in ps:
            ns.store(p, prefix_layers(spec, p))
    return ps


def family_tables(path: Path) -> dict[str, list[str]]:
    """Table files by family, matched by the sizes RocksDB reports for each family."""
    from rocksdict import AccessType, Rdict

    from cas_bank.blocks.damage import View

    view = View(path)
    try:
        db = Rdict(str(view.path), access_type=AccessType.read_only())
        sizes = {}
        for name in Rdict.list_cf(str(view.path)):
            v = db.get_column_family(name).property_int_value("rocksdb.total-sst-files-size")
            sizes[name] = int(v or 0)
        db.close()
    finally:
        view.close()
    out: dict[str, list[str]] = {}
    for table in sorted(path.glob("*.sst")):
        for name, size in sizes.items():
            if size == table.stat().st_size:
                out.setdefault(name, []).append(table.name)
    return out


def flip(file: Path, offset: int, n: int, seed: int) -> None:
    """Overwrite `n` bytes at `offset` (clamped into the file) with random ones."""
    size = file.stat().st_size
    offset = max(0, min(offset, size - n))
    rng = random.Random(seed)
    with file.open("r+b") as fh:
        fh.seek(offset)
        fh.write(bytes(rng.randrange(256) for _ in range(min(n, size))))


def flip_byte(file: Path, offset: int) -> None:
    """Invert the bits of the one byte at `offset`."""
    with file.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def check_bank(
    path: Path, ps: list[list[int]], spec: ModelSpec | None = None, *, full: bool = False
) -> str:
    """Open, restore every prompt (exact or a miss), verify. 'refused' when the bank
    does not open (a clear cas_bank error); otherwise 'hits=H corrupt=C verify=ok|bad'.
    `full`: every prompt was acknowledged as stored; 'LOST n' if n do not restore whole."""
    spec = spec or wide_spec()
    if full and not ps:
        return "hits=0 corrupt=0 verify=ok"
    try:
        bank = Bank.open(path, BankConfig(hot_bytes=0))
    except CasBankError as e:
        assert str(path) in str(e), e
        return "refused"
    with bank:
        ns = bank.namespace(spec)
        hits = lost = 0
        for p in ps:
            hit = ns.restore(p)
            if hit is not None:
                truth = kv_prefix_bits(prefix_layers(spec, p), spec, hit.tokens)
                assert layers_bits(hit.layers, spec) == truth, "a restore gave wrong data"
                hits += 1
            if full and (hit is None or hit.tokens != len(p) // B * B):
                lost += 1
        if lost:
            return f"LOST {lost}"
        try:
            report = "ok" if verify(bank).ok else "bad"
        except CasBankError:
            report = "error"
        return f"hits={hits} corrupt={bank.stats().corrupt_reads} verify={report}"


def restore_until(
    bank: Bank,
    spec: ModelSpec,
    prompt: list[int],
    started: threading.Event,
    stop: threading.Event,
    errors: list[str],
) -> None:
    """Restore `prompt` (all of it) in `spec`'s namespace until `stop` is set, on the
    caller's thread; what raises goes to `errors` as "module.Type: message"."""
    ns = bank.namespace(spec)
    while not stop.is_set():
        try:
            hit = ns.restore(prompt)
            assert hit is not None and hit.tokens == len(prompt)
        except Exception as e:
            errors.append(f"{type(e).__module__}.{type(e).__name__}: {e}")
        started.set()
