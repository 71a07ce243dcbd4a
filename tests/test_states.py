"""The state capture policy (`index.chain.plan_boundaries`) and the restore-point rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cas_bank.index.chain import Header, plan_boundaries, restore_blocks


@st.composite
def plans(draw: st.DrawFn) -> dict[str, object]:
    block = draw(st.sampled_from([1, 4, 16, 64]))
    n = draw(st.integers(1, 40 * block))
    start = draw(st.integers(0, n - 1)) // block * block
    matched = draw(st.integers(0, n // block))
    stored = set(draw(st.lists(st.integers(1, n // block + 1).map(lambda b: b * block))))
    stride = draw(st.none() | st.integers(1, 8))
    hints = draw(st.lists(st.integers(0, n + 5), max_size=3))
    return dict(
        block=block, n=n, start=start, matched=matched, stored=stored, stride=stride, hints=hints
    )


@given(plans())
def test_every_planned_boundary_is_new_and_inside_the_prefill(p: dict) -> None:
    block, n, start = p["block"], p["n"], p["start"]
    out = plan_boundaries(
        n,
        block,
        start=start,
        matched_blocks=p["matched"],
        stored_states=p["stored"],
        stride=p["stride"],
        hints=p["hints"],
    )
    assert out == sorted(set(out))
    for b in out:
        assert b % block == 0 and start < b <= n and b not in p["stored"]


@given(plans())
def test_the_policy_asks_for_each_of_its_four_kinds_of_boundary(p: dict) -> None:
    block, n, start, stored = p["block"], p["n"], p["start"], p["stored"]
    out = set(
        plan_boundaries(
            n,
            block,
            start=start,
            matched_blocks=p["matched"],
            stored_states=stored,
            stride=p["stride"],
            hints=p["hints"],
        )
    )
    expected = {p["matched"] * block}  # the branch point
    if n > 1:
        expected.add((n - 1) // block * block)  # deepest boundary before the last token
    if p["stride"]:
        expected.update(range(p["stride"] * block, n, p["stride"] * block))
    expected.update(h // block * block for h in p["hints"] if 0 < h <= n)
    assert out == {b for b in expected if start < b <= n and b not in stored}


def test_hints_round_down_to_a_boundary() -> None:
    # A system prompt ending at token 150 of a 400-token prompt, blocks of 64: the state
    # at 128 lets the next agent restore the system prompt's two full blocks.
    out = plan_boundaries(400, 64, start=0, matched_blocks=0, stored_states=set(), hints=[150])
    assert out == [128, 384]


def _header(i: int, state: bool) -> Header:
    return Header(
        chain_hash=bytes([i]) * 32,
        parent=bytes(32),
        index=i,
        root=bytes(32),
        payload_digest=bytes(32),
        payload_size=0,
        tokens=bytes(8),
        state_digest=bytes(32) if state else None,
    )


@given(st.lists(st.booleans(), max_size=12))
def test_restore_point_is_the_deepest_matched_block_with_a_state(states: list[bool]) -> None:
    matched = [_header(i, s) for i, s in enumerate(states)]
    assert restore_blocks(matched, hybrid=False) == len(matched)
    deepest = max((i + 1 for i, s in enumerate(states) if s), default=0)
    assert restore_blocks(matched, hybrid=True) == deepest
