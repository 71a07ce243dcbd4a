"""The background writer (`Namespace.store_later`, `BankConfig.write_behind`): the caller
does not write, a restore right after sees the blocks, `flush` waits and raises what
failed, `close` flushes, and SIGKILL leaves flushed stores whole and the rest whole or
absent."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    child_env,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    tokens_of,
)
from test_bank_process import KILL_BLOCK, big_spec, check_consistent, kill_prompt

from cas_bank import Bank, BankConfig, InvalidInputError
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family, Write
from cas_bank.maintenance.verify import verify

B = 4


def test_a_queued_store_is_restored_from_memory_then_found_on_disk(bank_path: Path) -> None:
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(1), 5 * B + 2)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=4)) as bank:
        ns = bank.namespace(spec)
        pending = ns.store_later(tokens, layers)
        hit = ns.restore(tokens)  # written or not yet: the lease has it
        assert hit is not None and hit.tokens == 5 * B
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 5 * B)
        bank.flush()
        assert pending.done() and pending.result().blocks_written == 5
        assert bank.stats().blocks == 5
    with Bank.open(bank_path) as bank:
        assert bank.namespace(spec).match(tokens) == 5 * B


def test_close_writes_what_is_queued(bank_path: Path) -> None:
    spec = attention_spec()
    rng = np.random.default_rng(2)
    prompts = [tokens_of(rng, 3 * B) for _ in range(6)]
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=2)) as bank:
        ns = bank.namespace(spec)
        for p in prompts:  # more than the queue holds: the caller waits, nothing dropped
            ns.store_later(p, prefix_layers(spec, p))
    with Bank.open(bank_path) as bank:
        assert all(bank.namespace(spec).match(p) == 3 * B for p in prompts)
        assert bank.stats().blocks == 18 and bank.stats().stores == 6


def test_bad_input_raises_on_the_callers_thread(bank_path: Path) -> None:
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=2)) as bank:
        with pytest.raises(InvalidInputError):
            bank.namespace(spec).store_later([1, 2, 3, 4, 5], [None, None])
        bank.flush()
        assert bank.stats().stores == 0


def test_a_failed_background_store_is_raised_by_flush(bank_path: Path) -> None:
    class FailOnce(RocksStore):
        failed = False

        def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
            if not FailOnce.failed and any(w[0].value == "blocks" for w in writes):
                FailOnce.failed = True
                raise OSError("disk full")
            super().put_batch(writes)

    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(3), 2 * B)
    config = BankConfig(block_size=B, write_behind=2, hot_bytes=0)
    with Bank.open(FailOnce(bank_path), config) as bank:
        ns = bank.namespace(spec)
        pending = ns.store_later(tokens, prefix_layers(spec, tokens))
        with pytest.raises(OSError, match="disk full"):
            bank.flush()
        with pytest.raises(OSError, match="disk full"):
            pending.result()
        assert bank.stats().blocks == 0
        ns.store_later(tokens, prefix_layers(spec, tokens))
        bank.flush()  # the error was reported once; this store went through
        assert bank.stats().blocks == 2


WRITE_BEHIND_CHILD = """
import sys
from test_bank_process import big_spec, kill_prompt, KILL_BLOCK
from conftest import prefix_layers
from cas_bank import Bank, BankConfig
path = sys.argv[1]
spec = big_spec()
with Bank.open(path, BankConfig(block_size=KILL_BLOCK, write_behind=3)) as bank:
    ns = bank.namespace(spec)
    i = 0
    while True:
        batch = list(range(i, i + 3))
        for j in batch:
            tokens = kill_prompt(j)
            ns.store_later(tokens, prefix_layers(spec, tokens))
        bank.flush()
        print(*batch, flush=True)  # acknowledged: flushed
        i += 3
