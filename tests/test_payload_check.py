"""Format version 4: payloads checked by XXH3-128, and the banks written before it.

A new bank writes XXH3-128 checks and is marked 4; an older bank (the fixture
`fixtures/bank_v3_blake3.tar.gz`, written by the cas_bank of format version 3: see
`fixtures/make_bank_v3.py`) opens as it is, its blake3 digests checked, and is not
rewritten; bundles carry blake3 whatever the bank holds. Real RocksDB, real arrays.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import TESTS_DIR, attention_spec, kv_prefix_bits, layers_bits, prefix_layers

from cas_bank import Bank, BankConfig
from cas_bank.blocks import codec
from cas_bank.blocks.files import stub_of
from cas_bank.blocks.hashing import XXH3_TAG, check_of, payload_check
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header
from cas_bank.index.ends import split_record
from cas_bank.maintenance.bundle import export_chain, import_bundle, read_bundle
from cas_bank.maintenance.bundle.export import chain_for_tokens
from cas_bank.maintenance.verify import verify

sys.path.insert(0, str(TESTS_DIR / "fixtures"))
from make_bank_v3 import PROMPT_DB, PROMPT_FILES

FIXTURE = TESTS_DIR / "fixtures" / "bank_v3_blake3.tar.gz"
SPEC = attention_spec()
B = 4


def _old_bank(tmp_path: Path) -> Path:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "bank"


def _format(path: Path) -> int:
    with RocksStore(path, mode="read_only") as raw:
        value = raw.get(Family.META, b"format_version")
    assert value is not None
    return int(struct.unpack("<I", value)[0])


def _checks(path: Path) -> dict[str, set[str]]:
    """The check every header, stub and end record of the bank at `path` names."""
    out: dict[str, set[str]] = {"headers": set(), "stubs": set(), "ends": set()}
    with RocksStore(path, mode="read_only") as raw:
        for key, value in raw.iterate(Family.HEADERS):
            out["headers"].add(check_of(Header.decode(key, value).payload_digest))
        for _, value in raw.iterate(Family.BLOCKS):
            stub = stub_of(value)
            if stub is not None:
                out["stubs"].add(check_of(stub[0]))
        for key, value in raw.iterate(Family.ENDS):
            stub = stub_of(value)  # a large end record is a file (format 5)
            digest = stub[0] if stub is not None else split_record(key, value)[0].payload_digest
            out["ends"].add(check_of(digest))
    return out


def _contents(path: Path) -> dict[str, str]:
    """Every file of a bank but RocksDB's logs and lock, by its bytes' sha256."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(("LOG", "LOCK"))
    }


def _restores_bit_exact(bank: Bank, prompt: list[int]) -> int:
    """Restore `prompt` (its full blocks, or all of it from an end record), check every
    bit, and return the tokens restored."""
    hit = bank.namespace(SPEC).restore(prompt)
    assert hit is not None and hit.tokens >= len(prompt) // B * B
    want = kv_prefix_bits(prefix_layers(SPEC, prompt), SPEC, hit.tokens)
    assert layers_bits(hit.layers, SPEC) == want
    return hit.tokens


def test_the_xxh3_check_field_and_its_vector() -> None:
    """XXH3-128 (seed 0, canonical big-endian) of the parts, then the tag naming it."""
    field = payload_check(b"a", b"bc", check="xxh3")
    assert field == bytes.fromhex("06b05ab6733a618578af5f94892f3950") + XXH3_TAG
    assert check_of(field) == "xxh3"
    assert check_of(payload_check(b"abc", check="blake3")) == "blake3"


def test_a_new_bank_is_format_5_and_every_record_carries_xxh3(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B, file_min_bytes=256)) as bank:
        assert bank.payload_check == "xxh3"
        ns = bank.namespace(SPEC)
        layers = prefix_layers(SPEC, PROMPT_FILES)
        ns.store(PROMPT_FILES, layers)
        assert ns.store_end(PROMPT_FILES, layers) > 0  # its bytes
    assert _format(bank_path) == 5
    with RocksStore(bank_path, mode="read_only") as raw:  # the end record is a file (5)
        assert all(stub_of(v) is not None for _, v in raw.iterate(Family.ENDS))
    assert _checks(bank_path) == {"headers": {"xxh3"}, "stubs": {"xxh3"}, "ends": {"xxh3"}}
    with Bank.open(bank_path, mode="read_only") as bank:
        assert _restores_bit_exact(bank, PROMPT_FILES) == len(PROMPT_FILES)  # the end record
        assert verify(bank).ok


def test_an_old_bank_opens_as_it_is_and_keeps_writing_blake3(tmp_path: Path) -> None:
    path = _old_bank(tmp_path)
    assert _format(path) == 3
    assert _checks(path) == {"headers": {"blake3"}, "stubs": {"blake3"}, "ends": {"blake3"}}
    before = _contents(path)
    with Bank.open(path, mode="read_only") as bank:
        for prompt in (PROMPT_DB, PROMPT_FILES):
            _restores_bit_exact(bank, prompt)
        assert verify(bank).ok
    with Bank.open(path) as bank:  # the writer: nothing rewritten, the format kept
        assert bank.payload_check == "blake3"
        assert _restores_bit_exact(bank, PROMPT_FILES) == len(PROMPT_FILES)  # its end record
        assert bank.stats().corrupt_reads == 0
        longer = [*PROMPT_FILES, 900, 901]  # a new block on the old chain
        bank.namespace(SPEC).store(longer, prefix_layers(SPEC, longer))
    assert _format(path) == 3  # the cas_bank that wrote it still opens it
    assert _checks(path)["headers"] == {"blake3"}
    after = _contents(path)
    payloads = [name for name in before if name.startswith("payloads/")]
    assert payloads and all(after[name] == before[name] for name in payloads)


