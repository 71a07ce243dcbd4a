"""Review of the small-payload copy (199bf65): payloads kept in RocksDB, checked by
`BlockFiles.holds` and copied into their rows by one native call a multi-get, must
restore the very bytes stored, for every layout a bank keeps, and a damaged one must end
the restore before it exactly as the decoding path did (counted, marked suspect).

Layouts: float32, float16, bfloat16 KV, keys and values of different widths,
quantized KV (4 and 8 bits: packed uint32, bf16 scales and biases), a hybrid model
(recurrent states beside bf16 KV); an lz4 block among plain ones in one multi-get; both
checks (XXH3-128, blake3); an end record's tail after the copied blocks; with and
without room; the hot tier's raw bytes and RocksDB's. Under CAS_BANK_PURE_PYTHON=1 the
same restores go the decoding way and must give the same answers.

Real RocksDB under tmp_path and real MLX arrays; the native copy is counted by a spy
that still copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    flat_arrays,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    state_bits,
    tokens_of,
)

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks import codec
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.index.chain import read_headers
from cas_bank.index.header import Header
from cas_bank.restore import row_runs

B = 16  # tokens a block: every payload here is far below the read-ahead's 256 KiB
N_BLOCKS = 7
TAIL = 5  # tokens after the last full block, kept by the end record
ZERO_BLOCK = 3  # its KV all zeros: its payload is lz4-compressed


def _attention(dtype: str, v_dim: int | None = None) -> ModelSpec:
    layer = LayerSpec.attention(kv_heads=2, head_dim=32, dtype=dtype, v_head_dim=v_dim)
    return ModelSpec(name=f"rv-{dtype}-{v_dim}", layers=(layer, layer), weights_digest="w-rv")


def _quantized(bits: int) -> ModelSpec:
    layer = LayerSpec.quantized_attention(
        kv_heads=2, head_dim=64, dtype="bfloat16", group_size=32, bits=bits
    )
    return ModelSpec(name=f"rv-q{bits}", layers=(layer, layer), weights_digest="w-rv")


def _hybrid() -> ModelSpec:
    gdn = LayerSpec.recurrent([((1, 3, 24), "bfloat16"), ((1, 2, 4, 4), "float32")])
    att = LayerSpec.attention(kv_heads=2, head_dim=32, dtype="bfloat16")
    return ModelSpec(name="rv-hybrid", layers=(gdn, att, gdn, att), weights_digest="w-rv")


SPECS = {
    "float32": _attention("float32"),
    "float16": _attention("float16"),
    "bfloat16": _attention("bfloat16"),
    "v-wider": _attention("float16", v_dim=48),
    "q4": _quantized(4),
    "q8": _quantized(8),
    "hybrid": _hybrid(),
}


def _zeroed(layers: list[Any], block: int) -> list[Any]:
    """`layers` with every attention array's rows of `block` zero (in place)."""
    for layer in layers:
        if layer is None:
            continue
        for a in flat_arrays(layer):
            a[..., block * B : (block + 1) * B, :] = 0
            mx.eval(a)
    return layers


def _stored(bank_path: Path, spec: ModelSpec, check: str) -> tuple[Any, ...]:
    """A chain of N_BLOCKS blocks and an end record of TAIL tokens after them, all kept
    in RocksDB (no payload files); a hybrid model's state at the last boundary and at
    the end."""
    tokens = tokens_of(np.random.default_rng(7), N_BLOCKS * B + TAIL)
    layers = _zeroed(prefix_layers(spec, tokens), ZERO_BLOCK)
    boundary = random_state(spec, 1) if spec.is_hybrid else None
    end_state = random_state(spec, 2) if spec.is_hybrid else None
    config = BankConfig(block_size=B, file_min_bytes=None, payload_check=check)  # type: ignore[arg-type]
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(spec)
        states = {N_BLOCKS * B: boundary} if boundary is not None else None
        chain = ns.store(tokens, layers, states).chain
        ns.store_end(tokens, layers, end_state)
        sizes = [h.payload_size for h in read_headers(bank.store, chain) if h is not None]
    assert sizes[ZERO_BLOCK] < sizes[0] == sizes[-1]  # one lz4 payload among plain ones
    return tokens, layers, chain, boundary, end_state


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    copy = row_runs.copy_payloads

    def counted(segments: bytes, body_at: int, blocks: Any, *rest: Any, **options: Any) -> None:
        calls.append(len(blocks))
        copy(segments, body_at, blocks, *rest, **options)

    monkeypatch.setattr(row_runs, "copy_payloads", counted)
    return calls


