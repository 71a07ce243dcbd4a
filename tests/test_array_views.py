"""`cas_bank.arrays`' numpy views and buffer addresses, read from the buffers themselves
(bf16 without an MLX view op), against what MLX's own view says: the same bits, the
same memory (a write through the view lands in the array), the same address; and the
rows a queued end record copies (`copied_rows`), bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cas_bank.arrays import (
    HeldArrays,
    address_of,
    buffer_address,
    compacted,
    copied_rows,
    to_numpy,
)

DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int8]


def _array(dtype: mx.Dtype, tokens: int = 300) -> mx.array:
    a = (mx.random.normal((1, 2, tokens, 16), key=mx.random.key(3)) * 50).astype(dtype)
    mx.eval(a)
    return a


def _mlx_bits(a: mx.array) -> np.ndarray:
    """`a`'s bits as MLX's own view gives them (bf16 as uint16), copied."""
    view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.array(view)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [None, (5, 100)], ids=["whole", "sliced"])
def test_a_numpy_view_is_the_arrays_own_memory(
    dtype: mx.Dtype, rows: tuple[int, int] | None
) -> None:
    a = _array(dtype)
    if rows is not None:  # not contiguous: the view goes through MLX
        a = a[..., rows[0] : rows[1], :]
        mx.eval(a)
    view = to_numpy(a)
    want = _mlx_bits(a)
    assert view.dtype == want.dtype and view.shape == want.shape
    assert np.array_equal(view, want)
    assert buffer_address(a) == address_of(view)
    assert HeldArrays([a]).addresses()[0] == address_of(view)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_a_write_through_the_view_lands_in_the_array(dtype: mx.Dtype) -> None:
    a = mx.zeros((1, 2, 8, 4), dtype=dtype)
    mx.eval(a)
    view = to_numpy(a)
    assert view.flags.writeable
    one = _mlx_bits(mx.ones((1,), dtype=dtype))[0]
    view[0, 1, 3, 2] = one
    assert a[0, 1, 3, 2].item() == 1 and float(mx.sum(a).item()) == 1


def test_an_unevaluated_array_is_evaluated_first() -> None:
    lazy = mx.ones((4, 4), dtype=mx.bfloat16) * 3
    assert np.array_equal(to_numpy(lazy), _mlx_bits(mx.full((4, 4), 3, dtype=mx.bfloat16)))
    assert buffer_address(mx.ones((2, 2)) * 2) != 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lo,hi", [(256, 257), (0, 63), (280, 300)])
def test_copied_rows_are_those_rows_and_own_their_memory(dtype: mx.Dtype, lo: int, hi: int) -> None:
    arrays = [_array(dtype), _array(dtype)[..., ::-1, :]]  # one contiguous, one not
    mx.eval(arrays)
    copies = copied_rows(arrays, lo, hi)
    for a, c in zip(arrays, copies, strict=True):
        assert c.dtype == a.dtype and c.shape == (1, 2, hi - lo, 16)
        assert np.array_equal(_mlx_bits(c), _mlx_bits(a[..., lo:hi, :]))
        assert buffer_address(c) != buffer_address(a)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_compacted_copies_a_view_of_a_larger_buffer_and_keeps_any_other(dtype: mx.Dtype) -> None:
    whole = _array(dtype, tokens=600)  # 600 rows of 2 x 16: ~38-77 KiB
    tail = whole[:, :, -3:, :]  # the last rows: a view that keeps all of it alive
    few = _array(dtype, tokens=10)[:, :, -3:, :]  # within MLX's slack: kept as it is
    kept = [whole, whole.reshape(whole.shape), few]
    out = compacted([tail, *kept])
    assert buffer_address(out[0]) != buffer_address(tail)
    assert np.array_equal(_mlx_bits(out[0]), _mlx_bits(tail))
    assert all(o is a for o, a in zip(out[1:], kept, strict=True))