@pytest.mark.parametrize("where", ["file", "rocksdb"])
def test_a_flipped_byte_in_an_old_banks_payload_is_caught(tmp_path: Path, where: str) -> None:
    path = _old_bank(tmp_path)
    prompt = PROMPT_FILES if where == "file" else PROMPT_DB
    with Bank.open(path, mode="read_only") as bank:
        chain = bank.namespace(SPEC).chain(prompt)
    if where == "file":
        (target,) = (path / "payloads" / "blocks").glob(f"{chain[1].hex()}.*")
        raw = bytearray(target.read_bytes())
        raw[len(raw) - 7] ^= 0x10
        target.write_bytes(bytes(raw))
    else:
        with RocksStore(path) as store:
            value = bytearray(store.get(Family.BLOCKS, chain[1]) or b"")
            value[len(value) - 7] ^= 0x10
            store.put_batch([(Family.BLOCKS, chain[1], bytes(value))])
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:
        hit = bank.namespace(SPEC).restore(prompt[: 3 * B])
        assert hit is not None and hit.tokens == B  # stops before the damaged block
        assert bank.stats().corrupt_reads == 1
        found = {(p.kind, p.chain_hash) for p in verify(bank).problems}
        assert ("payload_corrupt", chain[1]) in found


def test_asking_for_xxh3_marks_an_old_bank_5_and_leaves_its_records(tmp_path: Path) -> None:
    path = _old_bank(tmp_path)
    before = _contents(path)
    longer = [*PROMPT_DB, 7, 8, 9, 10]
    with Bank.open(path, BankConfig(payload_check="xxh3")) as bank:
        bank.namespace(SPEC).store(longer, prefix_layers(SPEC, longer))
    assert _format(path) == 5
    assert _checks(path)["headers"] == {"blake3", "xxh3"}
    after = _contents(path)
    assert all(after[n] == before[n] for n in before if n.startswith("payloads/"))
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:  # 5 now: XXH3 by default
        assert bank.payload_check == "xxh3"
        for prompt in (longer, PROMPT_FILES):
            _restores_bit_exact(bank, prompt)
        assert verify(bank).ok


def test_bundles_carry_blake3_and_import_as_the_bank_writes(tmp_path: Path) -> None:
    new = tmp_path / "new"
    with Bank.open(new, BankConfig(block_size=B, file_min_bytes=256)) as bank:
        ns = bank.namespace(SPEC)
        layers = prefix_layers(SPEC, PROMPT_FILES)
        ns.store(PROMPT_FILES, layers)
        ns.store_end(PROMPT_FILES, layers)
        export_chain(bank, chain_for_tokens(bank, ns.root, PROMPT_FILES), tmp_path / "b.casb")
    bundle = read_bundle(tmp_path / "b.casb")
    fields = [e.header.payload_digest for e in bundle.entries]
    fields += [codec.embedded_digest(e.payload) for e in bundle.entries]
    fields += [split_record(k, v)[0].payload_digest for k, v in bundle.ends]
    assert fields and {check_of(f) for f in fields} == {"blake3"}  # what crosses
    other = tmp_path / "other"
    with Bank.open(other, BankConfig(block_size=B)) as bank:
        import_bundle(bank, bundle)
        _restores_bit_exact(bank, PROMPT_FILES)
        assert verify(bank).ok
    assert _checks(other) == {"headers": {"xxh3"}, "stubs": set(), "ends": {"xxh3"}}
    blank = tmp_path / "blank"  # a version-3 bank made afresh (blake3 asked for)
    with Bank.open(blank, BankConfig(block_size=B, payload_check="blake3")) as bank:
        import_bundle(bank, tmp_path / "b.casb")
        _restores_bit_exact(bank, PROMPT_FILES)
    assert _format(blank) == 3
    assert _checks(blank) == {"headers": {"blake3"}, "stubs": set(), "ends": {"blake3"}}


def test_a_bundle_of_a_damaged_xxh3_record_is_refused(bank_path: Path, tmp_path: Path) -> None:
    """Export verifies each XXH3 record before it re-digests it with blake3: damage is
    not laundered into a bundle with a fresh, valid digest."""
    prompt = [int(t) for t in np.arange(12)]
    with Bank.open(bank_path, BankConfig(block_size=B, file_min_bytes=None)) as bank:
        chain = bank.namespace(SPEC).store(prompt, prefix_layers(SPEC, prompt)).chain
    with RocksStore(bank_path) as store:
        value = bytearray(store.get(Family.BLOCKS, chain[2]) or b"")
        value[-3] ^= 1
        store.put_batch([(Family.BLOCKS, chain[2], bytes(value))])
    with Bank.open(bank_path, BankConfig(hot_bytes=0)) as bank:
        headers = chain_for_tokens(bank, bank.namespace(SPEC).root, prompt)
        with pytest.raises(Exception, match="fails its digest"):
            export_chain(bank, headers, tmp_path / "bad.casb")
    assert not (tmp_path / "bad.casb").exists()
