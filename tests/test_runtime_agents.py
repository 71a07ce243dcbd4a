"""Many agents sharing a long system prompt on the hybrid model: the shared prefix is
stored once and, from the third agent on, restored in full; and model identity:
different weights never share a block, the same weights built twice share all."""

from __future__ import annotations

import numpy as np
from cas_bank.runtime import PrefixCache
from runtime_helpers import (
    bit_equal,
    close,
    random_tokens,
    same_schedule_logits,
    straight_logits,
    temp_bank,
    tiny,
)

BLOCK = 64
SYSTEM = 1000  # tokens; its full blocks end at 960


def test_agents_share_one_copy_of_the_system_prompt() -> None:
    rng = np.random.default_rng(12)
    system = random_tokens(rng, SYSTEM)
    tails = [random_tokens(rng, int(rng.integers(40, 140))) for _ in range(8)]
    prompts = [system + tail for tail in tails]
    with temp_bank(BLOCK) as bank:
        pc = PrefixCache(bank, tiny("tiny-hybrid"))
        restored = []
        for prompt in prompts:
            cache, n = pc.restore(prompt)
            restored.append(n)
            logits = pc.prefill(prompt, cache, n)
            bank.flush()  # committed before the next agent comes (the background writer)
        system_blocks = SYSTEM // BLOCK
        # Agent 1 stores a state only near its own end; agent 2's prefill captures the
        # branch point; every later agent restores the system prompt's full blocks.
        assert restored[:2] == [0, 0]
        assert restored[2:] == [system_blocks * BLOCK] * 6
        assert close(logits, straight_logits(pc, prompts[-1]), "float32")

        stats = bank.stats()
        unique = system_blocks + sum(len(p) // BLOCK - system_blocks for p in prompts)
        assert stats.blocks == unique
        block_bytes = pc.spec.token_bytes * BLOCK
        # Physical bytes: one copy of the shared blocks plus the tails' own blocks,
        # give or take the codec's per-block header.
        assert unique * block_bytes <= stats.payload_bytes <= unique * (block_bytes + 1024)
        logical = sum(len(p) // BLOCK for p in prompts) * block_bytes
        assert stats.payload_bytes < logical / 3
        # States: agent 2 adds the branch point; each agent at most its own deepest one.
        assert stats.states <= len(prompts) + 1
        assert stats.state_bytes <= stats.states * (pc.spec.state_bytes + 1024)


def test_different_weights_never_share_a_block() -> None:
    rng = np.random.default_rng(13)
    toks = random_tokens(rng, 100)
    with temp_bank(16) as bank:
        a = PrefixCache(bank, tiny("tiny-qwen3", seed=0))
        b = PrefixCache(bank, tiny("tiny-qwen3", seed=1))
        assert a.spec.layers == b.spec.layers
        assert a.namespace.root != b.namespace.root
        a.prefill(toks, a.new_cache())
        assert b.match(toks) == 0
        cache, n = b.restore(toks)
        assert n == 0
        b.prefill(toks, cache)
        bank.flush()
        assert bank.stats().blocks == 2 * (100 // 16)


def test_the_same_weights_built_twice_share_every_block() -> None:
    rng = np.random.default_rng(14)
    toks = random_tokens(rng, 100)
    first, second = tiny("tiny-hybrid"), tiny.__wrapped__("tiny-hybrid")
    assert first.model is not second.model
    with temp_bank(16) as bank:
        a = PrefixCache(bank, first)
        a.prefill(toks, a.new_cache())
        bank.flush()  # committed: a hybrid restores from the bank
        stored = a.last_prefill
        assert stored is not None
        blocks = bank.stats().blocks
        b = PrefixCache(bank, second)
        assert b.namespace.root == a.namespace.root
        more = [*toks, *random_tokens(rng, 10)]
        cache, n = b.restore(more)
        assert n == len(toks)  # a's end record
        logits = b.prefill(more, cache, n)
        report = b.last_prefill
        assert report is not None and b.last_pending is not None
        written = b.last_pending.result()  # the background writer's report
        assert written.blocks_existing == 6 and bank.stats().blocks == blocks + 0
        ends = report.chunk_ends
        assert bit_equal(logits, same_schedule_logits(a, toks, stored.chunk_ends, more, n, ends))