"""


def test_sigkill_with_a_background_writer(bank_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITE_BEHIND_CHILD), str(bank_path)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    first = child.stdout.readline()
    assert first.strip(), child.stderr.read() if child.stderr else ""
    time.sleep(0.3)
    os.kill(child.pid, signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    acked = [int(x) for x in (first + out).split()]
    spec = big_spec()
    with Bank.open(bank_path, BankConfig(block_size=KILL_BLOCK)) as bank:
        check_consistent(bank)  # whole or absent; counters equal a recount
        ns = bank.namespace(spec)
        for i in acked:  # every store whose flush returned survived
            tokens = kill_prompt(i)
            assert ns.match(tokens) == len(tokens) // KILL_BLOCK * KILL_BLOCK


def test_prefix_cache_in_the_background_is_exact(bank_path: Path) -> None:
    from cas_bank.runtime import PrefixCache
    from runtime_helpers import straight_logits, tiny

    lm = tiny("tiny-qwen3")
    rng = np.random.default_rng(9)
    a = [int(t) for t in rng.integers(0, 200, 40)]
    b = [*a, *[int(t) for t in rng.integers(0, 200, 9)]]
    with Bank.open(bank_path, BankConfig(block_size=16, write_behind=2)) as bank:
        pc = PrefixCache(bank, lm, background=True)
        pc.prefill(a, pc.new_cache())
        assert pc.last_pending is not None
        cache, n = pc.restore(b)  # queued or written: the same prefix
        assert n == len(a)  # its end record
        logits = pc.prefill(b, cache, start=n)
        want = straight_logits(pc, b)
        assert float(np.max(np.abs(np.array(logits) - np.array(want)))) <= 1e-4
        bank.flush()
        assert bank.stats().blocks == 3


def test_a_closed_banks_writer_takes_nothing_and_closes_once(bank_path: Path) -> None:
    """After close: store_later raises as store does (nobody would write it), and a
    second close (a `with` block around an explicit close) returns at once."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(4), 3 * BLOCK_SIZE)
    with Bank.open(bank_path, BankConfig(block_size=BLOCK_SIZE, write_behind=2)) as bank:
        ns = bank.namespace(spec)
        ns.store_later(tokens, prefix_layers(spec, tokens))
        bank.close()
        with pytest.raises(RuntimeError, match="is closed"):
            ns.store_later(tokens, prefix_layers(spec, tokens))
        with pytest.raises(RuntimeError, match="is closed"):
            ns.store_end_later(tokens, prefix_layers(spec, tokens))
    with Bank.open(bank_path) as bank:  # what was queued before the close is there
        assert bank.namespace(spec).match(tokens) == len(tokens)


def _holding_the_writer(bank: Bank) -> threading.Event:
    """Queue a job that holds the background writer until the event is set."""
    release = threading.Event()
    assert bank.writer is not None
    bank.writer.submit(lambda: release.wait(30))
    return release


def _no_use_of_unstored(bank: Bank, hashes: list[bytes]) -> None:
    """No last use (written or pending) of a block in `hashes` that is not stored."""
    bank.flush()
    for h in hashes:
        if bank.store.get(Family.HEADERS, h) is None:
            assert bank.store.get(Family.ACCESS, h) is None, "a last use of a missing block"
    assert verify(bank).ok


