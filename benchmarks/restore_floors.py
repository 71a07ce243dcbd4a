"""A restore case's floors and side measurements (`benchmarks.restore`): the machine's
floors on the case's own bytes, the hot restore's copy alone, a reopened restore's own
parts, and the background store's samples (the first token's forward pass alone is
timed in the restore's own rounds: `benchmarks.restore._forward_alone`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache

from benchmarks.ceilings import (
    blake3_floor_samples,
    file_read_samples,
    layout_copy_samples,
    median,
    memcpy_samples,
    raw_read_samples,
)
from benchmarks.ttft import eval_cache
from cas_bank import Bank, BankConfig
from cas_bank.arrays import to_numpy
from cas_bank.blocks.store import Family

if TYPE_CHECKING:
    from benchmarks.restore import RestoreCase, RestoreSettings


def first_token(pc: PrefixCache, cache: list[Any], token: int) -> None:
    """The first prefill chunk after a restore: one token through the model, evaluated;
    then the refill the restore held starts, as `PrefixCache.prefill` lets it."""
    mx.eval(pc.model(mx.array([[token]]), cache=cache))
    pc.bank.resources.release()


def case_floors(case: RestoreCase, s: RestoreSettings) -> dict[str, Any]:
    """The machine's floors on the case's bytes: memcpy (one and two threads), the
    plain and the verified read of its payload files (RocksDB's own read where they are
    kept there), and the same files checked by blake3."""
    nb = case.length // s.block_size
    path, keys = case.path, case.keys
    files = [_payload_file(path, Family.BLOCKS, k) for k in keys[:nb]]
    if case.hybrid:
        files.append(_payload_file(path, Family.STATES, keys[nb - 1]))
    on_disk = [f for f in files if f is not None]  # small payloads stay in RocksDB
    mem_t = memcpy_samples(case.nbytes, max(7, s.repeats))
    mem2_t = memcpy_samples(case.nbytes, max(7, s.repeats), threads=2)
    if len(on_disk) == len(files):
        copy_t = file_read_samples(on_disk, s.repeats, verified=False)
        floor_t = file_read_samples(on_disk, s.repeats, verified=True)
        blake3_floor_t = blake3_floor_samples(on_disk, path.parent / "blake3-floor", s.repeats)
    else:  # payloads below the file tier's size (the smoke test's): RocksDB's own read
        keys_by_family = {Family.BLOCKS: list(keys[:nb])}
        if case.hybrid:
            keys_by_family[Family.STATES] = [keys[nb - 1]]
        copy_t = raw_read_samples(path, keys_by_family, s.repeats)[0]
        floor_t = [c + median(mem_t) for c in copy_t]
        blake3_floor_t = floor_t
    return {
        "file_copy_s": median(copy_t),
        "verified_floor_s": median(floor_t),
        "blake3_floor_s": median(blake3_floor_t),  # the same files checked by blake3
        "floor_bytes": sum(f.stat().st_size for f in on_disk),
        "memcpy_s": median(mem_t),
        "memcpy_2_threads_s": median(mem2_t),
    }


def store_later_samples(
    base: Path, lm: Any, tokens: np.ndarray, cache: list[Any], states: Any, s: RestoreSettings
) -> list[tuple[float, float]]:
    """(caller's seconds, seconds until flushed) of `store_later` of every block new, into
    an empty bank with a background writer, one bank per repeat (the open untimed)."""
    out = []
    for r in range(max(3, s.repeats // 2)):
        with Bank.open(base / str(r), BankConfig(block_size=s.block_size, write_behind=4)) as bank:
            pc = PrefixCache(bank, lm)
            t0 = time.perf_counter()
            pending = pc.store_later(tokens, cache, states)
            caller = time.perf_counter() - t0
            bank.flush()
            out.append((caller, time.perf_counter() - t0))
            if pending.result().blocks_written != len(tokens) // s.block_size:
                raise RuntimeError("store_later wrote fewer blocks than the prompt holds")
        shutil.rmtree(base / str(r))
    return out


def hot_copy_floor(
    pc: PrefixCache, prompt: np.ndarray, length: int, s: RestoreSettings
) -> list[float]:
    """`layout_copy_samples` of the attention arrays a hot restore with room copies:
    `length` tokens of each, into arrays of the capacity that restore allocates."""
    restored, _ = pc.restore(prompt)
    eval_cache(restored)
    sources = [
        np.ascontiguousarray(to_numpy(a)[..., :length, :])
        for entry in restored
        if getattr(entry, "keys", None) is not None
        for a in (entry.keys, entry.values)
    ]
    capacity = int(restored[pc.spec.attention_layers[0]].keys.shape[-2])
    del restored
    return layout_copy_samples(sources, capacity, max(7, s.repeats))


def _payload_file(bank: Path, family: Family, key: bytes) -> Path | None:
    """The payload file of `key` in the bank's file tier, or None (kept in RocksDB)."""
    found = sorted((bank / "payloads" / family.value).glob(f"{key.hex()}.*"))
    return found[0] if found else None


def reopened_stages(
    path: Path, lm: Any, prompt: np.ndarray, s: RestoreSettings
) -> dict[str, float]:
    """Medians of a reopened restore's own timings (`Hit.timings`: lookup, allocate,
    fill, total), each restore after opening the bank as the reopened way does (its
    start-up work done: `settle`), with the room a runtime asks for."""
    got: dict[str, list[float]] = {"lookup": [], "allocate": [], "fill": [], "total": []}
    for _ in range(s.repeats):
        with Bank.open(path, BankConfig(block_size=s.block_size)) as bank:
            ns = PrefixCache(bank, lm).namespace
            bank.resources.settle()  # its spares made ahead (`Spares.make_ahead`)
            hit = ns.restore(prompt[:-1], room_for=len(prompt))
            if hit is None or hit.timings is None:
                raise RuntimeError(f"{path}: a reopened restore found nothing")
            for part, seconds in got.items():
                seconds.append(getattr(hit.timings, f"{part}_s"))
            del hit
    return {k: median(v) for k, v in got.items()}
