"""Prefix records (`index.prefixes`) that do not hold up: a damaged, stale or unlinked
record is a miss (the lookup goes on from the chain records and headers and finds what
they say), never an error, and its bytes cost the decoder no more than the prompt's
own; and the deepest stored block of a short last segment is found by its record."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
from conftest import attention_spec, random_layers
from test_lookup import B, _Counting, _query

from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family
from cas_bank.index import chain_records, prefixes
from cas_bank.index.chain import longest_chain, stored_chain
from cas_bank.index.header import FIXED

_PARENT = 16 + 24  # entry 0's parent field in a prefix record


def test_a_damaged_stale_or_unlinked_prefix_record_is_a_miss(tmp_path: Path) -> None:
    """130 blocks stored: the prefix records of blocks 63, 127 and 129. The second
    record truncated, of another version, with the chain record's flag, a count that
    is not its length, of another epoch or with its first entry's parent not the
    block before (an entry the decoder takes as it stands: the lookup links it), and
    the first with a parent that is not the root: each time the lookup reads more
    than the prefix records and gives what the headers say."""
    spec = attention_spec()
    tokens = list(range(130 * B))
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)))
        hashes = ns.chain(tokens)
        toks = np.asarray(tokens, dtype=np.uint32)
        want = longest_chain(ns.view(), ns.root, hashes)
        assert len(want) == 130
        keys = [chain_records.run_prefix(bank.store.get(Family.CHAINS, bytes(hashes[i])))
                for i in (63, 127)]  # fmt: skip
        assert keys[0] is not None and keys[1] is not None
        goods = [bank.store.get(Family.PREFIXES, k) for k in keys]
        assert goods[0] is not None and goods[1] is not None
        good = goods[1]

        def flipped(value: bytes, at: int) -> bytes:
            return value[:at] + bytes([value[at] ^ 1]) + value[at + 1 :]

        bads = [
            (keys[1], good[:-1]),
            (keys[1], b"\x02" + good[1:]),
            (keys[1], good[:1] + b"\x01" + good[2:]),
            (keys[1], flipped(good, 2)),  # count
            (keys[1], flipped(good, 8)),  # epoch
            (keys[1], flipped(good, _PARENT)),
            (keys[0], flipped(goods[0], _PARENT)),
        ]
        for key, bad in bads:
            bank.store.put_batch([(Family.PREFIXES, key, bad)])
            counting = _Counting(ns.view().store)
            assert stored_chain(counting, ns.root, toks, B) == (hashes, want)
            assert (counting.record_reads, counting.headers) != (0, 0)
            assert _query(ns, tokens) == (want, want)
        for key, good in zip(keys, goods, strict=True):
            bank.store.put_batch([(Family.PREFIXES, key, good)])
        counting = _Counting(ns.view().store)
        assert stored_chain(counting, ns.root, toks, B) == (hashes, want)
        assert (counting.prefix_reads, counting.record_reads, counting.headers) == (1, 0, 0)


def test_a_next_turn_of_one_block_finds_the_stored_end_by_its_record(tmp_path: Path) -> None:
    """A prompt one block past a stored chain of 100 blocks (its end the deepest block
    of the last segment but the prompt's own): the second multi-get's deepest key
    finds it; the one header after it is read, no chain record."""
    spec = attention_spec()
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 1000, 100 * B)]
    with Bank.open(tmp_path / "bank", BankConfig(block_size=B, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, random_layers(spec, len(tokens)))
        toks = np.asarray(tokens, dtype=np.uint32)
        want = longest_chain(ns.view(), ns.root, ns.chain(toks))
        turn = np.asarray(tokens + [5] * B, dtype=np.uint32)
        counting = _Counting(ns.view().store)
        assert stored_chain(counting, ns.root, turn, B) == (ns.chain(turn), want)
        assert (counting.prefix_reads, counting.record_reads, counting.headers) == (2, 0, 1)


def test_a_record_naming_a_block_far_past_the_prompt_costs_no_memory() -> None:
    """A damaged head whose first block is far past the prompt's (2**22 here; up to
    2**32 - 1 on disk) is none, in either decoder, without memory in proportion to it
    (the Python decoder once made a list of that many names first: 32 GiB at 2**32)."""
    root, step = bytes(32), 4 * B
    tokens = memoryview(bytes(2 * step))
    fixed = [bytes(FIXED.size)]
    for first in (2, 2**22):
        raw = prefixes.encode_prefix(first, 0, fixed, bytes(32))
        tracemalloc.start()
        try:
            got = prefixes.python_prefix_record(raw, root, tokens, step, prefixes.PrefixRun)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got is None and peak < 64 * 1024
        assert prefixes.decode_prefix_record(raw, root, tokens, step, prefixes.PrefixRun) is None
