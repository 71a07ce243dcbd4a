"""Payloads kept in RocksDB (below the file tier's size, too small to read ahead),
read by multi-gets: each plain payload of the block layout is checked as the native
reader checks a file (its head, its digest) and those of one multi-get are copied into
the rows by one native call (`BlockFiles.holds`, `BlockFiles.copy_in`); others
(compressed) are decoded and put one by one. Bit-identical restores, a damaged payload
still ends the restore before it (counted, marked suspect), a raw payload from the hot
tier is checked too.

Real RocksDB under tmp_path and real MLX arrays; the native copy's calls are counted by
a spy that still copies. Without the native helper (CAS_BANK_PURE_PYTHON=1) the same
restores go the decoding way: the tests that count copies are skipped there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import kv_prefix_bits, layers_bits, prefix_layers, tokens_of
from test_bank_corruption import _corrupt

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks import codec
from cas_bank.blocks.store import Family
from cas_bank.index.chain import read_headers
from cas_bank.restore import row_runs

SMALL = 16  # tokens per block: 2 arrays x 16 tokens x 2 heads x 32 x fp16 = 4 KiB
native = pytest.mark.skipif(not row_runs.available(), reason="no native copy (pure Python)")


def _spec() -> ModelSpec:
    layer = LayerSpec.attention(kv_heads=2, head_dim=32, dtype="float16")
    return ModelSpec(name="small-copy", layers=(layer,), weights_digest="w-small-copy")


def _stored(bank_path: Path, n_blocks: int, zero_block: int | None = None) -> tuple[Any, ...]:
    """A chain of `n_blocks` small blocks stored in RocksDB (no payload files); block
    `zero_block`'s KV all zeros (its payload then compressed)."""
    spec = _spec()
    tokens = tokens_of(np.random.default_rng(43), n_blocks * SMALL)
    layers = prefix_layers(spec, tokens)
    if zero_block is not None:
        for a in layers[0]:
            a[..., zero_block * SMALL : (zero_block + 1) * SMALL, :] = 0
    with Bank.open(bank_path, BankConfig(block_size=SMALL, file_min_bytes=None)) as bank:
        chain = bank.namespace(spec).store(tokens, layers).chain
    return spec, tokens, layers, chain


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many payloads each native copy call takes (it still copies)."""
    calls: list[int] = []
    copy = row_runs.copy_payloads

    def counted(segments: bytes, body_at: int, indices: Any, *rest: Any, **options: Any) -> None:
        calls.append(len(indices))
        copy(segments, body_at, indices, *rest, **options)

    monkeypatch.setattr(row_runs, "copy_payloads", counted)
    return calls


@native
@pytest.mark.parametrize("hot_bytes", [0, 64 << 20])
def test_plain_payloads_are_copied_in_one_call_per_multi_get(
    bank_path: Path, hot_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, tokens, layers, _ = _stored(bank_path, 70)
    calls = _count_copies(monkeypatch)
    with Bank.open(bank_path, BankConfig(hot_bytes=hot_bytes)) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 70 * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 70 * SMALL)
        assert bank.stats().corrupt_reads == 0
    assert calls == [64, 6]


@pytest.mark.parametrize("hot_bytes", [0, 64 << 20])
def test_a_compressed_payload_among_plain_ones_is_decoded(
    bank_path: Path, hot_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, tokens, layers, chain = _stored(bank_path, 6, zero_block=2)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        sizes = [h.payload_size for h in read_headers(bank.store, chain) if h is not None]
    assert sizes[2] < sizes[0] == sizes[5]  # block 2 lz4, the others plain
    calls = _count_copies(monkeypatch)
    with Bank.open(bank_path, BankConfig(hot_bytes=hot_bytes)) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 6 * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 6 * SMALL)
    assert calls == ([5] if row_runs.available() else [])


# Where a payload is damaged: its body, its descriptors (covered by its check), its
# digest field (then not the header's), its last byte.
_DAMAGE = {
    "body": lambda n: n // 2,
    "descriptor": lambda n: codec.LEAD.size + 2,
    "digest": lambda n: codec.DIGEST_AT + 3,
    "last": lambda n: n - 1,
}


@pytest.mark.parametrize("where", list(_DAMAGE))
def test_a_damaged_payload_ends_the_restore_before_it(bank_path: Path, where: str) -> None:
    spec, tokens, layers, chain = _stored(bank_path, 6)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        value = bank.store.get(Family.BLOCKS, chain[3])
        assert value is not None
        bad = bytearray(value)
        bad[_DAMAGE[where](len(bad))] ^= 0x10
        bank.store.put_batch([(Family.BLOCKS, chain[3], bytes(bad))])
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 3 * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 3 * SMALL)
        assert bank.stats().corrupt_reads == 1
        assert chain[3] in bank.suspects.blocks()


def test_a_deleted_payload_ends_the_restore_before_it(bank_path: Path) -> None:
    spec, tokens, layers, chain = _stored(bank_path, 6)
    _corrupt(bank_path, Family.BLOCKS, chain[4], "delete")
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is not None and hit.tokens == 4 * SMALL
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 4 * SMALL)
        assert bank.stats().corrupt_reads == 1


def test_raw_payloads_from_the_hot_tier_are_checked_and_copied(bank_path: Path) -> None:
    """The first restore after a reopen leaves the payloads' bytes in the hot tier (not
    decoded); the next ones take them from there, checked again, into fresh arrays."""
    spec, tokens, layers, chain = _stored(bank_path, 6)
    want = kv_prefix_bits(layers, spec, 6 * SMALL)
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        ns = bank.namespace(spec)
        hits = []
        for _ in range(3):
            assert bank.leases is not None
            bank.leases.clear()  # the hot tier's payloads, not a lease of the last restore
            hit = ns.restore(tokens)
            assert hit is not None and layers_bits(hit.layers, spec) == want
            hits.append(hit)
        assert bank.stats().hot_hits == 2 * 6
        k0, k1 = hits[1].layers[0][0], hits[2].layers[0][0]  # type: ignore[index]
        assert k0 is not k1
        k0[..., :1, :] = 0  # fresh arrays each time: nothing shared between restores
        assert layers_bits(hits[2].layers, spec) == want
        # A hot raw payload damaged in memory is caught as one read from the store is.
        hot = bank.store
        entry = hot._entries[(Family.BLOCKS, chain[1])]  # type: ignore[attr-defined]
        bad = bytearray(entry.raw)
        bad[len(bad) // 2] ^= 0x01
        entry.raw, entry.decoded = bytes(bad), None
        bank.leases.clear()
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == SMALL
        assert bank.stats().corrupt_reads == 1


@native
@pytest.mark.parametrize("indices", [[0, 1, 2, 3], [5, 6, 7], [0, 2, 3, 70], [65, 66]])
def test_copy_runs_from_the_layout_table_are_those_made_from_the_segments(
    indices: list[int],
) -> None:
    """The runs placed from the table at address 0 (`_placed_payload_runs`) are the ones
    made from the placed segments (`_payload_runs`): views of other row sizes (steps),
    runs of blocks and blocks apart, past the table's first size. Addresses only: no
    copy is made."""
    shapes = [(1, 2, 80 * SMALL, 32), (1, 3, 80 * SMALL, 8)]
    runs = row_runs.contiguous_row_runs(shapes, [2, 4], [SMALL, SMALL])
    assert runs is not None
    addresses = np.array([1 << 20, 1 << 30], dtype=np.int64)
    segments = row_runs.placed(runs, addresses)
    sources = [(1 << 40) + (1 << 24) * j for j in range(len(indices))]
    made = row_runs._payload_runs(segments, 72, indices, sources)
    placed = row_runs._placed_payload_runs(runs, addresses, 72, indices, sources)
    assert made.tobytes() == placed
    assert len(made.reshape(-1, 3)) == len(indices) * (2 + 3)


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-qwen3"])
def test_a_reopened_restore_of_small_payloads_prefills_the_same_logits(
    bank_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real tiny model's blocks, all kept in RocksDB, restored after a reopen with no
    hot tier (read from the store, checked and copied in as above; the hybrid's state
    read on its own): the prefill after it gives bit-identical logits to the same
    forward passes without the bank."""
    from cas_bank.runtime import PrefixCache
    from runtime_helpers import bit_equal, random_tokens, same_schedule_logits, tiny

    lm = tiny(name)
    rng = np.random.default_rng(9)
    a = random_tokens(rng, 70)
    b = [*a, *random_tokens(rng, 20)]
    with Bank.open(bank_path, BankConfig(block_size=SMALL, file_min_bytes=None)) as bank:
        pc = PrefixCache(bank, lm, chunk_size=32)
        cache, n0 = pc.restore(a)
        pc.prefill(a, cache, n0, end=False)
        bank.flush()
        stored = pc.last_prefill
        assert stored is not None
    calls = _count_copies(monkeypatch)
    with Bank.open(bank_path, BankConfig(file_min_bytes=None, hot_bytes=0)) as bank:
        pc = PrefixCache(bank, lm, chunk_size=32)
        cache, n = pc.restore(b)
        assert n == 64
        logits = pc.prefill(b, cache, n, store=False)
        report = pc.last_prefill
        assert report is not None
        reference = same_schedule_logits(pc, a, stored.chunk_ends, b, n, report.chunk_ends)
        assert bit_equal(logits, reference)
        assert bank.stats().corrupt_reads == 0
    assert calls == ([4] if row_runs.available() else [])
