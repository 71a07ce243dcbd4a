"""`StateRecorder`: recurrent states at the block boundaries that decoding crosses.

`PrefixCache.prefill` captures the states a prompt needs by ending its chunks on
boundaries. Decoding runs one token per forward pass, so nothing stops it at a
boundary; instead, call `observe()` after every forward pass: when the cache has
just reached a boundary, it copies every recurrent layer's state (before the next
forward pass can replace it). Hand the recorder to `PrefixCache.store` with the
prompt + response tokens; it gives the deepest captured boundary strictly before
the last token (the state a next turn restores from) and any stride boundaries.

The position is read from the cache itself (an attention layer's offset), so the
snapshot and its position always agree: a recorder can miss a boundary (observe not
called while the cache sat there), never mislabel one. With `mlx_lm.generate_step`,
call `observe()` at every yield: generate_step has already fed the yielded token
(it runs one step ahead), so the cache sits at prompt + tokens yielded; the one
position it passes before its first yield (prompt + 1) is not seen.

Memory: the two deepest captures are kept (plus stride boundaries), whatever the
length of the generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cas_bank.errors import InvalidInputError
from cas_bank.spec import ModelSpec

from .cache_io import snapshot_states


class StateRecorder:
    """Snapshots a hybrid model's recurrent states when its cache hits a boundary."""

    def __init__(
        self,
        spec: ModelSpec,
        block_size: int,
        cache: Sequence[Any],
        *,
        stride: int | None = None,
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self.cache = cache
        self.stride = stride
        self._attention = spec.attention_layers[0] if spec.attention_layers else None
        self._states: dict[int, list[Any]] = {}

    def position(self) -> int:
        """Tokens the cache holds now."""
        if self._attention is None:
            raise InvalidInputError(
                "this model has no attention layer to read the position from: pass "
                "observe(position=...)"
            )
        return int(self.cache[self._attention].offset)

    def observe(self, position: int | None = None) -> int | None:
        """Call after each forward pass; returns the boundary captured, if any."""
        if not self.spec.is_hybrid:
            return None
        pos = self.position() if position is None else position
        if pos <= 0 or pos % self.block_size or pos in self._states:
            return None
        self._states[pos] = snapshot_states(self.spec, self.cache)
        self._forget()
        return pos

    def _forget(self) -> None:
        """Keep the two deepest captures and the stride boundaries."""
        step = (self.stride or 0) * self.block_size
        recent = sorted(self._states)[-2:]
        for b in list(self._states):
            if b not in recent and not (step and b % step == 0):
                del self._states[b]

    @property
    def captured(self) -> list[int]:
        """Boundaries whose states are held, ascending."""
        return sorted(self._states)

    def states_for(self, n_tokens: int) -> dict[int, list[Any]]:
        """The states to store with `n_tokens` tokens: the deepest boundary strictly
        before the last token, and the stride boundaries, among those captured."""
        below = [b for b in self._states if b <= n_tokens - 1]
        step = (self.stride or 0) * self.block_size
        chosen = {b for b in below if step and b % step == 0}
        if below:
            chosen.add(max(below))
        return {b: self._states[b] for b in sorted(chosen)}
