"""Recurrent (GDN) states at block boundaries, and the restore-point rule.

A state cannot be cut from a longer one, so it is captured exactly at a boundary and
stored under the chain hash of the block that ends there. The restore point of a
hybrid model is the deepest matched boundary with a stored state: KV of length n is
never combined with a state of another position (docs/design.md, "State capture policy").

The capture policy (`plan_boundaries`) names the boundaries a prefill should stop at:
  1. the deepest boundary strictly before the prompt's last token, so the same prompt
     again, or its next turn, restores all but the tail;
  2. the branch point: the boundary where the prompt leaves the stored chain, so the
     next agent sharing the same system prompt restores exactly to its end;
  3. every `stride` blocks, when a stride is set;
  4. the deepest boundary at or below each hint: a position the runtime knows to be a
     likely branch point (the end of a chat's system prompt), so that even the second
     agent sharing it restores exactly up to it.
Boundaries at or before the restore start, or that already hold a state, are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cas_bank.index.chain import Header


def restore_blocks(matched: Sequence[Header], hybrid: bool) -> int:
    """How many of the matched blocks a restore can cover."""
    if not hybrid:
        return len(matched)
    for i in range(len(matched) - 1, -1, -1):
        if matched[i].has_state:
            return i + 1
    return 0


def plan_boundaries(
    n_tokens: int,
    block_size: int,
    *,
    start: int,
    matched_blocks: int,
    stored_states: set[int],
    stride: int | None = None,
    hints: Iterable[int] = (),
) -> list[int]:
    """Token boundaries (ascending) where a prefill of `n_tokens` should capture states.

    `start`: tokens already restored; `matched_blocks`: full blocks of the prompt already
    in the bank; `stored_states`: boundaries that already hold a state.
    """
    wanted: set[int] = set()
    if n_tokens > 1:
        wanted.add(((n_tokens - 1) // block_size) * block_size)
    wanted.add(matched_blocks * block_size)
    wanted.update((h // block_size) * block_size for h in hints if 0 < h <= n_tokens)
    if stride:
        step = stride * block_size
        wanted.update(range(step, n_tokens, step))
    return sorted(b for b in wanted if start < b <= n_tokens and b not in stored_states)
