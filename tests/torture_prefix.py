"""The prompts of the fault campaign's background rounds (`tests/torture.py`), the digest
that says a restore is exact, and the check run on a bank after a round.

A child (`tests/torture_child.py`) stores prompts through `PrefixCache` and reports
each acknowledged one with the digest of what its runtime then held: the prompt's
tokens, the last token's logits and every cache array (`digest`). A restore is exact
when `restore_exact` of the prompt after reopening gives all of it with logits, and
the digest of that cache and those logits is the same, bit for bit.

Prompts (`prompt`): on the attention-only model, pairs share their first 1-3 blocks
(dedup, chains sharing a parent, partial blocks); none is a prefix of another. On the
hybrid model, and among a burst's long prompts, no two share a block: a prompt that
prefills again a block another one stored (the hybrid restores only up to a stored
state; a burst prefills before it stores) would restore the stored block's bits
beside its own, equal to its runtime's cache only within rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

MODELS = ("tiny-qwen3", "tiny-hybrid")
BLOCK = 64  # BankConfig's default block size: the banks are opened with defaults
VOCAB = 500  # below the tiny models' 512 ids
SOLO = 1_000_000  # the first index of the long prompts that share nothing


def prompt(model: str, seed: int, i: int) -> list[int]:
    """Prompt `i` of round `seed` for `model`: 40 to 700 tokens; from `SOLO` on, 1000
    to 2500 tokens that share no block with another prompt (a burst's: `torture_child`)."""
    rng = np.random.default_rng([seed, i, MODELS.index(model)])
    if i >= SOLO:
        return [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(1000, 2500)))]
    n = int(rng.integers(40, 700))
    if model != "tiny-qwen3":
        return [int(t) for t in rng.integers(1, VOCAB, n)]
    head = np.random.default_rng([seed, i // 2, 99])
    shared = int(head.integers(1, 4)) * BLOCK + int(head.integers(0, BLOCK))
    tail = max(n - shared, 8)
    return [int(t) for t in head.integers(1, VOCAB, shared)] + [
        int(t) for t in rng.integers(1, VOCAB, tail)
    ]


def digest(tokens: Sequence[int], logits: mx.array, cache: Sequence[Any]) -> str:
    """Blake3 over the tokens, the logits and what each cache entry holds (dtypes,
    shapes and bytes): equal digests mean bit-identical caches."""
    h = blake3.blake3(np.asarray(tokens, dtype=np.int64).tobytes())
    for a in [logits, *(a for entry in cache for a in held(entry))]:
        raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(np.array(raw)).tobytes())
    return h.hexdigest()[:32]


def held(entry: Any) -> list[Any]:
    """The arrays an mlx-lm cache entry holds: a KVCache's keys and values up to its
    offset (its buffers run past it), an ArraysCache's states."""
    if isinstance(entry, KVCache):
        keys: Any = entry.keys  # mlx-lm declares them None until the first update
        values: Any = entry.values
        return [keys[..., : entry.offset, :], values[..., : entry.offset, :]]
    if isinstance(entry, ArraysCache):
        return [a for a in entry.cache if a is not None]
    raise TypeError(f"no digest for a {type(entry).__name__}")


@cache
def loaded(model: str) -> Any:
    from cas_bank.runtime import build_model

    return build_model(model)


def restored_digest(pc: Any, tokens: list[int]) -> str | None:
    """The digest of `restore_exact(tokens)`, or None unless it covers them all with
    logits."""
    cache_, n, logits = pc.restore_exact(tokens)
    if n != len(tokens) or logits is None:
        return None
    return digest(tokens, logits, cache_)


def check_prefix_bank(path: Path, acked: Sequence[Sequence[Any]]) -> str:
    """Reopen the bank at `path` (default settings) and restore every acknowledged
    prompt (`[model, seed, i, digest]`). 'LOST n' when n do not restore whole, an
    AssertionError on a wrong restore, 'BAD n' when `verify` finds n problems, else
    'hits=H verify=ok'."""
    from cas_bank.runtime import PrefixCache

    from cas_bank import Bank
    from cas_bank.maintenance.verify import verify

    with Bank.open(path) as bank:
        caches = {m: PrefixCache(bank, loaded(m)) for m in MODELS}
        lost = 0
        for model, seed, i, want in acked:
            got = restored_digest(caches[model], prompt(model, seed, i))
            if got is None:
                lost += 1
                continue
            assert got == want, f"a restore gave wrong data: {model} round {seed} prompt {i}"
        if lost:
            return f"LOST {lost}"
        report = verify(bank)
        if report.problems:
            kinds = sorted({p.kind for p in report.problems})
            return f"BAD {len(report.problems)} {kinds}"
        return f"hits={len(acked)} verify=ok"
