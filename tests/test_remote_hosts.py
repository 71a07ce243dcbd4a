"""Three hosts, three processes, three bank directories, one Valkey cluster: an empty
host restores, bit for bit, what the others stored (plain and hybrid models, states
and end records included: an exact repeat restores every token and the logits), and
the cluster holds each distinct block, state and end record once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from conftest import PYTHON, TESTS_DIR, child_env, prefix_layers
from remote_host import (
    AGENTS,
    BLOCK,
    OWN_BLOCKS,
    SYSTEM_BLOCKS,
    asked,
    digest,
    end_logits,
    end_state,
    hybrid_spec,
    plain_spec,
    prompt,
    state_at,
)

from cas_bank.spec import merge_layers


def _host(role: str, bank: Path, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, str(TESTS_DIR / "remote_host.py"), role, str(bank), url],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


def _expected(agent: int, hybrid: bool) -> list[Any]:
    toks = prompt(agent)
    spec = hybrid_spec() if hybrid else plain_spec()
    layers = prefix_layers(spec, toks)
    if not hybrid:
        return [len(toks), digest(layers)]
    # The restore point of the full prompt is its last boundary, where a state was kept.
    state = state_at(agent, len(toks))
    return [len(toks), digest(merge_layers(layers, state))]


def _expected_exact(agent: int, hybrid: bool) -> list[Any]:
    toks = asked(agent)
    spec = hybrid_spec() if hybrid else plain_spec()
    layers = prefix_layers(spec, toks)
    if hybrid:
        layers = merge_layers(layers, end_state(agent))
    return [len(toks), digest(layers), digest([[end_logits(agent)]])]


def test_an_empty_host_restores_what_two_others_stored(cluster: Any, tmp_path: Path) -> None:
    # Hosts 0 and 1 store at the same time (both publish the shared system prompt).
    storers = [
        _host("store-0,1", tmp_path / "host0", cluster.url(0)),
        _host("store-2", tmp_path / "host1", cluster.url(1)),
    ]
    stored = [_result(p) for p in storers]
    restored = _result(_host("restore", tmp_path / "host2", cluster.url(2)))

    for agent in range(AGENTS):
        assert restored["restored"][f"plain-{agent}"] == _expected(agent, hybrid=False)
        assert restored["restored"][f"hybrid-{agent}"] == _expected(agent, hybrid=True)
        assert restored["exact"][f"plain-{agent}"] == _expected_exact(agent, hybrid=False)
        assert restored["exact"][f"hybrid-{agent}"] == _expected_exact(agent, hybrid=True)
    s = restored["stats"]
    assert s["remote_rejected"] == 0 and s["remote_errors"] == 0
    n = SYSTEM_BLOCKS + OWN_BLOCKS
    # Blocks fetched for one agent are local for the next once written (in the background);
    # the end records' tails come from the cluster (their blocks are local by then or not).
    first_all = 2 * (n + (AGENTS - 1) * OWN_BLOCKS) * BLOCK
    tails = 2 * sum(len(asked(a)) - n * BLOCK for a in range(AGENTS))
    assert first_all + tails <= s["remote_hit_tokens"] <= 2 * AGENTS * n * BLOCK + tails
    assert s["exact_hits"] == 2 * AGENTS

    # The cluster against the lower bound: every distinct block and kept state once.
    blocks: dict[str, list[int]] = {}
    for host in stored:
        for key, (payload, state) in host["blocks"].items():
            old = blocks.get(key, [0, 0])
            blocks[key] = [payload, max(state, old[1])]
    distinct = 2 * (SYSTEM_BLOCKS + AGENTS * OWN_BLOCKS)  # plain and hybrid
    assert len(blocks) == distinct
    end_records = {k: n for host in stored for k, n in host["ends"].items()}
    assert len(end_records) == 2 * AGENTS
    lower = sum(p + s for p, s in blocks.values()) + sum(end_records.values())
    held = cluster.memory_usage()
    assert lower <= held <= 1.05 * lower, (held, lower, held / lower)
    published = sum(h["stats"]["remote_publishes"] for h in stored)
    states = sum(1 for _, s in blocks.values() if s)
    assert published == distinct + states + len(end_records)  # nothing published twice
