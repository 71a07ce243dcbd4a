"""The copy-run tables of small RocksDB payloads (`restore.row_runs._block_runs`) are
kept within a byte bound: a layout of many runs a block made 13.5 MiB at 4096 blocks,
and sixteen kept by count held 27 MiB that no budget counted."""

from __future__ import annotations

import numpy as np

from cas_bank.restore import row_runs


def _template(runs: int) -> bytes:
    seg = np.zeros((runs, 3), dtype=np.int64)
    seg[:, 0] = np.arange(runs) * 512  # where each run starts in its view
    seg[:, 1] = 64  # its length
    seg[:, 2] = 64  # how far a block moves it
    return seg.tobytes()


def test_tables_are_kept_within_their_byte_bound_and_answer_the_same() -> None:
    row_runs._tables.clear()
    template = _template(144)
    for blocks in (64, 128, 256, 512, 1024, 2048, 4096):
        got = row_runs._block_runs(template, 40, blocks)
        assert np.array_equal(got, row_runs._make_block_runs(template, 40, blocks))
        assert sum(t.nbytes for t in row_runs._tables.values()) <= row_runs._TABLE_BYTES
    big = 4096 * 144 * 3 * 8
    assert big > row_runs._TABLE_BYTES  # made for its restore, never kept
    assert all(t.nbytes < big for t in row_runs._tables.values())
    again = row_runs._block_runs(template, 40, 64)  # a small one is kept and found
    assert again is row_runs._block_runs(template, 40, 64)
    row_runs._tables.clear()
