"""Corruption: payloads flipped, truncated or deleted, and damage in RocksDB's own
files, are counted misses (never wrong data, never an exception), and a later store heals.

Real RocksDB under tmp_path and real MLX arrays. KV comes from `prefix_layers`, which
makes the vector at position t depend only on tokens[: t + 1] (as a model's does),
so every restore is checked bit for bit against the prompt's own KV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    check_every_block,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    state_bits,
    tokens_of,
)

from cas_bank import (
    Bank,
    BankConfig,
    CorruptDataError,
    ModelSpec,
)
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header

B = BLOCK_SIZE


# -- corruption -------------------------------------------------------------------
def _corrupt(bank_path: Path, family: Family, key: bytes, how: str) -> None:
    with RocksStore(bank_path) as raw:
        value = raw.get(family, key)
        assert value is not None
        if how == "flip":
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 0x40
            raw.put_batch([(family, key, bytes(bad))])
        elif how == "truncate":
            raw.put_batch([(family, key, value[: len(value) // 3])])
        else:
            raw.put_batch([(family, key, None)])


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_corrupt_payload_is_a_counted_miss_and_heals(
    bank_path: Path, attn_spec: ModelSpec, how: str, check: str
) -> None:
    tokens = tokens_of(np.random.default_rng(15), 4 * B)
    layers = prefix_layers(attn_spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B, payload_check=check)) as bank:
        chain = bank.namespace(attn_spec).store(tokens, layers).chain
    _corrupt(bank_path, Family.BLOCKS, chain[2], how)
    with Bank.open(bank_path) as bank:
        ns = bank.namespace(attn_spec)
        hit = ns.restore(tokens)  # no exception, and nothing from block 2 on
        assert hit is not None and hit.tokens == 2 * B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(layers, attn_spec, 2 * B)
        assert bank.stats().corrupt_reads == 1
        healed = ns.store(tokens, layers)
        assert healed.blocks_written == 1
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 4 * B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(layers, attn_spec, 4 * B)
        s = bank.stats()
        assert (s.corrupt_reads, s.blocks) == (1, 4)
        check_every_block(bank.store)


def test_corrupt_first_block_is_a_miss(bank_path: Path, attn_spec: ModelSpec, check: str) -> None:
    tokens = tokens_of(np.random.default_rng(16), 2 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, payload_check=check)) as bank:
        chain = bank.namespace(attn_spec).store(tokens, prefix_layers(attn_spec, tokens)).chain
    _corrupt(bank_path, Family.BLOCKS, chain[0], "flip")
    with Bank.open(bank_path) as bank:
        assert bank.namespace(attn_spec).restore(tokens) is None
        s = bank.stats()
        assert (s.corrupt_reads, s.misses, s.hits) == (1, 1, 0)


def test_corrupt_state_steps_back_to_an_intact_one(
    bank_path: Path, hyb_spec: ModelSpec, check: str
) -> None:
    tokens = tokens_of(np.random.default_rng(17), 4 * B)
    layers = prefix_layers(hyb_spec, tokens)
    states = {B: random_state(hyb_spec, 1), 3 * B: random_state(hyb_spec, 3)}
    with Bank.open(bank_path, BankConfig(block_size=B, payload_check=check)) as bank:
        chain = bank.namespace(hyb_spec).store(tokens, layers, states).chain
    _corrupt(bank_path, Family.STATES, chain[2], "flip")
    with Bank.open(bank_path) as bank:
        ns = bank.namespace(hyb_spec)
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[B], hyb_spec)
        assert layers_bits(hit.layers, hyb_spec) == kv_prefix_bits(layers, hyb_spec, B)
        assert bank.stats().corrupt_reads == 1
        report = ns.store(tokens, layers, {3 * B: states[3 * B]})  # heals the state
        assert (report.states_written, report.blocks_written) == (1, 0)  # the state alone
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 3 * B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[3 * B], hyb_spec)
        assert bank.stats().states == 2


def test_corrupt_block_below_a_state_steps_back(
    bank_path: Path, hyb_spec: ModelSpec, check: str
) -> None:
    tokens = tokens_of(np.random.default_rng(18), 4 * B)
    layers = prefix_layers(hyb_spec, tokens)
    states = {B: random_state(hyb_spec, 1), 4 * B: random_state(hyb_spec, 4)}
    with Bank.open(bank_path, BankConfig(block_size=B, payload_check=check)) as bank:
        chain = bank.namespace(hyb_spec).store(tokens, layers, states).chain
    _corrupt(bank_path, Family.BLOCKS, chain[2], "flip")
    with Bank.open(bank_path) as bank:
        hit = bank.namespace(hyb_spec).restore(tokens)
        assert hit is not None and hit.tokens == B
        assert state_bits(hit.layers, hyb_spec) == state_bits(states[B], hyb_spec)


# -- damage below the bank: bytes flipped in RocksDB's own files -------------------
def _flip_file(path: Path, start: float, stop: float, step: int) -> None:
    size = path.stat().st_size
    with path.open("r+b") as fh:
        for off in range(int(size * start), int(size * stop), step):
            fh.seek(off)
            c = fh.read(1)
            fh.seek(off)
            fh.write(bytes([c[0] ^ 0xFF]))


def _bank_on_disk(bank_path: Path, spec: ModelSpec, tokens: list[int], check: str = "xxh3") -> None:
    config = BankConfig(block_size=B, hot_bytes=0, file_min_bytes=None, payload_check=check)
    with Bank.open(bank_path, config) as bank:
        bank.namespace(spec).store(tokens, prefix_layers(spec, tokens))


def test_damaged_blob_file_is_a_counted_miss(bank_path: Path, check: str) -> None:
    """Payload reads skip RocksDB's checksum: our digest catches the damage."""
    spec = attention_spec("float16", n_layers=2)
    spec = ModelSpec(name="wide", layers=spec.layers * 8, weights_digest="w-wide")
    tokens = tokens_of(np.random.default_rng(20), 4 * B)
    _bank_on_disk(bank_path, spec, tokens, check)
    blobs = list(bank_path.glob("*.blob"))
    assert blobs, "payloads are expected in BlobDB files"
    for blob in blobs:
        _flip_file(blob, 0.5, 1.0, 97)
    with Bank.open(bank_path) as bank:
        hit = bank.namespace(spec).restore(tokens)
        assert hit is None or hit.tokens < 4 * B
        assert bank.stats().corrupt_reads == 1


