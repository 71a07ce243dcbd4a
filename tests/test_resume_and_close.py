"""`Bank.close()` against restores on other threads, and twice.

A restore that races `close()` on another thread either finishes or says the bank is
closed (cas_bank's `RuntimeError`), never one of RocksDB's own errors; a second close
does nothing, also after a restore that ran across the first one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import attention_spec, prefix_layers, tokens_of
from damage_kit import restore_until

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family


def test_a_restore_racing_close_says_closed_and_a_second_close_does_nothing(
    tmp_path: Path,
) -> None:
    spec, rng = attention_spec(), np.random.default_rng(8)
    prompt = tokens_of(rng, 40)
    for attempt in range(10):
        path = tmp_path / f"bank{attempt}"
        bank = Bank.open(path, BankConfig(block_size=4, hot_bytes=0))
        bank.namespace(spec).store(prompt, prefix_layers(spec, prompt))
        started, stop, errors = threading.Event(), threading.Event(), list[str]()
        thread = threading.Thread(
            target=restore_until, args=(bank, spec, prompt, started, stop, errors)
        )
        thread.start()
        started.wait(10)
        bank.close()
        while not errors and thread.is_alive():
            stop.wait(0.001)  # until the reader has met the closed bank
        stop.set()
        thread.join()
        bank.close()  # nothing to do: no error, however the reader ended
        assert set(errors) == {f"builtins.RuntimeError: bank at {path} is closed"}


def fail() -> None:
    raise ValueError("this store cannot be written")


def test_close_does_not_raise_again_a_failure_result_reported(tmp_path: Path) -> None:
    """A failed background store raises from its `result()`; the writer's close does
    not raise it a second time (it made `Bank.close` skip saving the counters), while
    one nobody asked about is still raised by close, and `flush()` raises the first
    failure since the last flush either way."""
    with Bank.open(tmp_path / "bank") as bank:
        writer = bank.writer
        assert writer is not None
        reported = writer.submit(fail)
        with pytest.raises(ValueError, match="cannot be written"):
            reported.result()
        with pytest.raises(ValueError, match="cannot be written"):
            writer.flush()  # the first failure since the last flush: as before
        writer.flush()  # none since
    for ask in (True, False):
        bank = Bank.open(tmp_path / "bank")
        assert bank.writer is not None
        pending = bank.writer.submit(fail)
        with contextlib.suppress(ValueError):
            _ = pending.result() if ask else pending.done()
        if ask:
            bank.close()  # reported to its caller: not raised again
        else:
            with pytest.raises(ValueError, match="cannot be written"):
                bank.close()


def write_until(store: RocksStore, started: threading.Event, errors: list[str]) -> None:
    """Big batches (each takes milliseconds to build) until one fails."""
    for n in itertools.count():
        batch = [(Family.HEADERS, b"%d.%05d" % (n, i), b"h" * 64) for i in range(20000)]
        try:
            store.put_batch(batch)
        except Exception as e:
            errors.append(f"{type(e).__module__}.{type(e).__name__}: {e}")
            return
        finally:
            started.set()


def test_a_write_racing_close_finishes_or_says_closed(tmp_path: Path) -> None:
    """A batch being written when `close()` comes is written before the database
    closes, or finds the bank closed: never a KeyError for a family handle close
    dropped, nor `None.write`; and every batch that returned is there after a reopen."""
    for attempt in range(5):
        path = tmp_path / f"db{attempt}"
        store = RocksStore(path)
        started, errors = threading.Event(), list[str]()
        thread = threading.Thread(target=write_until, args=(store, started, errors))
        thread.start()
        started.wait(10)
        time.sleep(0.002 * attempt)  # close at different points of a batch
        store.close()
        thread.join(10)
        assert errors == [f"builtins.RuntimeError: bank at {path} is closed"]
        with RocksStore(path) as again:
            counts = collections.Counter(k.split(b".")[0] for k in again.keys(Family.HEADERS))
        assert set(counts.values()) == {20000}  # whole batches only
