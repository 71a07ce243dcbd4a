"""`cas_bank.index.tree`: hash prefixes, children and chain counts, the collapsed prefix
tree; and `cas-bank tree` on a real bank (human and --json)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BLOCK_SIZE
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_banks import BuiltBank, assert_one_line_error, build_bank, cas_bank, cas_bank_json

from cas_bank import Bank
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.errors import InvalidInputError
from cas_bank.index.tree import (
    AmbiguousPrefixError,
    HeaderIndex,
    UnknownHashError,
    prefix_tree,
    resolve_prefix,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltBank:
    return build_bank(tmp_path_factory.mktemp("tree") / "bank")


@pytest.fixture(scope="module")
def index(built: BuiltBank) -> HeaderIndex:
    with Bank.open(built.path, mode="read_only") as bank:
        return HeaderIndex.load(bank.store)


# -- hash prefixes ---------------------------------------------------------------------
KEYS = [bytes.fromhex(h) for h in ("ab12" + "0" * 60, "ab34" + "0" * 60, "cd00" + "1" * 60)]


def test_a_unique_prefix_names_its_key_in_any_case() -> None:
    assert resolve_prefix("ab1", KEYS) == KEYS[0]
    assert resolve_prefix("CD", KEYS) == KEYS[2]
    assert resolve_prefix(KEYS[1].hex(), KEYS) == KEYS[1]


def test_an_ambiguous_prefix_lists_every_candidate() -> None:
    with pytest.raises(AmbiguousPrefixError) as e:
        resolve_prefix("ab", KEYS)
    assert e.value.candidates == sorted(KEYS[:2])
    assert "ab12" in str(e.value) and "ab34" in str(e.value) and "ambiguous" in str(e.value)


@pytest.mark.parametrize("bad", ["", "xyz", "ab-1", "a" * 65])
def test_a_prefix_that_is_not_hex_is_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="not a block hash"):
        resolve_prefix(bad, KEYS)


def test_an_unknown_prefix_says_so() -> None:
    with pytest.raises(UnknownHashError, match="no block hash starts with 'ef'"):
        resolve_prefix("ef", KEYS)


@settings(max_examples=40, deadline=None)
@given(
    keys=st.sets(st.binary(min_size=32, max_size=32), min_size=1, max_size=20),
    pick=st.integers(min_value=0),
    length=st.integers(min_value=1, max_value=64),
)
def test_a_prefix_resolves_exactly_when_no_other_key_shares_it(
    keys: set[bytes], pick: int, length: int
) -> None:
    ordered = sorted(keys)
    target = ordered[pick % len(ordered)]
    prefix = target.hex()[:length]
    sharing = [k for k in ordered if k.hex().startswith(prefix)]
    if len(sharing) == 1:
        assert resolve_prefix(prefix, ordered) == target
    else:
        with pytest.raises(AmbiguousPrefixError) as e:
            resolve_prefix(prefix, ordered)
        assert e.value.candidates == sharing


# -- children, chains, paths -----------------------------------------------------------
def test_chains_through_a_block_count_the_prompts_sharing_it(
    built: BuiltBank, index: HeaderIndex
) -> None:
    agents = [built.chains[f"agent{i}"] for i in range(4)]
    for block in agents[0][:3]:  # the system prompt: all four agents
        assert index.chains_through(block) == 4
    assert agents[0][3] == agents[1][3]  # the shared tool block
    assert index.chains_through(agents[0][3]) == 2
    assert index.chains_through(agents[2][3]) == 1
    assert index.chains_through(agents[0][-1]) == 1  # a leaf counts itself
    assert index.chains_through(built.chains["text0"][0]) == 1


def test_children_follow_the_branches(built: BuiltBank, index: HeaderIndex) -> None:
    agents = [built.chains[f"agent{i}"] for i in range(4)]
    kids = {h.chain_hash for h in index.children_of(agents[0][2])}
    assert kids == {agents[0][3], agents[2][3], agents[3][3]}
    assert index.children_of(agents[3][-1]) == []
    assert index.descendants([agents[0][3]]) == set(agents[0][4:]) | set(agents[1][4:])


def test_path_walks_parents_up_to_the_first_block(built: BuiltBank, index: HeaderIndex) -> None:
    chain = built.chains["hybrid"]
    assert [h.chain_hash for h in index.path(chain[-1])] == chain
    assert [h.index for h in index.path(chain[2])] == [0, 1, 2]


def test_subtree_bytes_sum_payloads_and_states(built: BuiltBank, index: HeaderIndex) -> None:
    chain = built.chains["hybrid"]
    heads = [index.headers[h] for h in chain]
    assert index.subtree_bytes(chain[0]) == sum(h.payload_size + h.state_size for h in heads)


# -- the prefix tree -------------------------------------------------------------------
def test_the_fleet_tree_collapses_runs_and_branches_with_counts(
    built: BuiltBank, index: HeaderIndex
) -> None:
    root = index.headers[built.chains["agent0"][0]].root
    (trunk,) = prefix_tree(index, root)
    assert [h.chain_hash for h in trunk.blocks] == built.chains["agent0"][:3]
    assert trunk.chains == 4
    # Most shared branch first: the tool block (2 chains), then two single agents.
    assert [c.chains for c in trunk.children] == [2, 1, 1]
    tool = trunk.children[0]
    assert [len(c.blocks) for c in tool.children] in ([1, 2], [2, 1])
    assert {c.last.chain_hash for c in tool.children} == {
        built.chains["agent0"][-1],
        built.chains["agent1"][-1],
    }
    # Agent 3's own run is one block; agent 2's two blocks are collapsed into one node.
    singles = {len(c.blocks) for c in trunk.children[1:]}
    assert singles == {1, 2}
    assert trunk.subtree_bytes == sum(
        index.headers[h].payload_size for h in index.descendants([root])
    )


def test_a_lone_chain_is_one_node(built: BuiltBank, index: HeaderIndex) -> None:
    chain = built.chains["hybrid"]
    (node,) = prefix_tree(index, index.headers[chain[0]].root)
    assert [h.chain_hash for h in node.blocks] == chain
    assert node.children == [] and node.chains == 1


# -- cas-bank tree ---------------------------------------------------------------------
def test_tree_command_shows_the_shared_prefix_and_where_it_branches(built: BuiltBank) -> None:
    out = cas_bank("tree", built.path, check=True).stdout
    trunk = built.chains["agent0"]
    line = next(ln for ln in out.splitlines() if trunk[0].hex()[:12] in ln)
    assert f"{trunk[2].hex()[:12]}" in line and "blocks 0-2 (3)" in line and "4 chains" in line
    assert "fleet" in out and "tiny-hybrid" in out and "2 states" in out
    assert "2 chains" in out  # the tool block shared by two agents

    data = cas_bank_json("tree", built.path)
    fleet = next(g for g in data if g["namespace"] == "fleet")
    assert fleet["chains"] == 4 and fleet["blocks"] == 10
    (node,) = fleet["children"]
    assert (node["start"], node["end"], node["blocks"], node["chains"]) == (0, 2, 3, 4)
    assert node["first"] == trunk[0].hex() and node["last"] == trunk[2].hex()
    assert sorted(c["chains"] for c in node["children"]) == [1, 1, 2]
    assert node["subtree_bytes"] > node["bytes"] > 0

    only = cas_bank_json("tree", built.path, "--namespace", "tiny-hybrid")
    assert [g["namespace"] for g in only] == ["tiny-hybrid"]
    assert only[0]["children"][0]["states"] == 2


def test_tree_shows_a_dangling_run_under_its_missing_parent(tmp_path: Path) -> None:
    built = build_bank(tmp_path / "bank")
    chain = built.chains["text1"]
    store = RocksStore(built.path)
    store.put_batch([(Family.HEADERS, chain[2], None)])
    store.close()
    data = cas_bank_json("tree", built.path)
    (unattached,) = [g for g in data if "unattached_below" in g]
    assert unattached["unattached_below"] == chain[2].hex()
    (node,) = unattached["children"]
    assert node["first"] == chain[3].hex() and node["blocks"] == len(chain) - 3
    out = cas_bank("tree", built.path, check=True).stdout
    assert f"parent {chain[2].hex()[:12]} is not stored" in out


def test_tree_of_an_unknown_namespace_is_a_one_line_error(built: BuiltBank) -> None:
    proc = cas_bank("tree", built.path, "--namespace", "nope")
    assert_one_line_error(proc, "no namespace 'nope'", "fleet")
    assert BLOCK_SIZE == 4  # the counts above assume 4-token blocks