def test_damaged_table_files_raise_corrupt_data_not_locked(bank_path: Path, tmp_path: Path) -> None:
    """RocksDB's own checksums guard the small families: damage there is reported as
    `CorruptDataError` naming the bank (at open or on read), never as a lock."""
    import shutil

    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(21), 4 * B)
    _bank_on_disk(bank_path, spec, tokens)
    tables = sorted(bank_path.glob("*.sst"))
    assert tables
    for table in tables:
        copy = tmp_path / f"copy-{table.stem}"
        shutil.copytree(bank_path, copy)
        _flip_file(copy / table.name, 0.0, 0.34, 7)
        try:
            with Bank.open(copy) as bank:
                bank.namespace(spec).restore(tokens)
        except CorruptDataError as e:
            assert str(copy) in str(e)


def test_a_damaged_partial_child_restores_exactly_its_whole_blocks(
    bank_path: Path, attn_spec: ModelSpec
) -> None:
    """The partial child's payload fails its check: the restore falls back to the
    whole blocks, and its arrays hold exactly `hit.tokens` tokens (none unwritten)."""
    tokens = tokens_of(np.random.default_rng(41), 2 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        bank.namespace(attn_spec).store(tokens, prefix_layers(attn_spec, tokens))
        second = bank.namespace(attn_spec).chain(tokens)[1]
    _corrupt(bank_path, Family.BLOCKS, bytes(second), "flip")
    prompt = tokens[: 2 * B - 1]
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(attn_spec).restore(prompt)
        assert hit is not None and hit.tokens == B and hit.partial == 0
        assert all(a.shape[-2] == B for layer in hit.layers for a in layer)
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(
            prefix_layers(attn_spec, prompt), attn_spec, B
        )


def test_a_header_with_rewritten_tokens_is_no_partial_block(
    bank_path: Path, attn_spec: ModelSpec
) -> None:
    """A header record, well formed, whose tokens were rewritten (they no longer hash to
    its name) is not used as a partial block: its KV is for other tokens."""
    tokens = tokens_of(np.random.default_rng(42), 2 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        bank.namespace(attn_spec).store(tokens, prefix_layers(attn_spec, tokens))
        second = bytes(bank.namespace(attn_spec).chain(tokens)[1])
    other = (tokens[B + 2] + 1) % 1000
    with RocksStore(bank_path) as raw:
        header = Header.decode(second, raw.get(Family.HEADERS, second) or b"")
        ids = header.token_ids()
        ids[2] = other
        forged = header._replace(tokens=np.array(ids, dtype="<u4").tobytes())
        raw.put_batch([(Family.HEADERS, second, forged.encode())])
    prompt = [*tokens[: B + 2], other]
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(attn_spec).restore(prompt)
        assert hit is not None and hit.tokens == B
        assert layers_bits(hit.layers, attn_spec) == kv_prefix_bits(
            prefix_layers(attn_spec, prompt), attn_spec, B
        )
