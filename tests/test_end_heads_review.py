"""Review of end records found by their heads (6f98f93, b0f092c: `FileTier.record_heads`,
`HotStore.record_heads`, `ends.stored_end`, `ReadView.end_records`) and of the bank's
copy-run tables (4d4bed0: `row_runs.RunTables` in `Resources.run_tables`).

Real RocksDB, files and MLX arrays under tmp_path."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    FILED_ENDS,
    attention_spec,
    bits,
    end_file,
    end_leases,
    filed_hybrid_spec,
    hot_end_bytes,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    quantized_spec,
    random_logits,
    random_state,
    state_bits,
    tokens_of,
)

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.blocks.files import PayloadFile
from cas_bank.blocks.store import Family
from cas_bank.restore.row_runs import available as row_runs_available

B = BLOCK_SIZE
HYBRID = filed_hybrid_spec()
HOT = FILED_ENDS


def _store_end(bank: Bank, tokens: list[int], seed: int, **extra: Any) -> list[Any]:
    """`tokens` stored in HYBRID's namespace with an end record (state of `seed`)."""
    layers = prefix_layers(HYBRID, tokens)
    state = random_state(HYBRID, seed)
    ns = bank.namespace(HYBRID)
    ns.store(tokens, layers)
    assert ns.store_end(tokens, layers, state, **extra) > 0
    return state


def _head_entries(bank: Bank) -> int:
    assert bank.hot is not None
    return sum(1 for (f, _), e in bank.hot._entries.items() if f is Family.ENDS and e.head)


def _hot_sum(bank: Bank) -> int:
    """What the hot tier's entries are charged, added up now."""
    assert bank.hot is not None
    return sum(e.size for e in bank.hot._entries.values())


def test_a_tail_longer_than_the_head_is_found_by_its_head_too(tmp_path: Path) -> None:
    """At block sizes over 997 a tail may not fit in the 4 KiB head (112 bytes and 4 a
    token): the record is still found by its head, and a lease hit reads no file, as
    at small blocks (tests/test_end_lease_heads.py)."""
    big = 1024
    config = BankConfig(block_size=big, file_min_bytes=1024, hot_bytes=64 << 20)
    tokens = tokens_of(np.random.default_rng(7), big + 1000)  # a tail of 1000 tokens
    with Bank.open(tmp_path / "b", config) as bank:
        state = _store_end(bank, tokens, 7, logits=random_logits(7))
        ns = bank.namespace(HYBRID)
        for _ in range(2):  # the second: found by the head the first left in the hot tier
            hit = ns.restore(tokens)
            assert hit is not None and hit.exact and hit.tokens == len(tokens)
        assert end_leases(bank) and _head_entries(bank) == 1
        file = end_file(tmp_path / "b")
        aside = file.rename(file.with_name("aside"))  # a lease hit reads no file
        try:
            hit = ns.restore(tokens)
            assert hit is not None and hit.exact, "the lookup read the whole file"
            assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        finally:
            aside.rename(file)


WIDE = ModelSpec(  # 2 KiB a token a layer: a 3-token tail is a file of 12 KiB
    name="wide-attn",
    layers=(LayerSpec.attention(kv_heads=8, head_dim=64, dtype="float16"),) * 2,
    weights_digest="w-wide",
)


def _other_token(token: int) -> int:
    return (token + 1) % 1000


