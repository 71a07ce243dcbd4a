"""The file tier (cas_bank.blocks.files): large payloads as files beside RocksDB, the
database the single commit point; the restore's direct read (restore.file_read)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import layers_bits, prefix_layers, tokens_of

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.arrays import DTYPES
from cas_bank.blocks import codec
from cas_bank.blocks.files import STUB_MAGIC, FileTier, PayloadFile
from cas_bank.blocks.hashing import check_of
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.maintenance.verify import verify
from cas_bank.restore import file_read

B = 16
# Two layers of [1, 4, 16, 128] float32 keys and values: 128 KiB a block, in files.
SPEC = ModelSpec(
    name="filed",
    layers=tuple(LayerSpec.attention(kv_heads=4, head_dim=128, dtype="float32") for _ in "ab"),
    weights_digest="w-filed",
)


def _files(path: Path) -> list[Path]:
    return sorted((path / "payloads" / "blocks").iterdir())


def _store(path: Path, tokens: list[int], **config: object) -> list[list[bytes]]:
    with Bank.open(path, BankConfig(block_size=B, hot_bytes=0, **config)) as bank:  # type: ignore[arg-type]
        layers = prefix_layers(SPEC, tokens)
        bank.namespace(SPEC).store(tokens, layers)
        return [[np.array(a).tobytes() for a in layer] for layer in layers]


def test_large_payloads_are_files_and_restore_bit_exact(bank_path: Path, check: str) -> None:
    tokens = tokens_of(np.random.default_rng(1), 4 * B)
    _store(bank_path, tokens, payload_check=check)
    assert len(_files(bank_path)) == 4
    with RocksStore(bank_path, mode="read_only") as raw:  # the database holds stubs
        stubs = [v for _, v in raw.iterate(Family.BLOCKS)]
        assert all(v[:4] == STUB_MAGIC for v in stubs)
        assert {check_of(v[4:36]) for v in stubs} == {check}  # each says its check
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(SPEC).restore(tokens)
        assert hit is not None and hit.tokens == 4 * B
        want = prefix_layers(SPEC, tokens)
        assert layers_bits(hit.layers, SPEC) == layers_bits(want, SPEC)
        roomy = bank.namespace(SPEC).restore(tokens, room_for=300)
        assert roomy is not None and roomy.layers[0][0].shape[-2] == 512
        assert mx.array_equal(roomy.layers[0][0][..., : 4 * B, :], want[0][0]).item()
        assert verify(bank).ok  # verify reads the files through the store
        assert bank.stats().disk_bytes >= sum(p.stat().st_size for p in _files(bank_path))


def test_a_damaged_file_is_a_counted_miss_and_the_next_store_repairs_it(
    bank_path: Path, check: str
) -> None:
    tokens = tokens_of(np.random.default_rng(2), 4 * B)
    _store(bank_path, tokens, payload_check=check)
    third = [p for p in _files(bank_path)]
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        chain = ns.chain(tokens)
        damaged = next(p for p in third if p.name.startswith(chain[2].hex()))
        with damaged.open("r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 1]))
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 2 * B  # stops before the damaged block
        assert bank.stats().corrupt_reads == 1
        ns.store(tokens, prefix_layers(SPEC, tokens))  # rewrites the suspect block
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == 4 * B


def test_a_missing_file_is_a_counted_miss(bank_path: Path) -> None:
    tokens = tokens_of(np.random.default_rng(3), 3 * B)
    _store(bank_path, tokens)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        gone = next(p for p in _files(bank_path) if p.name.startswith(ns.chain(tokens)[1].hex()))
        gone.unlink()
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == B
        assert bank.stats().corrupt_reads == 1


def test_a_restore_reads_the_file_its_header_names_and_verify_flags_a_wrong_record(
    bank_path: Path, check: str
) -> None:
    """The database's record of block 1 replaced by block 2's: a restore names each
    payload file by its header (key and digest), so it reads block 1's own file, checked
    against the header's digest, without the record; `verify` reports the record."""
    tokens = tokens_of(np.random.default_rng(4), 3 * B)
    _store(bank_path, tokens, payload_check=check)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        chain = bank.namespace(SPEC).chain(tokens)
        want = bank.namespace(SPEC).restore(tokens)
        assert want is not None
    with RocksStore(bank_path) as raw:
        stubs = raw.get_many(Family.BLOCKS, [chain[1], chain[2]])
        assert all(s is not None and s[:4] == STUB_MAGIC for s in stubs)
        raw.put_batch([(Family.BLOCKS, chain[1], stubs[1])])
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(SPEC).restore(tokens)
        assert hit is not None and hit.tokens == 3 * B
        assert layers_bits(hit.layers, SPEC) == layers_bits(want.layers, SPEC)
        assert bank.stats().corrupt_reads == 0
        assert not verify(bank).ok


