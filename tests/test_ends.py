"""End records (docs/design.md, "End records"): naming, lookup, restore, eviction,
verify, export/import, counters. The runtime's exactness tests are in
tests/test_runtime_ends.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    bits,
    check_every_block,
    hybrid_spec,
    layers_bits,
    prefix_layers,
    random_logits,
    random_state,
    state_bits,
    tokens_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank import Bank, BankConfig, InvalidInputError
from cas_bank.blocks.hashing import chain_hashes, end_hash, end_hashes
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index.ends import END_VERSION, end_key, split_record
from cas_bank.maintenance.bundle import chain_for_tokens, export_chain, import_bundle
from cas_bank.maintenance.salvage import salvage
from cas_bank.maintenance.verify import verify as verify_bank

B = BLOCK_SIZE
SPEC = attention_spec()
HYBRID = hybrid_spec()


def _kv_bits(layers: list[Any], spec: Any, n: int) -> list[list[bytes]]:
    return [
        [bits(a[..., :n, :]) for a in layer]
        for layer, ls in zip(layers, spec.layers, strict=True)
        if ls.kind == "attention"
    ]


# -- naming ------------------------------------------------------------------------
def test_end_hash_vector_and_context() -> None:
    """The end hash has a context of its own: the same bytes never name a block."""
    parent = bytes(32)
    tail = np.arange(4, dtype="<u4")
    assert end_hash(parent, tail) != chain_hashes(parent, list(range(4)), 4)[0]
    assert end_hash(parent, tail) == end_hash(parent, tail.tobytes())
    # Golden vectors (docs/design.md, "Hashing (format v1)"): a change here is a format change.
    assert END_VERSION == 1
    assert end_hash(parent, np.arange(3, dtype="<u4")).hex() == (
        "54a04e06fec255fe8d441d7855619b1578ae6fd8055c2d0404eb417d1a3a3351"
    )
    assert end_hash(parent, b"").hex() == (
        "3a86f4948d67e129d19780e964fa4a2bc16fe06c09da3821842ce2a87c85aab5"
    )
    assert end_hash(parent, np.array([], "<u4")).hex() == end_hash(parent, b"").hex()
    tail = np.arange(7, dtype="<u4")
    assert end_hashes(parent, tail.tobytes()) == [end_hash(parent, tail[:t]) for t in range(8)]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=11), min_size=1, max_size=6)
)
def test_end_hashes_never_collide(prompts: list[list[int]]) -> None:
    """Distinct (parent, tail) pairs get distinct names, none equal to a block hash."""
    root = bytes(range(32))
    names: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
    blocks: set[bytes] = set()
    for p in prompts:
        hashes = chain_hashes(root, p, B)
        blocks.update(hashes)
        for n in range(len(p) + 1):
            base = n - n % B
            parent = root if base == 0 else hashes[base // B - 1]
            tail = tuple(p[base:n])
            h = end_hash(parent, np.array(tail, "<u4"))
            assert names.setdefault(h, (parent, tail)) == (parent, tail)
    assert not blocks & set(names)


@settings(max_examples=25, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=5),
    prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12),
)
def test_a_lookup_finds_the_longest_stored_tail(
    tmp_path_factory: pytest.TempPathFactory, stored: list[list[int]], prompt: list[int]
) -> None:
    """The restore resumes from the deepest stored end record that prefixes the prompt
    under its deepest matched block (attention-only: when it is past the chain's end)."""
    path = tmp_path_factory.mktemp("ends") / "bank"
    with Bank.open(path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        for p in stored:
            ns.store(p, prefix_layers(SPEC, p))
            ns.store_end(p, prefix_layers(SPEC, p), logits=random_logits(len(p)))
        # The expectation, from the prompts themselves.
        matched = 0
        heads = {tuple(p[: (i + 1) * B]) for p in stored for i in range(len(p) // B)}
        while matched < len(prompt) // B and tuple(prompt[: (matched + 1) * B]) in heads:
            matched += 1
        base = matched * B
        ends = {tuple(p) for p in stored}
        best = max(
            (
                n
                for n in range(base, min(base + B - 1, len(prompt)) + 1)
                if tuple(prompt[:n]) in ends
            ),
            default=0,
        )
        want = best if best > base or best == len(prompt) else base
        # A partial block: the stored child of the matched chain (a block, or an end
        # record's tail) sharing the most of the prompt's next tokens, when that is more.
        children = [
            p[base : base + B] for p in stored if len(p) > base and p[:base] == prompt[:base]
        ]
        after = prompt[base : base + B]
        partial = max((_shared(c, after) for c in children), default=0)
        want = max(want, base + partial)
        hit = ns.restore(prompt)
        assert (hit.tokens if hit else 0) == want
        if hit is not None:
            assert layers_bits(hit.layers, SPEC) == _kv_bits(
                prefix_layers(SPEC, prompt), SPEC, want
            )
            assert hit.exact == (best == len(prompt) and want == best)
            if hit.exact:
                assert bits(hit.logits) == bits(random_logits(len(prompt)))  # type: ignore[arg-type]


def _shared(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


# -- restore -----------------------------------------------------------------------
def test_exact_repeat_of_a_hybrid_prompt(bank: Bank) -> None:
    """A hybrid prompt that does not end on a boundary and has no boundary state: its
    end record alone restores all of it, with the state and logits at its end."""
    tokens = tokens_of(np.random.default_rng(1), 2 * B + 3)
    layers = prefix_layers(HYBRID, tokens)
    ns = bank.namespace(HYBRID)
    ns.store(tokens, layers)  # blocks, no state
    assert ns.restore(tokens) is None  # a hybrid restore needs a state
    state = random_state(HYBRID, 7)
    written = ns.store_end(tokens, layers, state, logits=random_logits(3), hidden=random_logits(4))
    assert written > 0
    assert ns.store_end(tokens, layers, state, logits=random_logits(3)) == 0  # held already
    assert ns.match(tokens) == len(tokens)
    hit = ns.restore(tokens)
    assert hit is not None and hit.tokens == len(tokens) and hit.exact and hit.end
    assert layers_bits(hit.layers, HYBRID) == _kv_bits(layers, HYBRID, len(tokens))
    assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
    assert bits(hit.logits) == bits(random_logits(3))  # type: ignore[arg-type]
    assert bits(hit.hidden) == bits(random_logits(4))  # type: ignore[arg-type]
    # An extension resumes from the end record (no logits: it is not the prompt's end).
    longer = [*tokens, 5, 6, 7, 8, 9]
    hit = ns.restore(longer, room_for=len(longer))
    assert hit is not None and hit.tokens == len(tokens) and not hit.exact and hit.end
    assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
    v = bank.stats()
    assert (v.ends, v.exact_hits, v.end_hits, v.ends_written) == (1, 1, 1, 1)
    assert v.end_bytes == written
    assert check_every_block(bank.store) == 2


def test_an_end_under_the_root_and_bad_input(bank: Bank) -> None:
    ns = bank.namespace(SPEC)
    short = [1, 2]
    ns.store_end(short, prefix_layers(SPEC, short), logits=random_logits(0))
    hit = ns.restore(short)
    assert hit is not None and hit.tokens == 2 and hit.exact
    assert layers_bits(hit.layers, SPEC) == _kv_bits(prefix_layers(SPEC, short), SPEC, 2)
    with pytest.raises(InvalidInputError):
        ns.store_end([], prefix_layers(SPEC, []))
    with pytest.raises(InvalidInputError, match="recurrent"):
        bank.namespace(HYBRID).store_end(short, prefix_layers(HYBRID, short))
    with pytest.raises(InvalidInputError, match="logits"):
        ns.store_end(short, prefix_layers(SPEC, short), logits=[1.0])
    # Every position's logits (a forward pass's whole output) are not the last token's.
    every = mx.zeros((1, 2, 16))
    with pytest.raises(InvalidInputError, match=r"shape \(1, 2, 16\): take logits\[0, -1\]"):
        ns.store_end(short, prefix_layers(SPEC, short), logits=every)
    ns.store_end(short, prefix_layers(SPEC, short), logits=every[:, -1:, :])  # [1, 1, vocab]


def test_no_end_record_without_its_parent_block(bank: Bank) -> None:
    tokens = tokens_of(np.random.default_rng(2), B + 1)
    ns = bank.namespace(SPEC)
    assert ns.store_end(tokens, prefix_layers(SPEC, tokens)) == 0
    assert list(bank.store.iterate(Family.ENDS)) == []


# -- eviction, verify, bundles --------------------------------------------------------
def test_eviction_takes_end_records_with_their_parent(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        now = [0.0]

        def clock() -> float:
            now[0] += 1
            return now[0]

        bank.access.set_clock(clock)
        ns = bank.namespace(HYBRID)
        tokens = tokens_of(np.random.default_rng(3), B + 2)
        layers = prefix_layers(HYBRID, tokens)
        ns.store(tokens, layers)
        ns.store_end(tokens, layers, random_state(HYBRID, 1), logits=random_logits(1))
        bank.access.touch(ns.chain(tokens))  # the block is used after its end record
        total = bank.stats()
        assert total.end_bytes > 0
        report = evict_to_budget(bank, total.payload_bytes)  # the end group goes alone
        assert [e.kind for e in report.evicted] == ["ends"]
        assert report.ends_evicted == 1 and report.bytes_evicted == total.end_bytes
        assert bank.stats().ends == 0 and bank.stats().end_bytes == 0
        assert bank.stats().blocks == 1
        ns.store_end(tokens, layers, random_state(HYBRID, 1), logits=random_logits(1))
        report = evict_to_budget(bank, 0)  # the block goes, its end record with it
        assert [e.kind for e in report.evicted] == ["block"]
        assert report.ends_evicted == 1 and report.blocks_evicted == 1
        assert list(bank.store.iterate(Family.ENDS)) == []
        assert bank.stats().ends == 0 and bank.stats().end_bytes == 0
        assert list(bank.store.keys(Family.ACCESS)) == []


def test_verify_finds_a_flipped_byte_in_an_end_payload(bank_path: Path) -> None:
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        tokens = tokens_of(np.random.default_rng(4), B + 3)
        ns.store(tokens, prefix_layers(SPEC, tokens))
        ns.store_end(tokens, prefix_layers(SPEC, tokens), logits=random_logits(1))
        assert verify_bank(bank).ok
        ((key, value),) = list(bank.store.iterate(Family.ENDS))
        damaged = bytearray(value)
        damaged[-3] ^= 0x10
        bank.store.put_batch([(Family.ENDS, key, bytes(damaged))])
        hit = ns.restore(tokens)  # the end is a counted miss: the chain alone restores
        assert hit is not None and hit.tokens == B and not hit.end
        assert bank.stats().corrupt_reads == 1
        report = verify_bank(bank)
        assert not report.ok
        assert [p.kind for p in report.problems] == ["corrupt_end"]
        fixed = verify_bank(bank, fix=True)
        assert fixed.fixed
        assert list(bank.store.iterate(Family.ENDS)) == []
        assert bank.stats().ends == 0 and bank.stats().end_bytes == 0
        assert verify_bank(bank).ok


def test_end_records_travel_in_bundles(tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "b"
    tokens = tokens_of(np.random.default_rng(5), 2 * B + 1)
    state = random_state(HYBRID, 2)
    with Bank.open(src, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(HYBRID)
        ns.store(tokens, prefix_layers(HYBRID, tokens))
        ns.store_end(tokens, prefix_layers(HYBRID, tokens), state, logits=random_logits(9))
        export_chain(bank, chain_for_tokens(bank, ns.root, tokens), tmp_path / "x.casb")
    with Bank.open(dst, BankConfig(block_size=B)) as bank:
        import_bundle(bank, tmp_path / "x.casb")
        assert bank.stats().ends == 1
        hit = bank.namespace(HYBRID).restore(tokens)
        assert hit is not None and hit.exact and hit.tokens == len(tokens)
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert bits(hit.logits) == bits(random_logits(9))  # type: ignore[arg-type]
        assert verify_bank(bank).ok


def test_a_damaged_record_is_refused_by_its_name(bank: Bank) -> None:
    ns = bank.namespace(SPEC)
    ns.store_end([3], prefix_layers(SPEC, [3]))
    ((key, value),) = list(bank.store.iterate(Family.ENDS))
    assert split_record(key, value)[0].token_ids() == [3]
    other = end_key(ns.root, np.array([4], "<u4").tobytes())
    with pytest.raises(Exception, match="its own name"):
        split_record(other, value)


# -- the tools -----------------------------------------------------------------------
def test_the_tools_count_list_and_show_end_records(bank_path: Path) -> None:
    from tool_banks import cas_bank, cas_bank_json

    tokens = tokens_of(np.random.default_rng(8), B + 3)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(tokens, prefix_layers(SPEC, tokens))
        ns.store_end(tokens, prefix_layers(SPEC, tokens), logits=random_logits(2))
        assert ns.restore(tokens) is not None
        ((key, _),) = list(bank.store.iterate(Family.ENDS))
    stats = cas_bank_json("stats", bank_path)
    assert (stats["ends"], stats["exact_hits"], stats["ends_written"]) == (1, 1, 1)
    assert "1 exact repeats, 0 extensions" in cas_bank("stats", bank_path, check=True).stdout
    (row,) = cas_bank_json("ls", bank_path)["blocks"]
    assert row["ends"] == 1 and row["hash"] == key[:32].hex()
    (group,) = cas_bank_json("tree", bank_path)
    assert group["ends"] == 1
    shown = cas_bank_json("show", bank_path, key[32:].hex()[:10])
    assert shown["tokens"] == B + 3 and shown["tail"] == tokens[B:]
    assert shown["holds"] == ["tail KV", "logits"] and shown["status"] == "ok"
    assert shown["parent"] == key[:32].hex()
    assert "end record" in cas_bank("show", bank_path, key[32:].hex()[:10], check=True).stdout
    report = cas_bank_json("verify", bank_path)
    assert report["ok"] and report["ends_checked"] == 1, report


def test_the_header_tools_list_an_end_record_kept_in_a_blob_file(bank_path: Path) -> None:
    """`ls` and `tree` open the bank as a RocksDB secondary, which crashes on a family
    whose values are in blob files (an end record of 4 KiB or more: real models' tails
    and logits): they must walk the end records through the read-only instance."""
    from tool_banks import cas_bank_json

    tokens = tokens_of(np.random.default_rng(9), B + 3)
    big = mx.array(np.random.default_rng(9).standard_normal(4096).astype(np.float32))
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(tokens, prefix_layers(SPEC, tokens))
        ns.store_end(tokens, prefix_layers(SPEC, tokens), logits=big)
        ((key, value),) = list(bank.store.iterate(Family.ENDS))
        assert len(value) > 4096  # over the blob threshold: in a blob file
    (row,) = cas_bank_json("ls", bank_path)["blocks"]  # a crash here exits with -11
    assert row["ends"] == 1 and row["hash"] == key[:32].hex()
    (group,) = cas_bank_json("tree", bank_path)
    assert group["ends"] == 1


def test_an_end_record_queued_behind_its_blocks(bank_path: Path) -> None:
    """With the background writer, the end record is written after the blocks queued
    before it (its parent), from arrays copied when it was queued."""
    tokens = tokens_of(np.random.default_rng(9), 2 * B + 2)
    layers = prefix_layers(HYBRID, tokens)
    state = random_state(HYBRID, 4)
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=4)) as bank:
        ns = bank.namespace(HYBRID)
        ns.store_later(tokens, layers)
        pending = ns.store_end_later(tokens, layers, state, logits=random_logits(5))
        bank.flush()
        assert pending.result() > 0
        hit = ns.restore(tokens)
        assert hit is not None and hit.exact and hit.tokens == len(tokens)
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert layers_bits(hit.layers, HYBRID) == _kv_bits(layers, HYBRID, len(tokens))


def test_salvage_copies_end_records_that_verify(tmp_path: Path) -> None:
    from cas_bank.maintenance.salvage import salvage

    src, dst = tmp_path / "src", tmp_path / "dst"
    long, short = tokens_of(np.random.default_rng(10), B + 2), [7, 8]
    with Bank.open(src, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(long, prefix_layers(SPEC, long))
        for t in (long, short):
            ns.store_end(t, prefix_layers(SPEC, t), logits=random_logits(len(t)))
    report = salvage(src, dst)
    assert report.ends_copied == 2
    with Bank.open(dst) as bank:
        assert bank.stats().ends == 2
        for t in (long, short):
            hit = bank.namespace(SPEC).restore(t)
            assert hit is not None and hit.exact
        assert verify_bank(bank).ok


def _prompts_with_ends(bank_path: Path, seed: int, n: int, logits: int = 0) -> int:
    """`n` prompts of a block and a tail, each stored with its end record (with
    `logits` random logits, if any); the blocks the bank then holds."""
    rng = np.random.default_rng(seed)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(SPEC)
        for _ in range(n):
            tokens = tokens_of(rng, B + 3)
            ns.store(tokens, prefix_layers(SPEC, tokens))
            end_logits = mx.array(rng.standard_normal(logits).astype(np.float32))
            ns.store_end(tokens, prefix_layers(SPEC, tokens), logits=end_logits if logits else None)
        return bank.stats().blocks


def test_a_damaged_end_record_file_is_reported_and_fix_removes_nothing_intact(
    bank_path: Path,
) -> None:
    """A byte flipped in the blob file of end records: verify reports the walk it could
    not finish (RocksDB ends it quietly at the bad record) instead of taking the
    records past it for absent, and `--fix` leaves every block as it was."""
    from damage_kit import flip_byte

    blocks = _prompts_with_ends(bank_path, 11, 6, logits=4096)
    blob = max(bank_path.glob("*.blob"), key=lambda p: p.stat().st_size)
    flip_byte(blob, blob.stat().st_size * 2 // 5)  # in a record's value (halfway: between)
    saved = salvage(bank_path, bank_path.parent / "salvaged")  # before --fix changes it
    assert saved.walk_errors and saved.ends_copied == 5  # all but the damaged one
    with Bank.open(bank_path, BankConfig(block_size=B, hot_bytes=0)) as bank:
        report = verify_bank(bank)
        bad = [p for p in report.problems if p.kind == "bad_end"]
        assert bad and not report.ok, report.problems
        assert any("salvage" in p.detail for p in bad)
        fixed = verify_bank(bank, fix=True)
        assert not fixed.removed_blocks and bank.stats().blocks == blocks


def test_show_resolves_a_prefix_over_blocks_and_end_records_together(
    bank_path: Path,
) -> None:
    """A prefix that starts a block hash and an end hash is ambiguous (show never picks
    one kind silently), and one that starts only end records lists them."""
    from tool_banks import assert_one_line_error, cas_bank, cas_bank_json

    _prompts_with_ends(bank_path, 12, 12)
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        blocks = [k.hex() for k in bank.store.keys(Family.HEADERS)]
        ends = [k[32:].hex() for k in bank.store.keys(Family.ENDS)]
    both = next(
        d
        for d in "0123456789abcdef"
        if any(b[0] == d for b in blocks) and any(e[0] == d for e in ends)
    )
    assert_one_line_error(cas_bank("show", bank_path, both), "ambiguous", "give more digits")
    pairs = [(a, b) for a in ends for b in ends if a < b]
    only_ends = next(
        a[:k]
        for a, b in pairs
        for k in range(1, 8)
        if a[:k] == b[:k] and not any(x.startswith(a[:k]) for x in blocks)
    )
    assert_one_line_error(cas_bank("show", bank_path, only_ends), "ambiguous")
    shown = cas_bank_json("show", bank_path, ends[0])
    assert shown["end"] == ends[0]