def test_a_partial_hit_whose_file_the_writer_replaced_is_no_corruption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A secondary's hot tier holds an end record's head; its writer rewrites the record
    with logits (another file, the old one removed). A prompt that leaves the record's
    tail inside it (a partial block from the record, `restore.tails.read_partial`) is a
    miss or the old record's tokens, not a counted corruption: `plan_end` takes the
    same `EndGone` as a miss, and a cold secondary (no head held) misses silently."""
    path = tmp_path / "b"
    tokens = tokens_of(np.random.default_rng(5), 2 * B + 3)
    prompt = [*tokens[: 2 * B + 2], _other_token(tokens[2 * B + 2])]
    layers = prefix_layers(WIDE, tokens)
    config = BankConfig(block_size=B, file_min_bytes=1024, hot_bytes=64 << 20)
    with Bank.open(path, config) as primary:
        ns = primary.namespace(WIDE)
        ns.store(tokens, layers)
        assert ns.store_end(tokens, layers) > 0
        primary.flush()
        with Bank.open(path, config, mode="secondary") as second:
            hit = second.namespace(WIDE).restore(prompt)
            assert hit is not None and hit.tokens == 2 * B + 2  # two tokens of the tail
            assert _head_entries(second) == 1
            assert ns.store_end(tokens, layers, logits=random_logits(1)) > 0  # holds more
            primary.flush()
            with caplog.at_level(logging.WARNING, logger="cas_bank"):
                again = second.namespace(WIDE).restore(prompt)
            assert again is None or again.tokens in (2 * B, 2 * B + 2)
            assert second.counters._values["corrupt_reads"] == 0
            assert "failed verification" not in caplog.text


def _parse_header(key: bytes, raw: bytes) -> object:
    from cas_bank.index.ends import split_record

    return split_record(key, raw)[0]


def test_hot_bytes_stay_the_sum_of_entries_as_records_turn_whole_to_head(
    bank_path: Path,
) -> None:
    """Every way into a head-held record (`get`, `get_many`, `get_parsed`, `lookup`,
    `record_heads`, a rewrite, eviction) keeps the hot tier's byte count the sum of its
    entries', and `stats().hot_bytes` with it: an entry turned from whole to head is
    charged its head, once."""
    with Bank.open(bank_path, HOT) as bank:
        hot = bank.hot
        assert hot is not None and bank.files is not None
        tokens = [tokens_of(np.random.default_rng(s), 2 * B + 3) for s in (1, 2)]
        for seed, t in enumerate(tokens):
            _store_end(bank, t, seed, logits=random_logits(seed))
        keys = sorted(k for k, _ in bank.files.inner.iterate(Family.ENDS))
        assert hot.used_bytes == _hot_sum(bank)
        hot.clear()
        wholes = hot.get_many(Family.ENDS, keys)  # read below, cached whole
        first = hot.record_heads(Family.ENDS, keys)  # answered whole, then held by heads
        assert first == wholes and _head_entries(bank) == 2
        assert hot.used_bytes == _hot_sum(bank) == bank.stats().hot_tier_bytes
        heads = hot.record_heads(Family.ENDS, keys)
        assert all(isinstance(h, PayloadFile) for h in heads)
        # Asked the other ways, a head-held record is read below, whole, and stays a head.
        assert hot.get_many(Family.ENDS, keys) == wholes
        assert [hot.get(Family.ENDS, k) for k in keys] == wholes
        raws, parsed = hot.get_parsed(Family.ENDS, keys, _parse_header)
        assert raws == wholes and all(p is not None for p in parsed)
        for key, head in zip(keys, heads, strict=True):
            assert isinstance(head, PayloadFile)
            assert hot.lookup(Family.ENDS, key, head.digest) is None
        assert _head_entries(bank) == 2 and hot.used_bytes == _hot_sum(bank)
        # A rewrite with more (hidden): another file, its head held from the next lookup on.
        _store_end(bank, tokens[0], 0, logits=random_logits(0), hidden=random_logits(9))
        assert hot.used_bytes == _hot_sum(bank)
        hot.record_heads(Family.ENDS, keys)
        new = hot.record_heads(Family.ENDS, keys)
        assert _head_entries(bank) == 2 and hot.used_bytes == _hot_sum(bank)
        assert new[1] == heads[1] and new[0] != heads[0]
        for h in new:
            assert isinstance(h, PayloadFile) and Path(h.path).exists()
        hot.budget.balance()
        while hot.evict_oldest():
            assert 0 <= hot.used_bytes == _hot_sum(bank)
        assert hot.used_bytes == 0 == bank.stats().hot_tier_bytes


@pytest.mark.parametrize(
    "config",
    [
        BankConfig(block_size=B, file_min_bytes=1024, hot_bytes=64 << 20, payload_check="blake3"),
        BankConfig(block_size=B, file_min_bytes=1 << 20, hot_bytes=64 << 20),
    ],
    ids=["format-3-ends-in-rocksdb", "below-file-min-bytes"],
)
def test_records_kept_in_rocksdb_stay_whole_in_the_hot_tier(
    tmp_path: Path, config: BankConfig
) -> None:
    """A bank that keeps end records in RocksDB (blake3, format 3) or a record below
    `file_min_bytes` is held whole, never by a head, and restores the same, reopened too."""
    tokens = tokens_of(np.random.default_rng(3), 2 * B + 3)
    with Bank.open(tmp_path / "b", config) as bank:
        state = _store_end(bank, tokens, 3, logits=random_logits(3))
        assert not (tmp_path / "b" / "payloads" / "ends").exists() or not any(
            (tmp_path / "b" / "payloads" / "ends").iterdir()
        )
    for _ in range(2):  # reopened: read from RocksDB, then from the hot tier / lease
        with Bank.open(tmp_path / "b", config) as bank:
            for _ in range(3):
                hit = bank.namespace(HYBRID).restore(tokens)
                assert hit is not None and hit.exact and hit.tokens == len(tokens)
                assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
                assert bits(hit.logits) == bits(random_logits(3))  # type: ignore[arg-type]
            assert _head_entries(bank) == 0 and end_leases(bank)
            assert bank.hot is not None and bank.hot.used_bytes == _hot_sum(bank)
            held = [e for (f, _), e in bank.hot._entries.items() if f is Family.ENDS]
            assert [len(e.raw) > 64 << 10 for e in held if not e.absent] == [True]


def test_restores_racing_rewrites_and_evictions_of_one_end_are_one_stores(
    bank_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two threads restore one end while the writer stores it again and again, each time
    holding more (logits, then a hidden state: another file each), and evicts it: every
    hit is one store's state, logits and hidden state, none fails, nothing is counted
    corrupt of the end record, and the hot tier's count stays its entries' sum. (Blocks
    evicted and stored again under a restore are sometimes counted corrupt, "payload
    missing under a stored header": a race of blocks, not of end records, left out.)"""
    import threading

    from cas_bank.evict.eviction import evict_to_budget

    tokens = tokens_of(np.random.default_rng(11), 2 * B + 3)
    rounds = 16
    states = {i: random_state(HYBRID, 50 + i) for i in range(rounds)}
    by_state = {tuple(map(tuple, state_bits(s, HYBRID))): i for i, s in states.items()}
    failures: list[str] = []
    hits = [0]
    with Bank.open(bank_path, HOT) as bank:
        ns = bank.namespace(HYBRID)
        done = threading.Event()

        def restore_loop() -> None:
            while not done.is_set():
                try:
                    hit = ns.restore(tokens)
                except Exception as e:  # any failure is the finding
                    failures.append(repr(e))
                    return
                if hit is None or not hit.exact:
                    continue
                i = by_state.get(tuple(map(tuple, state_bits(hit.layers, HYBRID))))
                if i is None:
                    failures.append("a state no store wrote")
                elif hit.logits is not None and bits(hit.logits) != bits(random_logits(i)):
                    failures.append(f"logits of another store than state {i}")
                elif hit.hidden is not None and bits(hit.hidden) != bits(random_logits(100 + i)):
                    failures.append(f"hidden state of another store than state {i}")
                else:
                    hits[0] += 1

        caplog.set_level(logging.WARNING, logger="cas_bank")
        readers = [threading.Thread(target=restore_loop) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            layers = prefix_layers(HYBRID, tokens)
            for i in range(rounds):
                ns.store(tokens, layers)
                for extra in ({}, {"logits": random_logits(i)}):
                    assert ns.store_end(tokens, layers, states[i], **extra) > 0
                held = {"logits": random_logits(i), "hidden": random_logits(100 + i)}
                assert ns.store_end(tokens, layers, states[i], **held) > 0
                evict_to_budget(bank, 0)
        finally:
            done.set()
            for t in readers:
                t.join()
        assert failures == []
        assert not [r for r in caplog.records if "end record" in r.getMessage()]
        assert bank.hot is not None and bank.hot.used_bytes == _hot_sum(bank)
    assert hits[0] > 0


# -- the bank's copy-run tables (4d4bed0) -------------------------------------------------


def _stored_small(path: Path, spec: ModelSpec, tokens: list[int]) -> list[Any]:
    """`tokens` stored with small payloads (kept in RocksDB) and an end record; the state."""
    layers = prefix_layers(spec, tokens)
    state = random_state(spec, 21)
    with Bank.open(path, BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
        assert ns.store_end(tokens, layers, state, logits=random_logits(21)) > 0
    return state


@pytest.mark.skipif(not row_runs_available(), reason="no native copy (pure Python)")
def test_banks_with_and_without_run_tables_restore_the_same_bits_while_one_closes(
    tmp_path: Path,
) -> None:
    """bf16, quantized and hybrid small payloads, read from RocksDB (no hot tier) by two
    banks open at once in one process: one keeping its tables (default), one none
    (`run_table_bytes=0`), one whose bound no table fits: the same bits, each bank's
    tables its own; one closed while the other restores on another thread."""
    import threading

    specs = [attention_spec("bfloat16"), quantized_spec(), hybrid_spec()]
    tokens = tokens_of(np.random.default_rng(8), 40 * B + 2)
    want: dict[str, tuple[list[list[bytes]], list[list[bytes]]]] = {}
    for spec in specs:
        state = _stored_small(tmp_path / "kept", spec, tokens)
        layers = prefix_layers(spec, tokens)
        want[spec.name] = (kv_prefix_bits(layers, spec, len(tokens)), state_bits(state, spec))
    for name in ("none", "tiny"):
        shutil.copytree(tmp_path / "kept", tmp_path / name)
    bound = {"kept": 8 << 20, "none": 0, "tiny": 64}
    banks = {
        name: Bank.open(
            tmp_path / name,
            BankConfig(block_size=B, file_min_bytes=None, hot_bytes=0, run_table_bytes=size),
        )
        for name, size in bound.items()
    }
    failures: list[str] = []

    def restore_all(bank: Bank, times: int) -> None:
        for _ in range(times):
            for spec in specs:
                hit = bank.namespace(spec).restore(tokens)
                if hit is None or hit.tokens != len(tokens):
                    failures.append(f"{spec.name}: {hit}")
                elif (layers_bits(hit.layers, spec), state_bits(hit.layers, spec)) != want[
                    spec.name
                ]:
                    failures.append(f"{spec.name}: other bits")

    try:
        for bank in banks.values():
            restore_all(bank, 1)
        assert failures == []
        held = {name: bank.stats().run_table_held_bytes for name, bank in banks.items()}
        assert held["kept"] > 0 and held["none"] == 0 and held["tiny"] == 0
        other = threading.Thread(target=restore_all, args=(banks["none"], 5))
        other.start()
        banks["kept"].close()  # its tables released while another bank restores
        other.join()
        assert failures == [] and banks["kept"].resources.run_tables.bytes == 0
        restore_all(banks["tiny"], 1)
        assert failures == [] and banks["tiny"].stats().run_table_held_bytes == 0
    finally:
        for bank in banks.values():
            bank.close()


def test_an_end_record_whose_file_is_gone_is_found_by_verify_and_removed_by_fix(
    bank_path: Path,
) -> None:
    from cas_bank.maintenance.verify import verify

    tokens = tokens_of(np.random.default_rng(12), 2 * B + 3)
    with Bank.open(bank_path, HOT) as bank:
        _store_end(bank, tokens, 12, logits=random_logits(12))
        ns = bank.namespace(HYBRID)
        assert ns.restore(tokens) is not None and end_leases(bank)  # leased, held by its head
        end_file(bank_path).unlink()
        report = verify(bank)
        assert bank.files is not None
        (key,) = [k for k, _ in bank.files.inner.iterate(Family.ENDS)]
        assert key in {p.chain_hash for p in report.problems}
        assert verify(bank, fix=True).fixed
        assert bank.stats().ends == 0 and not end_leases(bank)
        assert list(bank.files.inner.iterate(Family.ENDS)) == []
        assert ns.restore(tokens) is None


@pytest.mark.parametrize("mode", ["read_only", "secondary"])
def test_a_reader_open_holds_heads_and_restores_from_its_lease(bank_path: Path, mode: str) -> None:
    """A read-only or secondary open finds a filed end record by its head as the writer
    does: bit-exact, then from its lease with the file moved aside; a secondary's
    `refresh` forgets the head and reads the writer's rewrite (another file)."""
    tokens = tokens_of(np.random.default_rng(13), 2 * B + 3)
    with Bank.open(bank_path, HOT) as writer:
        state = _store_end(writer, tokens, 13, logits=random_logits(13))
    with Bank.open(bank_path, HOT, mode=mode) as reader:  # type: ignore[arg-type]
        ns = reader.namespace(HYBRID)
        for _ in range(2):
            hit = ns.restore(tokens)
            assert hit is not None and hit.exact and bits(hit.logits) == bits(random_logits(13))  # type: ignore[arg-type]
            assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert _head_entries(reader) == 1 and end_leases(reader)
        assert reader.hot is not None and reader.hot.used_bytes == _hot_sum(reader)
        file = end_file(bank_path)
        aside = file.rename(file.with_name("aside"))
        try:
            hit = ns.restore(tokens)
            assert hit is not None and hit.exact
            assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        finally:
            aside.rename(file)
    if mode != "secondary":
        return
    with Bank.open(bank_path, HOT) as writer, Bank.open(bank_path, HOT, mode="secondary") as reader:
        ns = reader.namespace(HYBRID)
        assert ns.restore(tokens) is not None and _head_entries(reader) == 1
        _store_end(writer, tokens, 13, logits=random_logits(13), hidden=random_logits(14))
        writer.flush()
        reader.refresh()
        hit = ns.restore(tokens)
        assert hit is not None and hit.hidden is not None
        assert bits(hit.hidden) == bits(random_logits(14))
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)


def test_a_head_held_end_is_exported_whole_and_imported_into_another_bank(
    tmp_path: Path,
) -> None:
    """A bundle exported while the hot tier holds the end record by its head carries the
    whole record (read below); imported into another bank (cached whole by its write,
    then held by its head) it restores bit-exact, the importing bank's file the same."""
    from cas_bank.maintenance.bundle import chain_for_tokens, export_chain, import_bundle

    tokens = tokens_of(np.random.default_rng(15), 2 * B + 3)
    with Bank.open(tmp_path / "a", HOT) as bank:
        state = _store_end(bank, tokens, 15, logits=random_logits(15))
        ns = bank.namespace(HYBRID)
        assert ns.restore(tokens) is not None and _head_entries(bank) == 1
        export_chain(bank, chain_for_tokens(bank, ns.root, tokens), tmp_path / "c.casb")
        assert _head_entries(bank) == 1
    with Bank.open(tmp_path / "b", HOT) as other:
        assert import_bundle(other, tmp_path / "c.casb").ends_written == 1
        ns = other.namespace(HYBRID)
        for _ in range(2):
            hit = ns.restore(tokens)
            assert hit is not None and hit.exact and bits(hit.logits) == bits(random_logits(15))  # type: ignore[arg-type]
            assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert _head_entries(other) == 1
    assert end_file(tmp_path / "b").read_bytes() == end_file(tmp_path / "a").read_bytes()


def test_a_stored_end_file_is_charged_its_head_beside_its_live_lease(bank_path: Path) -> None:
    """Right after `store_end` the live lease holds the turn's arrays; the hot tier should
    hold the record's head, not the whole record (4.9 MB for a medium hybrid's), as it
    does after the first lookup: a turn that is never restored (a branch left) kept it
    whole until the LRU reached it."""
    tokens = tokens_of(np.random.default_rng(16), 2 * B + 3)
    with Bank.open(bank_path, HOT) as bank:
        _store_end(bank, tokens, 16, logits=random_logits(16))
        record = end_file(bank_path).stat().st_size
        assert bank.leases is not None and bank.leases.used_bytes > record // 2
        assert bank.hot is not None
        held = hot_end_bytes(bank)
        assert held < 8 << 10, f"the hot tier holds {held} bytes of a {record}-byte record"