def test_a_chain_admission_left_out_is_never_handed_out_once_written(bank_path: Path) -> None:
    """admit="second_use" defers a first store; its lease (taken when it was queued)
    must go once the writer ran, and no last use of its blocks is recorded."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(11), 4 * B + 1)
    config = BankConfig(block_size=B, write_behind=2, admit="second_use")
    with Bank.open(bank_path, config) as bank:
        ns = bank.namespace(spec)
        release = _holding_the_writer(bank)
        ns.store_later(tokens, prefix_layers(spec, tokens))
        hit = ns.restore(tokens)  # queued: the lease holds it (a restore right after)
        assert hit is not None and hit.tokens == 4 * B
        release.set()
        bank.flush()
        assert bank.stats().blocks == 0 and bank.stats().blocks_deferred == 4
        assert ns.restore(tokens) is None  # never stored: not handed out
        _no_use_of_unstored(bank, ns.chain(tokens))
        ns.store_later(tokens, prefix_layers(spec, tokens))  # the second use writes it
        bank.flush()
        assert bank.stats().blocks == 4 and ns.restore(tokens) is not None


def test_an_inline_store_records_no_use_of_the_blocks_it_left_out(bank_path: Path) -> None:
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(12), 3 * B)
    with Bank.open(bank_path, BankConfig(block_size=B, admit="second_use")) as bank:
        ns = bank.namespace(spec)
        assert ns.store(tokens, prefix_layers(spec, tokens)).blocks_written == 0
        _no_use_of_unstored(bank, ns.chain(tokens))


def test_a_chain_evicted_by_its_own_store_is_never_handed_out(bank_path: Path) -> None:
    """A budget smaller than the chain: the writer's store evicts it at once; the
    lease taken when it was queued must not outlive it."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(13), 4 * B + 1)
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=2, max_bytes=1)) as bank:
        ns = bank.namespace(spec)
        ns.store_later(tokens, prefix_layers(spec, tokens))
        bank.flush()
        assert bank.stats().blocks == 0 and bank.stats().blocks_evicted == 4
        assert ns.restore(tokens) is None
        ns.store(tokens, prefix_layers(spec, tokens))  # the same inline
        assert bank.stats().blocks == 0 and ns.restore(tokens) is None
        _no_use_of_unstored(bank, ns.chain(tokens))


DEFAULT_WRITER_CHILD = """
import sys
from test_bank_process import big_spec, kill_prompt, KILL_BLOCK
from conftest import prefix_layers
from cas_bank import Bank, BankConfig
bank = Bank.open(sys.argv[1], BankConfig(block_size=KILL_BLOCK))  # the default writer
assert bank.writer is not None
ns = bank.namespace(big_spec())
prompts = [kill_prompt(i) for i in range(40)]
layers = [prefix_layers(big_spec(), t) for t in prompts]  # ready: the queue fills at once
for i, (tokens, kv) in enumerate(zip(prompts, layers)):
    pending = ns.store_later(tokens, kv)
    pending.when_written(lambda _, i=i: print("w", i, flush=True))
    print("q", i, flush=True)
print("done", flush=True)
"""


def test_sigkill_mid_queue_with_the_default_writer_leaves_a_clean_bank(
    bank_path: Path,
) -> None:
    """A bank opened with default settings, killed while its writer has a queue: every
    store reported written is there, at most the queue (and the one being written) is
    lost, and `verify` finds nothing wrong."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DEFAULT_WRITER_CHILD), str(bank_path)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    lines: list[str] = []
    while not any(line.startswith("w") for line in lines):
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        lines.append(line)
    os.kill(child.pid, signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    lines += out.splitlines()
    queued = {int(x.split()[1]) for x in lines if x.startswith("q")}
    written = {int(x.split()[1]) for x in lines if x.startswith("w")}
    assert queued - written, "nothing was queued when the child was killed"
    with Bank.open(bank_path, BankConfig(block_size=KILL_BLOCK)) as bank:
        check_consistent(bank)  # every store whole or absent; counters equal a recount
        assert verify(bank).ok
        ns = bank.namespace(big_spec())
        full = {i for i in queued if ns.match(kill_prompt(i)) == _full(kill_prompt(i))}
        assert written <= full  # everything reported written survived
        lost = queued - full
        assert len(lost) <= BankConfig().write_behind + 1  # the queue, the one in flight


def _full(tokens: list[int]) -> int:
    return len(tokens) // KILL_BLOCK * KILL_BLOCK


class FailsBlocks(RocksStore):
    """A real RocksDB whose batches writing blocks fail (a bad disk), until `healed`."""

    healed = False

    def put_batch(self, writes: list[Write]) -> None:  # type: ignore[override]
        if not self.healed and any(w[0] == Family.BLOCKS for w in writes):
            raise OSError("injected I/O error")
        super().put_batch(writes)


def test_a_failed_background_store_leases_nothing_it_did_not_store(bank_path: Path) -> None:
    """The lease taken when the store was queued is dropped when the store fails (or is
    skipped): a restore after it covers only what the bank holds."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(21), 3 * B)
    layers = prefix_layers(spec, tokens)
    disk = FailsBlocks(bank_path)
    with Bank.open(disk, BankConfig(block_size=B, write_behind=2)) as bank:
        ns = bank.namespace(spec)
        disk.healed = True
        ns.store(tokens[:B], layers)  # the first block is stored
        disk.healed = False
        pending = ns.store_later(tokens, layers)
        with pytest.raises(OSError, match="injected"):
            pending.result()
        with pytest.raises(OSError, match="injected"):
            bank.flush()
        hit = ns.restore(tokens)
        assert hit is not None and hit.tokens == B  # not the 3 leased blocks
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, B)
        disk.healed = True


