"""What a restore puts after a chain's last whole block: an end record's tail
(`index.ends`) or a partial block's first tokens (`index.partial`), read, checked and
joined to the blocks before them (in the assembler's arrays, or a lease's)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from cas_bank.arrays import DType, dtype_named, from_numpy
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.index.ends import EndGone, EndPlan
from cas_bank.index.partial import PartialPlan
from cas_bank.restore.assemble import Assembler
from cas_bank.restore.payloads import PayloadReader
from cas_bank.spec import ModelSpec, group_layers
from cas_bank.stats import Counters

log = logging.getLogger("cas_bank")


def end_layers(
    spec: ModelSpec,
    end: EndPlan,
    assembler: Assembler | None,
    in_memory: Sequence[mx.array],
    *,
    room: bool,
) -> list[tuple[Any, ...] | None]:
    """The attention layers of a restore from `end`: its `end.blocks` blocks (in the
    `assembler`, or the arrays of a lease, `in_memory`) and its tail after them."""
    n = end.tokens - end.header.tail_len
    if assembler is not None:
        assembler.put_tail(n, end.payload.tail)
        return assembler.layers(end.blocks, room=room, tokens=end.tokens)
    tail = end.payload.tail_arrays()
    if end.blocks:  # the blocks from a lease, the tail after them
        tail = [
            mx.concatenate([a[..., :n, :], t], axis=-2)
            for a, t in zip(in_memory, tail, strict=True)
        ]
    return group_layers(spec, tail, None)


def read_partial(
    spec: ModelSpec, plan: PartialPlan, payloads: PayloadReader, counters: Counters
) -> list[np.ndarray] | None:
    """The first `plan.shared` tokens of every attention array of the child, as numpy
    views of its verified payload (bf16 as uint16), in spec order; None when it is
    missing or fails (counted and logged by the reader, or here for an end record)."""
    j = plan.shared
    specs = spec.block_arrays
    if plan.header is not None:
        h = plan.header
        block = plan.fetched
        if block is None and not plan.queued:  # a queued block is never read from a file
            block = payloads._read(Family.BLOCKS, h.chain_hash, h.payload_digest)
        if block is None:
            return None
        arrays = block.arrays
        fits = len(arrays) == len(specs) and all(
            a.shape == s.with_tokens(len(h.tokens) // 4) and a.dtype == dtype_named(s.dtype).storage
            for a, s in zip(arrays, specs, strict=False)
        )
        if not fits:
            payloads._corrupt(Family.BLOCKS, h.chain_hash, "block does not fit the spec")
            return None
        return [a[..., :j, :] for a in arrays]
    assert plan.end is not None
    try:
        return [a[..., :j, :] for a in plan.end.payload(spec).tail]
    except EndGone:  # its file was replaced or removed since its head was read: a miss
        return None
    except CorruptDataError as e:
        counters.count(corrupt_reads=1)
        log.warning(
            "cas_bank: end record %s failed verification (%s); no partial block",
            plan.end.header.key().hex()[64:80],
            e,
        )
        return None


def partial_layers(
    spec: ModelSpec,
    plan: PartialPlan,
    arrays: Sequence[np.ndarray],
    assembler: Assembler | None,
    in_memory: Sequence[mx.array],
    *,
    room: bool,
) -> list[tuple[Any, ...] | None]:
    """The attention layers of a restore ending in `plan`'s partial block: its
    `plan.blocks` blocks (in the `assembler`, or the arrays of a lease, `in_memory`)
    and the child's first tokens after them."""
    if assembler is not None:
        assembler.put_tail(plan.base, arrays)
        return assembler.layers(plan.blocks, room=room, tokens=plan.tokens)
    dtypes: list[DType] = [dtype_named(s.dtype) for s in spec.block_arrays]
    tail = [from_numpy(np.ascontiguousarray(a), d) for a, d in zip(arrays, dtypes, strict=True)]
    if plan.blocks:
        tail = [
            mx.concatenate([a[..., : plan.base, :], t], axis=-2)
            for a, t in zip(in_memory, tail, strict=True)
        ]
    return group_layers(spec, tail, None)
