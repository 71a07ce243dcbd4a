"""The native copy of a lease into a restore's destination arrays (`restore.row_runs`):
byte for byte what numpy copies, on one thread or two, and a clear refusal of what it
cannot address (the caller then copies with numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas_bank.arrays import address_of
from cas_bank.native import fill_module
from cas_bank.restore import row_runs

pytestmark = pytest.mark.skipif(not row_runs.available(), reason="native helper not loaded")


def _addresses(views: list[np.ndarray]) -> np.ndarray:
    return np.array([address_of(v) for v in views], dtype=np.int64)


@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    tokens=st.integers(1, 300),
    room=st.integers(0, 300),
    dim=st.integers(1, 96),
    dtype=st.sampled_from(["uint8", "uint16", "float32"]),
    arrays=st.integers(1, 5),
    two=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_a_planned_copy_is_numpys_copy(
    lead: list[int],
    tokens: int,
    room: int,
    dim: int,
    dtype: str,
    arrays: int,
    two: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, tokens + 1))
    sources = [rng.integers(0, 200, (*lead, tokens, dim)).astype(dtype) for _ in range(arrays)]
    dests = [np.full((*lead, tokens + room, dim), 7, dtype=dtype) for _ in range(arrays)]
    want = [d.copy() for d in dests]
    for w, s in zip(want, sources, strict=True):
        w[..., :rows, :] = s[..., :rows, :]
    plan = row_runs.plan_copy(dests, sources, _addresses(sources), rows)
    assert plan is not None
    row_runs.copy_planned(plan, _addresses(dests), two_threads=two)
    for got, w in zip(dests, want, strict=True):
        assert np.array_equal(got, w)  # the rows copied, and nothing past them written


def test_views_it_cannot_address_are_left_to_numpy() -> None:
    src = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
    dest = np.zeros((2, 16, 4), dtype=np.float32)
    strided = np.zeros((2, 16, 8), dtype=np.float32)[..., ::2]  # rows not contiguous
    before = dest.copy()
    for d, s in [(strided, src), (dest, src.transpose(0, 2, 1).copy().transpose(0, 2, 1))]:
        assert row_runs.plan_copy([d], [s], _addresses([src]), 8) is None
    assert np.array_equal(dest, before)
    short = np.zeros((2, 4, 4), dtype=np.float32)  # fewer rows than asked for
    assert row_runs.plan_copy([short], [src], _addresses([src]), 8) is None


def test_copy_runs_refuses_malformed_runs() -> None:
    assert fill_module is not None
    for two_threads in (True, False):
        with pytest.raises(ValueError, match="triples"):
            fill_module.copy_runs(b"\0" * 20, two_threads)
        with pytest.raises(ValueError, match="negative"):
            fill_module.copy_runs(np.array([0, 0, -1], dtype=np.int64).tobytes(), two_threads)


def test_one_plan_copies_into_any_destinations_of_its_shapes() -> None:
    """A plan (`plan_copy`, kept by a lease) placed at new destinations' addresses each
    time copies into those, and only those."""
    rng = np.random.default_rng(3)
    sources = [rng.integers(0, 200, (2, 40, 16)).astype(np.uint16) for _ in range(3)]
    first = [np.zeros((2, 64, 16), dtype=np.uint16) for _ in sources]
    plan = row_runs.plan_copy(first, sources, _addresses(sources), 33)
    assert plan is not None
    for two in (False, True):
        dests = [np.full((2, 64, 16), 9, dtype=np.uint16) for _ in sources]
        row_runs.copy_planned(plan, _addresses(dests), two_threads=two)
        for d, s in zip(dests, sources, strict=True):
            assert np.array_equal(d[:, :33], s[:, :33]) and (d[:, 33:] == 9).all()
    assert all((f == 0).all() for f in first)  # the views it was planned with: untouched


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    column=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_place_adds_each_views_address_to_its_runs(
    counts: list[int], column: int, seed: int
) -> None:
    """`_fill.place` (row runs at address 0 moved to each view's address, for the
    native reader's segments and a lease copy's plan) is numpy's repeat-and-add."""
    assert fill_module is not None
    rng = np.random.default_rng(seed)
    n = sum(counts)
    triples = rng.integers(0, 2**40, (n, 3), dtype=np.int64)
    triples.flags.writeable = False  # templates are kept read only
    per_view = np.array(counts, dtype=np.int64)
    addresses = rng.integers(0, 2**40, len(counts), dtype=np.int64)
    before = triples.copy()
    want = triples.copy()
    want[:, column] += np.repeat(addresses, per_view)
    assert fill_module.place(triples, per_view, addresses, column) == want.tobytes()
    assert np.array_equal(triples, before)  # a copy: the template stays as it was


def test_place_refuses_what_does_not_add_up() -> None:
    assert fill_module is not None
    triples = np.zeros((4, 3), dtype=np.int64)
    two = np.zeros(2, dtype=np.int64)
    cases = [
        (triples, np.array([1, 2], dtype=np.int64), two, 0, "add up"),  # 3 of 4 runs
        (triples, np.array([3, 2], dtype=np.int64), two, 0, "add up"),  # 5 of 4
        (triples, np.array([-1, 5], dtype=np.int64), two, 0, "add up"),
        (triples, np.array([4], dtype=np.int64), two, 0, "one int64 count and address"),
        (b"\0" * 20, np.array([0], dtype=np.int64), two[:1], 0, "triples"),
        (triples, np.array([2, 2], dtype=np.int64), two, 3, "column"),
    ]
    for runs, counts, addresses, column, why in cases:
        with pytest.raises(ValueError, match=why):
            fill_module.place(runs, counts, addresses, column)
