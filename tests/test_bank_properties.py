"""Properties of the bank over random families of prompts that share prefixes.

For any N stored sequences:
- physical blocks == distinct full-block prefixes among them (dedup);
- `match(q)` == the longest common full-block prefix of q with any stored sequence;
- a restore covers exactly that and is bit-identical to q's own KV;
- storing the same tokens again writes nothing; stats count logical vs physical;
- hybrid: the restore point is the deepest matched boundary that has a stored state.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import blake3
import numpy as np
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    check_every_block,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    state_bits,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig, ModelSpec

B = BLOCK_SIZE
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def prompt_family(draw: st.DrawFn, max_n: int = 5) -> list[list[int]]:
    """Sequences that branch off earlier ones at random points (a tiny vocabulary
    makes accidental sharing likely too)."""
    vocab = st.integers(0, 2)
    seqs = [draw(st.lists(vocab, max_size=6 * B))]
    for _ in range(draw(st.integers(1, max_n - 1))):
        base = draw(st.sampled_from(seqs))
        cut = draw(st.integers(0, len(base)))
        seqs.append(base[:cut] + draw(st.lists(vocab, max_size=4 * B)))
    return seqs


def full_prefixes(seq: list[int]) -> set[tuple[int, ...]]:
    return {tuple(seq[: (i + 1) * B]) for i in range(len(seq) // B)}


def longest_shared_blocks(q: list[int], stored: list[list[int]]) -> int:
    """Full blocks of q that prefix some stored sequence."""
    best = 0
    for s in stored:
        n = 0
        while (n + 1) * B <= min(len(q), len(s)) and q[: (n + 1) * B] == s[: (n + 1) * B]:
            n += 1
        best = max(best, n)
    return best


def longest_shared_tokens(q: list[int], stored: list[list[int]]) -> int:
    """Tokens a restore of q covers: its full blocks that prefix a stored sequence, then
    the first tokens of the stored block after them that shares the most of q's next
    tokens (a partial block: attention KV is causal)."""
    base = longest_shared_blocks(q, stored) * B
    partial = 0
    for s in stored:
        if len(s) < base + B or s[:base] != q[:base]:
            continue  # no stored block of s follows q's matched chain
        child, after = s[base : base + B], q[base : base + B]
        pairs = enumerate(zip(child, after, strict=False))
        shared = next((i for i, (x, y) in pairs if x != y), None)
        partial = max(partial, min(len(child), len(after)) if shared is None else shared)
    return base + partial


@contextmanager
def fresh_bank() -> Iterator[Bank]:
    path = tempfile.mkdtemp(prefix="cas_bank_prop_")
    try:
        with Bank.open(path, BankConfig(block_size=B)) as bank:
            yield bank
    finally:
        shutil.rmtree(path, ignore_errors=True)


@SETTINGS
@given(
    seqs=prompt_family(), queries=st.lists(st.lists(st.integers(0, 2), max_size=7 * B), max_size=3)
)
def test_dedup_and_longest_prefix(seqs: list[list[int]], queries: list[list[int]]) -> None:
    spec = attention_spec()
    with fresh_bank() as bank:
        ns = bank.namespace(spec)
        seen: set[tuple[int, ...]] = set()
        for s in seqs:
            report = ns.store(s, prefix_layers(spec, s))
            new = full_prefixes(s) - seen
            assert report.blocks_written == len(new)
            assert report.blocks_existing == len(s) // B - len(new)
            seen |= new
        stats = bank.stats()
        assert stats.blocks == len(seen) == check_every_block(bank.store)
        assert stats.unique_tokens == len(seen) * B
        assert stats.logical_tokens == sum(len(s) // B * B for s in seqs)

        # Queries: the stored sequences themselves, branches off them, and random ones.
        for q in [
            *seqs,
            *(s[: len(s) // 2] + q for s, q in zip(seqs, queries, strict=False)),
            *queries,
        ]:
            want = longest_shared_tokens(q, seqs)
            assert ns.match(q) == want
            hit = ns.restore(q)
            if want == 0:
                assert hit is None
                continue
            assert hit is not None and hit.tokens == want
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(
                prefix_layers(spec, q), spec, want
            )

        before = bank.stats()
        for s in seqs:
            again = ns.store(s, prefix_layers(spec, s))
            assert (again.blocks_written, again.bytes_written) == (0, 0)
        after = bank.stats()
        assert (after.blocks, after.payload_bytes) == (before.blocks, before.payload_bytes)
        assert after.logical_tokens == 2 * before.logical_tokens


def state_for(spec: ModelSpec, prefix: list[int]) -> list[object]:
    """A state that depends only on the tokens before its boundary, as a model's does."""
    seed = int.from_bytes(blake3.blake3(np.array(prefix, dtype="<u4").tobytes()).digest()[:8])
    return random_state(spec, seed)


@SETTINGS
@given(seqs=prompt_family(max_n=4), data=st.data())
def test_hybrid_restore_point(seqs: list[list[int]], data: st.DataObject) -> None:
    spec = hybrid_spec()
    with fresh_bank() as bank:
        ns = bank.namespace(spec)
        with_state: set[tuple[int, ...]] = set()
        for s in seqs:
            bounds = range(B, len(s) // B * B + 1, B)
            chosen = data.draw(st.sets(st.sampled_from(bounds)) if bounds else st.just(set()))
            states = {b: state_for(spec, s[:b]) for b in chosen}
            ns.store(s, prefix_layers(spec, s), states)
            with_state |= {tuple(s[:b]) for b in chosen}
        assert bank.stats().states == len(with_state)
        check_every_block(bank.store)
        for q in seqs:
            matched = longest_shared_blocks(q, seqs)
            want = max(
                (b for b in range(B, matched * B + 1, B) if tuple(q[:b]) in with_state), default=0
            )
            assert ns.match(q) == want
            hit = ns.restore(q)
            if want == 0:
                assert hit is None
                continue
            assert hit is not None and hit.tokens == want
            assert layers_bits(hit.layers, spec) == kv_prefix_bits(
                prefix_layers(spec, q), spec, want
            )
            assert state_bits(hit.layers, spec) == state_bits(state_for(spec, q[:want]), spec)
