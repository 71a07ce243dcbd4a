"""Writing less: bytes written are counted exactly, and `BankConfig.admit` /
`admit_min_tokens` leave out what is not worth an SSD write, the chain staying whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    prefix_layers,
    random_layers,
    random_state,
    tokens_of,
)

from cas_bank import Bank, BankConfig

B = BLOCK_SIZE


def test_bytes_written_are_counted_exactly_and_persist(bank_path: Path) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(1)
    a = tokens_of(rng, 4 * B)
    b = [*a[: 2 * B], *tokens_of(rng, 3 * B)]
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        ns = bank.namespace(spec)
        reports = [ns.store(t, prefix_layers(spec, t)) for t in (a, b, a)]
        assert reports[2].bytes_written == 0
        total = sum(r.bytes_written for r in reports)
        assert total > 0 and bank.stats().bytes_written == total
        assert total == bank.stats().payload_bytes  # nothing rewritten, nothing evicted
    with Bank.open(bank_path) as bank:
        assert bank.stats().bytes_written == total


def test_second_use_writes_a_block_the_second_time_it_is_offered(bank_path: Path) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(2)
    turn1 = tokens_of(rng, 3 * B)
    turn2 = [*turn1, *tokens_of(rng, 2 * B)]
    with Bank.open(bank_path, BankConfig(block_size=B, admit="second_use")) as bank:
        ns = bank.namespace(spec)
        first = ns.store(turn1, prefix_layers(spec, turn1))
        assert first.blocks_written == 0 and ns.match(turn1) == 0
        second = ns.store(turn2, prefix_layers(spec, turn2))  # turn 1 again, and more
        assert second.blocks_written == 3 and ns.match(turn2) == 3 * B
        third = ns.store(turn2, prefix_layers(spec, turn2))
        assert third.blocks_written == 2 and ns.match(turn2) == 5 * B
        s = bank.stats()
        assert s.blocks_deferred == 3 + 2 and s.blocks == 5
        hit = ns.restore(turn2)
        assert hit is not None and hit.tokens == 5 * B


def test_min_tokens_leaves_short_prompts_out(bank_path: Path) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(3)
    short, long = tokens_of(rng, 2 * B + 3), tokens_of(rng, 4 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, admit_min_tokens=3 * B)) as bank:
        ns = bank.namespace(spec)
        assert ns.store(short, prefix_layers(spec, short)).blocks_written == 0
        assert ns.store(long, prefix_layers(spec, long)).blocks_written == 4
        assert bank.stats().blocks_deferred == 2


def test_a_state_waits_for_its_block(bank_path: Path) -> None:
    spec = hybrid_spec()
    tokens = tokens_of(np.random.default_rng(4), 3 * B)
    layers = random_layers(spec, len(tokens), seed=4)
    states = {2 * B: random_state(spec, 4), 3 * B: random_state(spec, 5)}
    with Bank.open(bank_path, BankConfig(block_size=B, admit="second_use")) as bank:
        ns = bank.namespace(spec)
        first = ns.store(tokens, layers, states)
        assert (first.blocks_written, first.states_written) == (0, 0)
        second = ns.store(tokens, layers, states)
        assert (second.blocks_written, second.states_written) == (3, 2)
        assert ns.match(tokens) == 3 * B