def _first_rows(hit: Any, spec: ModelSpec) -> list[list[bytes]]:
    """The restored attention arrays' first `hit.tokens` rows (a restore with room
    hands out more)."""
    n = hit.tokens
    return kv_prefix_bits(hit.layers, spec, n)


@pytest.mark.parametrize("hot_bytes", [0, 64 << 20])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_layout_restores_the_stored_bytes(
    bank_path: Path, name: str, hot_bytes: int, check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS[name]
    tokens, layers, _, boundary, end_state = _stored(bank_path, spec, check)
    calls = _count_copies(monkeypatch)
    other = [*tokens[: N_BLOCKS * B], *[t + 1 for t in tokens[N_BLOCKS * B :]]]
    with Bank.open(bank_path, BankConfig(hot_bytes=hot_bytes)) as bank:
        ns = bank.namespace(spec)
        for round_ in range(3):  # the last two from the hot tier's raw bytes, if any
            for prompt, room, want_tokens, state in (
                (tokens, 0, len(tokens), end_state),
                (tokens, len(tokens) + 40, len(tokens), end_state),
                (other, 0, N_BLOCKS * B, boundary),
                (other, len(other) + 300, N_BLOCKS * B, boundary),
            ):
                if bank.leases is not None:  # payloads read each time, not a lease's
                    bank.leases.clear()
                hit = ns.restore(prompt, room_for=room)
                assert hit is not None and hit.tokens == want_tokens, (round_, room)
                assert _first_rows(hit, spec) == kv_prefix_bits(layers, spec, want_tokens)
                if room == 0:
                    assert layers_bits(hit.layers, spec) == kv_prefix_bits(
                        layers, spec, want_tokens
                    )
                if state is not None:
                    assert state_bits(hit.layers, spec) == state_bits(state, spec)
        assert bank.stats().corrupt_reads == 0
    if row_runs.available():  # the six plain blocks of a restore copied by one call
        assert calls and set(calls) == {N_BLOCKS - 1}
    else:
        assert calls == []


@pytest.mark.parametrize("name", ["float16", "q4"])
def test_a_partial_block_after_the_copied_blocks(bank_path: Path, name: str) -> None:
    """A prompt that leaves the stored chain 7 tokens into block 5: blocks 0-4 copied
    in, block 5's first 7 tokens (decoded) put after them."""
    spec = SPECS[name]
    tokens, layers, _, _, _ = _stored(bank_path, spec, "xxh3")
    shared = 5 * B + 7
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        for room in (0, 500):
            hit = bank.namespace(spec).restore([*tokens[:shared], 999_999], room_for=room)
            assert hit is not None and hit.tokens == shared and hit.partial == 7
            assert _first_rows(hit, spec) == kv_prefix_bits(layers, spec, shared)
        assert bank.stats().corrupt_reads == 0


def test_leased_blocks_before_and_multi_gets_past_the_first_table(
    bank_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first 3 blocks from a lease, blocks 3.. from RocksDB: multi-gets of 64 from
    block 3 (runs of blocks that start past 0 and end past the first table's 64), one
    lz4 block among them (blocks apart)."""
    spec = SPECS["float16"]
    n_blocks = 140
    tokens = tokens_of(np.random.default_rng(9), n_blocks * B)
    layers = _zeroed(prefix_layers(spec, tokens), 100)
    config = BankConfig(block_size=B, file_min_bytes=None)
    with Bank.open(bank_path, config) as bank:
        bank.namespace(spec).store(tokens, layers)
    calls = _count_copies(monkeypatch)
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        ns = bank.namespace(spec)
        short = ns.restore(tokens[: 3 * B])  # exact arrays: leased
        assert short is not None and short.tokens == 3 * B
        for room in (len(tokens) + 10, 0):  # with room first: it leases nothing
            hit = ns.restore([*tokens, 1], room_for=room)
            assert hit is not None and hit.tokens == len(tokens)
            assert _first_rows(hit, spec) == kv_prefix_bits(layers, spec, len(tokens))
        assert bank.stats().corrupt_reads == 0
    if row_runs.available():
        # the short restore's 3; then blocks 3-66, 67-130 less the lz4 one, 131-139
        assert calls == [3, 64, 63, 9, 64, 63, 9]


@pytest.mark.parametrize("spare_bytes", [0, 1 << 30])
def test_unfilled_and_spare_destinations_hold_the_stored_bytes(
    bank_path: Path, spare_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Destinations of 4 MiB ([1, 8, 2048, 64] float32 with room), over
    `UNFILLED_FROM`: made unfilled (no spares) or taken from the spares (zeroed off the
    path), then filled by the small payloads' copy; every row handed out is a stored
    one."""
    from cas_bank.restore import destinations

    layer = LayerSpec.attention(kv_heads=8, head_dim=64, dtype="float32")
    spec = ModelSpec(name="rv-big-dest", layers=(layer,), weights_digest="w-rv")
    tokens = tokens_of(np.random.default_rng(4), 20 * B)
    layers = prefix_layers(spec, tokens)
    config = BankConfig(block_size=B, file_min_bytes=None)
    with Bank.open(bank_path, config) as bank:
        bank.namespace(spec).store(tokens, layers)
    made_unfilled: list[int] = []
    unfilled = destinations.unfilled

    def counted(wanted: Any) -> Any:
        made_unfilled.append(len(wanted))
        return unfilled(wanted)

    monkeypatch.setattr(destinations, "unfilled", counted)
    want = kv_prefix_bits(layers, spec, len(tokens))
    with Bank.open(bank_path, BankConfig(hot_bytes=0, spare_bytes=spare_bytes)) as bank:
        ns = bank.namespace(spec)
        for _ in range(4):
            hit = ns.restore([*tokens, 7], room_for=2000)
            assert hit is not None and hit.tokens == len(tokens)
            assert _first_rows(hit, spec) == want
            bank.resources.spares.settle()
        assert bank.stats().corrupt_reads == 0
    # Unfilled each time without spares; with them, only the first restore's.
    assert made_unfilled == ([2] * 4 if spare_bytes == 0 else [2])  # keys, values


# -- damage ------------------------------------------------------------------------
_LEAD = codec.LEAD
_DAMAGED_AT = 5  # the block damaged (plain, after the lz4 one)


def _flip(at: int) -> Any:
    def damage(value: bytes) -> bytes:
        bad = bytearray(value)
        bad[at if at >= 0 else len(bad) + at] ^= 0x01
        return bytes(bad)

    return damage


DAMAGE = {
    "magic": _flip(0),
    "version": _flip(4),
    "flags": _flip(5),
    "n_arrays": _flip(6),
    "body_len": _flip(8),
    "raw_len": _flip(16),
    "digest-first": _flip(codec.DIGEST_AT),
    "digest-tag": _flip(codec.DIGEST_AT + 20),
    "descriptor-dtype": _flip(_LEAD.size),
    "descriptor-dim": _flip(_LEAD.size + 2),
    "body-first": None,  # set per layout below: the body's first byte
    "body-middle": lambda v: _flip(len(v) // 2)(v),
    "body-last": _flip(-1),
    "truncated": lambda v: v[:-1],
    "one-byte-longer": lambda v: v + b"\0",
    "no-lead": lambda v: v[: _LEAD.size - 1],
    "empty": lambda v: b"",
}


def _body_at(value: bytes) -> int:
    body_len = int(_LEAD.unpack_from(value)[4])
    return len(value) - body_len


@pytest.mark.parametrize("where", list(DAMAGE))
@pytest.mark.parametrize(
    ("name", "payload_check"), [("q4", "xxh3"), ("float16", "blake3"), ("hybrid", "xxh3")]
)
def test_a_damaged_payload_ends_the_restore_before_it(
    bank_path: Path, name: str, payload_check: str, where: str
) -> None:
    """Restores of the prompt (its end record's tail after block 6) and of another one
    that leaves it after the blocks; each read of the damaged block 5 is counted and
    marks it suspect, from RocksDB and then from the hot tier's raw bytes."""
    spec = SPECS[name]
    tokens, layers, chain, _, _ = _stored(bank_path, spec, payload_check)
    with RocksStore(bank_path) as raw:
        value = raw.get(Family.BLOCKS, chain[_DAMAGED_AT])
        assert value is not None
        damage = DAMAGE[where] or _flip(_body_at(value))
        raw.put_batch([(Family.BLOCKS, chain[_DAMAGED_AT], damage(value))])
    reads = 0
    with Bank.open(bank_path, BankConfig(hot_bytes=64 << 20)) as bank:
        ns = bank.namespace(spec)
        for _ in range(2):  # the second: the damaged bytes from the hot tier
            for prompt in (tokens, [*tokens[: N_BLOCKS * B], 999_999]):
                if bank.leases is not None:
                    bank.leases.clear()
                hit = ns.restore(prompt)
                reads += 1
                if spec.is_hybrid:  # no state below the damage: nothing to resume from
                    assert hit is None or hit.tokens == 0
                else:
                    assert hit is not None and hit.tokens == _DAMAGED_AT * B
                    want = kv_prefix_bits(layers, spec, hit.tokens)
                    assert layers_bits(hit.layers, spec) == want
                assert bank.stats().corrupt_reads == reads, where
                assert chain[_DAMAGED_AT] in bank.suspects.blocks()


def test_a_payload_of_another_layer_count_under_a_matching_header(
    bank_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A payload that verifies, whose digest is its header's, but holds one layer's
    arrays (another model's layout): the restore ends before it, counted, suspect."""
    spec = SPECS["float16"]
    tokens, layers, chain, _, _ = _stored(bank_path, spec, "xxh3")
    one_layer = ModelSpec(name="rv-one", layers=spec.layers[:1], weights_digest="w-rv")
    with Bank.open(bank_path / "other", BankConfig(block_size=B, file_min_bytes=None)) as other:
        other_chain = other.namespace(one_layer).store(tokens, layers[:1]).chain
        foreign = other.store.get(Family.BLOCKS, other_chain[_DAMAGED_AT])
    assert foreign is not None
    with RocksStore(bank_path) as raw:
        key = chain[_DAMAGED_AT]
        stored = raw.get(Family.HEADERS, key)
        assert stored is not None
        header = Header.decode(key, stored)._replace(
            payload_digest=codec.digest_field(foreign), payload_size=len(foreign)
        )
        # The chain and prefix records copy headers: dropped, the lookup reads this one.
        copies = [(f, k, None) for f in (Family.CHAINS, Family.PREFIXES) for k in raw.keys(f)]
        rewritten = [(Family.HEADERS, key, header.encode()), (Family.BLOCKS, key, foreign)]
        raw.put_batch([*copies, *rewritten])
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(spec).restore([*tokens[: N_BLOCKS * B], 999_999])
        assert hit is not None and hit.tokens == _DAMAGED_AT * B
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        assert bank.stats().corrupt_reads == 1
        assert chain[_DAMAGED_AT] in bank.suspects.blocks()
    assert "block holds 2 arrays, expected 4" in caplog.text  # refused for its layout


# -- two threads -------------------------------------------------------------------
def test_restoring_threads_beside_a_writer_get_the_stored_bytes(bank_path: Path) -> None:
    """Payloads of 192 KiB (below the read-ahead's 256 KiB): a multi-get of 30 is copied
    by this thread and the native partner (over 4 MiB); two threads restore at once
    (one finds the partner busy) while a third stores other chains."""
    import threading

    layer = LayerSpec.attention(kv_heads=6, head_dim=128, dtype="float32")
    spec = ModelSpec(name="rv-wide", layers=(layer, layer), weights_digest="w-rv")
    tokens = tokens_of(np.random.default_rng(11), 30 * B)
    layers = prefix_layers(spec, tokens)
    want = kv_prefix_bits(layers, spec, len(tokens))
    config = BankConfig(block_size=B, file_min_bytes=None, compression="none")
    with Bank.open(bank_path, config) as bank:
        bank.namespace(spec).store(tokens, layers)
    calls: list[int] = []
    with Bank.open(bank_path, BankConfig(hot_bytes=256 << 20, compression="none")) as bank:
        ns = bank.namespace(spec)
        bad: list[str] = []

        def restore(rounds: int) -> None:
            for _ in range(rounds):
                hit = ns.restore(tokens, room_for=len(tokens) + 1)
                if hit is None or hit.tokens != len(tokens):
                    bad.append(f"short hit {hit and hit.tokens}")
                elif kv_prefix_bits(hit.layers, spec, len(tokens)) != want:
                    bad.append("wrong bytes")

        def write() -> None:
            rng = np.random.default_rng(5)
            for _ in range(4):
                other = tokens_of(rng, 4 * B)
                ns.store(other, prefix_layers(spec, other))

        copy = row_runs.copy_payloads

        def counted(segments: bytes, body_at: int, blocks: Any, *rest: Any, **kw: Any) -> None:
            calls.append(len(blocks))
            copy(segments, body_at, blocks, *rest, **kw)

        row_runs.copy_payloads = counted  # type: ignore[assignment]
        try:
            threads = [threading.Thread(target=restore, args=(12,)) for _ in range(2)]
            threads.append(threading.Thread(target=write))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            row_runs.copy_payloads = copy
        assert bad == []
        assert bank.stats().corrupt_reads == 0
    if row_runs.available():
        assert calls and set(calls) == {30}
