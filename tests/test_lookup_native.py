"""The native lookup helpers (`cas_bank._chain`) against their Python paths: a chain
record's and a prefix record's headers, and a lookup's end-record keys, the same for
any bytes, damaged ones too. Skipped where the helper is not built (the Python paths
are then the ones that run: tests/test_lookup.py covers them)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank.blocks.hashing import BlockHash, end_hashes
from cas_bank.index import chain_records, ends, prefixes
from cas_bank.index.chain import Header
from cas_bank.index.header import FIXED


@given(
    n=st.integers(1, 80),
    step=st.sampled_from([4, 16, 64]),
    cuts=st.lists(st.integers(0, 10**6), max_size=3),
    short=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=200, deadline=None)
def test_the_native_records_decoder_is_the_python_one(
    n: int, step: int, cuts: list[int], short: bool, seed: int
) -> None:
    """`cas_bank._chain.run` makes the very headers `_python_run` makes of any record
    bytes, damaged ones too (a flipped bit ends the list at its entry)."""
    if chain_records.decode_run is chain_records.python_run:
        pytest.skip("the native helper is not built")
    rng = np.random.default_rng(seed)
    root = rng.bytes(32)
    hashes = [BlockHash(rng.bytes(32)) for _ in range(n)]
    tokens = rng.bytes(n * step)
    first = int(rng.integers(0, n))
    count = int(rng.integers(0, n - first + 1))
    fixed = []
    for i in range(first, first + count):
        state = rng.bytes(32) if rng.random() < 0.3 else None
        h = Header(hashes[i], root if i == 0 else hashes[i - 1], i, root, rng.bytes(32),
                   int(rng.integers(0, 2**40)), tokens[i * step : (i + 1) * step], state,
                   int(rng.integers(0, 2**40)) if state else 0)  # fmt: skip
        fixed.append(h.encode()[: FIXED.size])
    raw = bytearray(chain_records.encode_run(first, 0, fixed))
    for c in cuts:
        if len(raw) > 16:
            raw[16 + c % (len(raw) - 16)] ^= 1 << (c % 8)
    data = memoryview(tokens[: len(tokens) // 2] if short else tokens)
    args = (bytes(raw), 16, first, count, root, hashes, data, step)
    assert chain_records.decode_run(*args) == chain_records.python_run(*args)


@given(
    n=st.one_of(st.integers(1, 80), st.integers(256, 300)),
    step=st.sampled_from([4, 16, 64]),
    base=st.sampled_from([0, 2**16 - 1]),
    epoch=st.integers(0, 2**64 - 1),
    cuts=st.lists(st.integers(0, 10**6), max_size=3),
    short=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=200, deadline=None)
def test_the_native_prefix_decoder_is_the_python_one(
    n: int, step: int, base: int, epoch: int, cuts: list[int], short: bool, seed: int
) -> None:
    """`cas_bank._chain.prefix_record` makes the very record `python_prefix_record`
    makes of any prefix record's bytes (its headers and their chain hashes), damaged
    ones too (None both). Every field of the head at its width: counts past a byte,
    first blocks past two, epochs to 2**64 - 1."""
    if prefixes.decode_prefix_record is prefixes.python_prefix_record:
        pytest.skip("the native helper is not built")
    rng = np.random.default_rng(seed)
    root = rng.bytes(32)
    # names[k + 1]: block base + k's chain hash; names[0] the block before (root: none)
    names = [root if base == 0 else BlockHash(rng.bytes(32))]
    names += [BlockHash(rng.bytes(32)) for _ in range(n)]
    tokens = bytes(base * step) + rng.bytes(n * step)
    whole_chain = rng.random() < 0.5  # of all n blocks but a few: counts past a byte
    count = n - int(rng.integers(0, min(n, 4))) if whole_chain else int(rng.integers(1, n + 1))
    start = int(rng.integers(0, n - count + 1))
    first = base + start
    fixed = []
    for k in range(start, start + count):
        i = base + k
        state = rng.bytes(32) if rng.random() < 0.3 else None
        h = Header(names[k + 1], names[k], i, root, rng.bytes(32),
                   int(rng.integers(0, 2**40)), tokens[i * step : (i + 1) * step], state,
                   int(rng.integers(0, 2**40)) if state else 0)  # fmt: skip
        fixed.append(h.encode()[: FIXED.size])
    raw = bytearray(prefixes.encode_prefix(first, epoch, fixed, names[start + count]))
    for c in cuts:  # the head too: its version, flags, count, first block and epoch
        raw[c % len(raw)] ^= 1 << (c % 8)
    data = memoryview(tokens[: len(tokens) - n * step // 2] if short else tokens)
    args = (bytes(raw), root, data, step, prefixes.PrefixRun)
    got = prefixes.decode_prefix_record(*args)
    assert got == prefixes.python_prefix_record(*args)
    assert got is None or type(got) is prefixes.PrefixRun
    if not cuts and not short:  # whole: the headers the record was made of
        assert got is not None and (got.epoch, got.first) == (epoch, first)
        assert list(got.hashes) == names[start + 1 : start + count + 1]
        assert [h.chain_hash for h in got.headers] == names[start + 1 : start + count + 1]
        assert [h.encode()[: FIXED.size] for h in got.headers] == fixed
        assert [h.tokens for h in got.headers] == [tokens[i * step : (i + 1) * step] for i in
                                                   range(first, first + count)]  # fmt: skip
    # A record a byte short or long, or with the chain record's flag, is none.
    whole = bytes(raw)
    others = [whole[:-1], whole + b"\0", whole[:1] + b"\1" + whole[2:]]
    if first == 0:  # block 0's parent is the root: a first entry naming another is none
        others.append(whole[:40] + bytes([whole[40] ^ 1]) + whole[41:])
    for other in others:
        assert prefixes.decode_prefix_record(other, root, data, step, prefixes.PrefixRun) is None
        assert prefixes.python_prefix_record(other, root, data, step, prefixes.PrefixRun) is None


@given(tail=st.integers(0, 64), seed=st.integers(0, 2**32 - 1), strided=st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_native_end_keys_are_the_python_ones(tail: int, seed: int, strided: bool) -> None:
    """`ends.candidate_keys` in C names the very keys, in the same order (the whole tail
    first), that `end_hashes` makes: each `end_key` of the parent and a prefix of the
    tail, from a strided array of ids too."""
    if ends._native_end_keys is None:
        pytest.skip("the native helper is not built")
    rng = np.random.default_rng(seed)
    parent = rng.bytes(32)
    ids = rng.integers(0, 2**32, 2 * tail, dtype=np.uint32)
    tokens = ids[::2] if strided else ids[:tail]
    got = ends.candidate_keys(parent, tokens)
    data = tokens.astype("<u4").tobytes()
    assert got == [bytes(parent) + h for h in reversed(end_hashes(parent, data))]
    assert got == [ends.end_key(parent, data[: 4 * t]) for t in range(tail, -1, -1)]