def test_close_raises_a_queued_stores_error_after_persisting_the_counters(
    bank_path: Path,
) -> None:
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(22), 2 * B)
    bank = Bank.open(FailsBlocks(bank_path), BankConfig(block_size=B, write_behind=2))
    ns = bank.namespace(spec)
    assert ns.restore(tokens) is None  # counted in memory: close persists it
    ns.store_later(tokens, prefix_layers(spec, tokens))
    with pytest.raises(OSError, match="injected"):
        bank.close()
    with Bank.open(bank_path) as again:
        assert again.stats().restores == 1 and again.stats().blocks == 0


def _fails(_: object) -> None:
    raise ZeroDivisionError("a callback's bug")


def test_a_raising_when_written_callback_leaves_the_writer_running(
    bank_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `when_written` callback or a `measure` that raises is logged, each on its own:
    the store's result is its own, the next callbacks run, and the writer goes on to
    write every later store (without it, the thread died and flush waited for ever)."""
    spec = attention_spec()
    rng = np.random.default_rng(31)
    first, second = tokens_of(rng, 2 * B), tokens_of(rng, 3 * B)
    bank = Bank.open(bank_path, BankConfig(block_size=B, write_behind=4))
    assert bank.writer is not None
    ns = bank.namespace(spec)
    release = _holding_the_writer(bank)  # the callbacks run on the writer's thread
    job = bank.writer.submit(lambda: 7, measure=_fails)
    seen: list[int] = []
    job.when_written(_fails)
    job.when_written(seen.append)  # after one that raised: still called
    stored = ns.store_later(first, prefix_layers(spec, first))
    stored.when_written(_fails)
    later = ns.store_later(second, prefix_layers(spec, second))
    release.set()
    assert later.result(timeout=10).blocks_written == 3  # the writer went on
    assert job.result() == 7 and seen == [7]
    assert stored.result().blocks_written == 2
    bank.flush()
    assert bank.writer.stats().failed == 0 and bank.writer.stats().written == 4
    assert sum("when_written callback raised" in r.getMessage() for r in caplog.records) == 3
    bank.close()
    with Bank.open(bank_path) as again:
        assert again.stats().blocks == 5


def test_close_from_a_when_written_callback_is_refused_and_closes_nothing(
    bank_path: Path,
) -> None:
    """`Bank.close()` (or the writer's) on the writer's own thread would wait for itself:
    a clear `RuntimeError`, the bank untouched and its writer writing what is queued."""
    spec = attention_spec()
    rng = np.random.default_rng(32)
    first, second = tokens_of(rng, 2 * B), tokens_of(rng, 3 * B)
    bank = Bank.open(bank_path, BankConfig(block_size=B, write_behind=4))
    assert bank.writer is not None
    ns = bank.namespace(spec)
    refused: list[Exception] = []

    def close_here(_: object) -> None:
        for close in (bank.close, bank.writer.close):  # type: ignore[union-attr]
            try:
                close()
            except RuntimeError as e:
                refused.append(e)

    release = _holding_the_writer(bank)
    ns.store_later(first, prefix_layers(spec, first)).when_written(close_here)
    later = ns.store_later(second, prefix_layers(spec, second))
    release.set()
    assert later.result(timeout=10).blocks_written == 3
    assert [str(e).split(" on ")[0] for e in refused] == ["Bank.close()", "close()"]
    assert all("writer's own thread" in str(e) for e in refused)
    assert ns.match(second) == 3 * B and not bank.writer.closed
    bank.close()
    with Bank.open(bank_path) as again:
        assert again.stats().blocks == 5


def test_stores_made_in_a_when_written_callback_are_written_not_waited_for(
    bank_path: Path,
) -> None:
    """A store queued on the writer's own thread (a `when_written` callback that stores
    again) must not wait for room in a full queue: only that thread makes room. It is
    written there and then; the writer goes on with the queue."""
    spec = attention_spec()
    rng = np.random.default_rng(33)
    first, third, fourth, fifth = (tokens_of(rng, n * B) for n in (2, 3, 4, 1))
    bank = Bank.open(bank_path, BankConfig(block_size=B, write_behind=1))
    ns = bank.namespace(spec)
    made: list[object] = []

    def store_twice(_: object) -> None:  # one store fills the queue, the next needs room
        for toks in (third, fourth):
            made.append(ns.store_later(toks, prefix_layers(spec, toks)))

    release = _holding_the_writer(bank)
    ns.store_later(first, prefix_layers(spec, first)).when_written(store_twice)
    release.set()
    later = ns.store_later(fifth, prefix_layers(spec, fifth))
    assert later.result(timeout=20).blocks_written == 1  # the writer went on
    assert [m.result(timeout=1).blocks_written for m in made] == [3, 4]  # type: ignore[attr-defined]
    bank.flush()
    assert ns.match(fourth) == 4 * B and bank.writer is not None
    assert bank.writer.stats().failed == 0
    bank.close()
    with Bank.open(bank_path) as again:
        assert again.stats().blocks == 10


def _in_queue_put(frame: FrameType | None) -> bool:
    """Whether `frame` (or a caller of it) is `queue.Queue.put` waiting for room."""
    while frame is not None:
        if frame.f_code is queue.Queue.put.__code__:
            return True
        frame = frame.f_back
    return False


def _interrupted_in_put(queue_it: Callable[[], object]) -> None:
    """`queue_it()` on this (the main) thread, interrupted by a real signal while it
    waits for room in the writer's full queue: `KeyboardInterrupt` (as a Ctrl-C)."""
    hit = threading.Event()

    def handler(_: int, frame: FrameType | None) -> None:
        if _in_queue_put(frame):  # elsewhere: ignored, the signal comes again
            hit.set()
            raise KeyboardInterrupt

    def ring() -> None:
        while not hit.wait(0.02):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, handler)
    ringer = threading.Thread(target=ring)
    ringer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            queue_it()
    finally:
        hit.set()
        ringer.join()
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("what", ["blocks", "end"])
def test_a_store_interrupted_while_the_queue_is_full_leaves_no_trace(
    bank_path: Path, what: str
) -> None:
    """A store whose wait for room in the queue raises was never queued: it leaves the
    read view and its blocks are unleased (before, lookups saw headers that would never
    be written, and the KV snapshot stayed in memory)."""
    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(33), 3 * B + 2)
    layers = prefix_layers(spec, tokens)
    with Bank.open(bank_path, BankConfig(block_size=B, write_behind=1)) as bank:
        assert bank.writer is not None and bank.leases is not None
        ns = bank.namespace(spec)
        if what == "end":
            ns.store(tokens, layers)  # the blocks stored; the end record interrupted
        release = _holding_the_writer(bank)
        bank.writer.submit(lambda: None)  # the queue is full
        if what == "end":
            _interrupted_in_put(ns.prepare_end_later(tokens, layers))
        else:
            _interrupted_in_put(lambda: ns.store_later(tokens, layers))
        assert bank.writer.queued.entries == ()
        assert ns.match([*tokens, 1]) == (3 * B if what == "end" else 0)
        if what == "blocks":
            assert bank.leases.probe(ns.chain(tokens))[0] == 0  # the snapshot let go
            assert ns.restore(tokens) is None
        release.set()
        bank.flush()
        assert bank.stats().stores == (1 if what == "end" else 0)
        assert bank.stats().ends == 0