def test_a_missing_file_whose_record_names_another_payload_is_a_counted_miss(
    bank_path: Path, check: str
) -> None:
    """Block 1's file gone and its record naming block 2's payload: the record, read
    for the file not found, does not match the header: the restore stops before it."""
    tokens = tokens_of(np.random.default_rng(4), 3 * B)
    _store(bank_path, tokens, payload_check=check)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        chain = bank.namespace(SPEC).chain(tokens)
    with RocksStore(bank_path) as raw:
        stubs = raw.get_many(Family.BLOCKS, [chain[1], chain[2]])
        raw.put_batch([(Family.BLOCKS, chain[1], stubs[1])])
    next(p for p in _files(bank_path) if p.name.startswith(chain[1].hex())).unlink()
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(SPEC).restore(tokens)
        assert hit is not None and hit.tokens == B
        assert bank.stats().corrupt_reads == 1


def test_files_of_a_batch_that_never_committed_are_found_and_removed(bank_path: Path) -> None:
    """A crash between the files and their batch: the next open sweeps them away."""
    tokens = tokens_of(np.random.default_rng(4), 2 * B)
    _store(bank_path, tokens)
    kept = _files(bank_path)
    orphan = bank_path / "payloads" / "blocks" / f"{'ab' * 32}.{'cd' * 8}"
    orphan.write_bytes(b"CASB" + bytes(100))
    (bank_path / "payloads" / "blocks" / f"{'ef' * 32}.{'01' * 8}.tmp").write_bytes(b"x")
    (bank_path / "payloads" / "OPEN").touch()  # the writer that wrote them never closed
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        assert _files(bank_path) == kept
        assert bank.namespace(SPEC).match(tokens) == 2 * B


def test_a_failed_batch_leaves_no_file(bank_path: Path) -> None:
    class Failing(RocksStore):
        def put_batch(self, writes: object) -> None:  # type: ignore[override]
            raise OSError("disk full")

    with Failing(bank_path) as inner:
        tier = FileTier(inner, bank_path / "payloads")
        payload = b"CASB" + bytes(20) + bytes(range(32)) + bytes(100_000)
        with pytest.raises(OSError, match="disk full"):
            tier.put_batch([(Family.BLOCKS, b"k" * 32, payload)])
        assert not list((bank_path / "payloads" / "blocks").iterdir())
        tier.close()


def test_eviction_and_verify_fix_remove_files(bank_path: Path) -> None:
    rng = np.random.default_rng(5)
    a, b = tokens_of(rng, 4 * B), tokens_of(rng, 4 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(a, prefix_layers(SPEC, a))
        ns.store(b, prefix_layers(SPEC, b))
        assert len(_files(bank_path)) == 8
    one_block = 2 * 2 * 4 * B * 128 * 4
    with Bank.open(bank_path, BankConfig(hot_bytes=0, max_bytes=5 * one_block)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(b, prefix_layers(SPEC, b))  # a store enforces the budget
        assert len(_files(bank_path)) == bank.stats().blocks <= 5
        stray = bank_path / "payloads" / "blocks" / f"{'ab' * 32}.{'cd' * 8}"
        stray.write_bytes(b"CASB")
        assert verify(bank, fix=True).removed_orphans >= 1
        assert not stray.exists()


def test_a_format_1_bank_opens_reads_and_is_marked_current(bank_path: Path) -> None:
    """Version 1 kept every payload in RocksDB: it opens as it is and restores."""
    tokens = tokens_of(np.random.default_rng(6), 3 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        bank.files.min_bytes = 1 << 40  # type: ignore[union-attr]  # what version 1 wrote
        bank.namespace(SPEC).store(tokens, prefix_layers(SPEC, tokens))
        bank.store.put_batch([(Family.META, b"format_version", struct.pack("<I", 1))])
    assert not _files(bank_path)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(SPEC).restore(tokens)
        assert hit is not None and hit.tokens == 3 * B
        want = prefix_layers(SPEC, tokens)
        assert layers_bits(hit.layers, SPEC) == layers_bits(want, SPEC)
    with RocksStore(bank_path, mode="read_only") as raw:
        assert raw.get(Family.META, b"format_version") == struct.pack("<I", 3)


def test_files_are_fsynced_only_when_durable(
    bank_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    tokens = tokens_of(np.random.default_rng(7), 2 * B)
    _store(bank_path / "fast", tokens, durability="fast")
    assert not synced
    _store(bank_path / "wal", tokens, durability="wal")
    assert len(synced) >= 2 + 1  # each file, and the directory they were written in


# A hybrid layout whose states are files too: a GDN layer's recurrent state of
# (1, 8, 64, 64) float32 is 128 KiB; the attention blocks are 64 KiB each.
HYBRID = ModelSpec(
    name="filed-hybrid",
    layers=(
        LayerSpec.recurrent([((1, 3, 96), "bfloat16"), ((1, 8, 64, 64), "float32")]),
        LayerSpec.attention(kv_heads=4, head_dim=128, dtype="float32"),
    ),
    weights_digest="w-filed-hybrid",
)


def _state_files(path: Path) -> list[Path]:
    return sorted((path / "payloads" / "states").iterdir())


def test_a_hybrid_restore_reads_its_state_file_with_the_blocks_and_refuses_damage(
    bank_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import random_state, state_bits

    from cas_bank.restore.payloads import PayloadReader

    slow: list[Family] = []  # payloads read one by one (not with the blocks)
    one_by_one = PayloadReader._read

    def spy(self: PayloadReader, family: Family, key: bytes, expected: bytes):  # type: ignore[no-untyped-def]
        slow.append(family)
        return one_by_one(self, family, key, expected)

    monkeypatch.setattr(PayloadReader, "_read", spy)

    tokens = tokens_of(np.random.default_rng(7), 4 * B)
    states = {2 * B: random_state(HYBRID, 1), 4 * B: random_state(HYBRID, 2)}
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        bank.namespace(HYBRID).store(tokens, prefix_layers(HYBRID, tokens), states)
    assert len(_state_files(bank_path)) == 2
    want = prefix_layers(HYBRID, tokens)
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        ns = bank.namespace(HYBRID)
        hit = ns.restore(tokens, room_for=5 * B)
        assert hit is not None and hit.tokens == 4 * B
        assert state_bits(hit.layers, HYBRID) == state_bits(states[4 * B], HYBRID)
        att = hit.layers[1]
        assert att is not None
        assert mx.array_equal(att[0][..., : 4 * B, :], want[1][0]).item()
        assert mx.array_equal(att[1][..., : 4 * B, :], want[1][1]).item()
        assert bank.stats().corrupt_reads == 0
        # The state came with the blocks (the native reader's batch; the Python path
        # reads it on its own).
        with_blocks: list[Family] = [] if file_read.fill_module is not None else [Family.STATES]
        assert slow == with_blocks
        # Damage the deepest state's file: the restore moves back to the state at 2B,
        # counting the damage once.
        deepest = ns.chain(tokens)[3].hex()
        damaged = next(p for p in _state_files(bank_path) if p.name.startswith(deepest))
        raw = bytearray(damaged.read_bytes())
        raw[-7] ^= 0x10
        damaged.write_bytes(raw)
        hit = ns.restore(tokens, room_for=5 * B)
        assert hit is not None and hit.tokens == 2 * B
        assert state_bits(hit.layers, HYBRID) == state_bits(states[2 * B], HYBRID)
        assert bank.stats().corrupt_reads == 1
        assert slow == [*with_blocks, Family.STATES, Family.STATES]  # the damaged one, 2B's


def test_file_bytes_skips_a_file_renamed_between_the_listing_and_its_stat(tmp_path: Path) -> None:
    """A background store renames its `.tmp` files while `stats()` adds up the file
    tier's bytes: a file gone since the listing counts nothing (it raised, and
    `stats()` with it)."""
    from cas_bank.blocks.files import _size_if_there

    tmp = tmp_path / "key.tmp"
    tmp.write_bytes(b"abc")
    (entry,) = list(os.scandir(tmp_path))
    tmp.rename(tmp_path / "key")
    assert _size_if_there(entry) == 0
    (entry,) = list(os.scandir(tmp_path))
    assert _size_if_there(entry) == 3


def test_the_tier_says_where_each_payload_is(tmp_path: Path) -> None:
    """`file_for` names the file a payload of the tier's size is kept in, without reading
    its record; `locate` says what the records hold: the file (`PayloadFile`, the same
    name, its digest and size), the payload itself where the database keeps it, or
    nothing. A restore asks these instead of reading stubs itself."""
    rng = np.random.default_rng(9)
    big = [rng.standard_normal((1, 4, B, 128)).astype(np.float32)]
    small = [rng.standard_normal((1, 1, 2, 4)).astype(np.float32)]
    f32 = [DTYPES["float32"]]
    big_payload, small_payload = codec.encode(big, f32, "none"), codec.encode(small, f32, "none")
    with RocksStore(tmp_path / "db") as inner:
        tier = FileTier(inner, tmp_path / "payloads", min_bytes=4096)
        filed, kept, absent = b"f" * 32, b"k" * 32, b"a" * 32
        tier.put_batch([(Family.BLOCKS, filed, big_payload), (Family.BLOCKS, kept, small_payload)])
        digest = codec.embedded_digest(big_payload)
        assert tier.stores_as_file(len(big_payload)) and not tier.stores_as_file(len(small_payload))
        name = tier.file_for(Family.BLOCKS, filed, digest, len(big_payload))
        assert name is not None and Path(name).read_bytes() == big_payload
        small_digest = codec.embedded_digest(small_payload)
        assert tier.file_for(Family.BLOCKS, kept, small_digest, len(small_payload)) is None
        place, record, nothing = tier.locate(Family.BLOCKS, [filed, kept, absent])
        assert place == PayloadFile(name, digest, len(big_payload))
        assert place.is_of(digest, len(big_payload))
        assert not place.is_of(small_digest, len(big_payload))
        assert record == small_payload and nothing is None
        tier.close()


def test_the_file_tiers_private_parts_and_stub_format_stay_in_its_module() -> None:
    """Whether a payload is a file, and what its stub looks like, is the file tier's:
    no module of the package outside blocks/files.py imports its stub helpers or uses
    an attribute private to it (the restore read stubs and `files.inner` itself)."""
    import ast

    import cas_bank

    package = Path(cas_bank.__file__).parent
    tier_module = package / "blocks" / "files.py"
    private = {
        n.attr
        for n in ast.walk(ast.parse(tier_module.read_text()))
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    }
    shared = {"FileTier", "PayloadFile", "MIN_FILE_BYTES"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == tier_module:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == "cas_bank.blocks.files":
                found += [f"{path.name}: imports {a.name}" for a in n.names if a.name not in shared]
            if isinstance(n, ast.Attribute) and n.attr in private | {"inner"}:
                owner = n.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("files", "tier"):  # the tier's names in the package
                    found.append(f"{path.name}: {name}.{n.attr}")
    assert not found
