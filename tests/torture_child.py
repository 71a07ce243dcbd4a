"""A child of the fault campaign's background rounds (`tests/torture.py`): prompts
stored through `PrefixCache` with default settings, so through the bank's background
writer, as a runtime stores them (`restore_exact`, then `prefill(..., end=True)`).

Usage: python tests/torture_child.py kill|full|close BANK MODEL SEED [ARG]
- kill: store until SIGKILLed (the parent picks the moment);
- full: ARG is a filler file on the bank's (small) disk: store, fill the disk, store
  on while the stores are refused, free the space, store until the bank writes again,
  close;
- close: ARG is a delay: the child stores without pause, and another thread closes
  the bank after the delay, while it still stores.

Reports on stdout, one line an event, each written whole and at once (a line written
before a SIGKILL is in the pipe, so the parent reads it):
  ready                    the bank is open and the model built
  queued I Q                prompt I is prefilled and its stores queued; the writer
                           holds Q stores now
  burst N                  N prompts prefilled, now queued back to back
  ack I DIGEST             its stores are written: `result()` of both (the blocks and
                           the end record) or a `Bank.flush()` after them returned
  refused I / failed I E   a store of prompt I raised BankFullError / another error E
  repeat I exact|missed|wrong   an acknowledged prompt restored again (full hit?)
  raised E: MESSAGE        a call raised E (`restore_exact`, `prefill`, `store`)
  filled / degraded WHY / freed / recovered / closed S / stopped E: the round's steps
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torture_prefix import SOLO, digest, loaded, prompt, restored_digest

from cas_bank import Bank, BankFullError

PROMPTS = 100_000  # more than any round stores: a round ends by its own rule
LEAVE = 768 << 10  # bytes the filler leaves free: a prompt or two, then the disk is full


def one_line(e: BaseException) -> str:
    return str(e).replace("\n", " ")[:200]


class Out:
    """Whole lines on stdout, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, *parts: object) -> None:
        data = (" ".join(str(p) for p in parts) + "\n").encode()
        with self._lock:
            os.write(1, data)


class Acks:
    """A thread that waits for each prompt's stores in order (`result()`) and reports
    them; `flushed` reports those a clean `Bank.flush()` covered."""

    def __init__(self, out: Out) -> None:
        self.out = out
        self.done: dict[int, str] = {}
        self.refused = self.failed = 0
        self._queue: queue.Queue[tuple[int, str, list[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, i: int, d: str, pending: list[Any]) -> None:
        self._queue.put((i, d, pending))

    def ack(self, i: int, d: str) -> None:
        self.out.line("ack", i, d)
        self.done[i] = d

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            i, d, pending = item
            try:
                for p in pending:
                    p.result()
            except BankFullError:
                self.refused += 1
                self.out.line("refused", i)
            except Exception as e:
                self.failed += 1
                self.out.line("failed", i, type(e).__name__)
            else:
                self.ack(i, d)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class Flood:
    """Prompts of one round, stored one after another as a runtime stores them; now
    and then an acknowledged one is restored again, or the bank flushed."""

    def __init__(self, pc: Any, model: str, seed: int, acks: Acks) -> None:
        self.pc, self.model, self.seed, self.acks = pc, model, seed, acks
        self.rng = random.Random(seed)
        self.next, self.solo = 0, SOLO
        self.since_flush: list[tuple[int, str]] = []
        self.survive = True  # an error is reported and the round goes on (`step`)

    def until(self, done: Callable[[], bool], limit: int = PROMPTS) -> bool:
        """Take steps (each stores a prompt or more) until `done()` (True), at most
        `limit` (False)."""
        for _ in range(limit):
            if done():
                return True
            self.step()
        return done()

    def step(self) -> None:
        """Store a prompt, after a repeat, a flush or a burst now and then. With
        `survive`, an exception from the bank is reported (`raised`) and the round goes
        on, as a server answers the next request; else it ends the flood."""
        roll, n = self.rng.random(), self.rng.randint(3, 8)
        ops: list[Callable[[], None]] = [self.store]
        if roll < 0.1:
            ops.insert(0, self.repeat)
        elif roll < 0.18:
            ops.insert(0, self.flush)
        elif roll < 0.3:
            ops.insert(0, lambda: self.burst(n))
        for op in ops:
            try:
                op()
            except Exception as e:
                if not self.survive:
                    raise
                self.acks.out.line("raised", f"{type(e).__name__}:", one_line(e))

    def store(self) -> None:
        """The next prompt as a runtime stores it: its prefill queues the stores."""
        i, self.next = self.next, self.next + 1
        tokens = prompt(self.model, self.seed, i)
        pc = self.pc
        cache, n, logits = pc.restore_exact(tokens)
        pending = []
        if logits is None:
            logits = pc.prefill(tokens, cache, n, end=True)
            pending = [pc.last_pending, pc.last_end_pending]
        self.queued(i, digest(tokens, logits, cache), pending)

    def burst(self, n: int) -> None:
        """`n` long prompts prefilled first, then stored back to back
        (`PrefixCache.store` and `store_end`, as after decoding): the writer's queue
        fills and the caller waits on it. They share no block (`SOLO`): none holds a
        block another of the burst computes too."""
        pc, ready = self.pc, []
        for _ in range(n):
            i, self.solo = self.solo, self.solo + 1
            tokens = prompt(self.model, self.seed, i)
            cache, got, logits = pc.restore_exact(tokens)
            full = logits is not None
            if not full:
                logits = pc.prefill(tokens, cache, got, store=False)
            ready.append((i, tokens, cache, logits, full, digest(tokens, logits, cache)))
        self.acks.out.line("burst", n)
        for i, tokens, cache, logits, full, d in ready:
            pending = []
            if not full:
                pending.append(pc.store(tokens, cache))
                pc.store_end(tokens, cache, logits=logits)
                pending.append(pc.last_end_pending)
            self.queued(i, d, pending)

    def queued(self, i: int, d: str, pending: list[Any]) -> None:
        """Prompt `i`'s stores are queued; the line says how many stores the writer
        holds now (waiting or being written)."""
        writer = self.pc.bank.writer
        self.acks.out.line("queued", i, writer.stats().queued if writer is not None else 0)
        self.since_flush.append((i, d))
        self.acks.add(i, d, pending)

    def flush(self) -> None:
        """A clean flush acknowledges every store queued since the last flush (one
        that raised reported a failure among them, and forgot the rest)."""
        covered, self.since_flush = self.since_flush, []
        try:
            self.pc.bank.flush()
        except Exception as e:
            self.acks.out.line("flush_raised", type(e).__name__)
            return
        for i, d in covered:
            self.acks.ack(i, d)

    def repeat(self) -> None:
        if not self.acks.done:
            return
        j = self.rng.choice(sorted(self.acks.done))
        got = restored_digest(self.pc, prompt(self.model, self.seed, j))
        want = self.acks.done[j]
        verdict = "exact" if got == want else "missed" if got is None else "wrong"
        self.acks.out.line("repeat", j, verdict)


def kill_mode(flood: Flood, arg: str) -> None:
    flood.until(lambda: False)


def full_mode(flood: Flood, arg: str) -> None:
    bank, acks, out = flood.pc.bank, flood.acks, flood.acks.out
    filler = Path(arg)
    flood.until(lambda: len(acks.done) >= 2, 50)
    import shutil

    free = shutil.disk_usage(filler.parent).free
    with filler.open("wb") as fh:
        fh.write(b"\0" * max(0, free - LEAVE))
    out.line("filled")
    if not flood.until(lambda: acks.refused >= 4, 100):
        out.line("never_full")
    out.line("degraded", repr(bank.degraded).replace(" ", "_"))
    for _ in range(3):  # restores work while the disk is full
        flood.repeat()
    filler.unlink()
    out.line("freed")
    before = len(acks.done)
    if flood.until(lambda: len(acks.done) >= before + 3, 60) and bank.degraded is None:
        out.line("recovered")


def close_mode(flood: Flood, arg: str) -> None:
    """The bank is closed from another thread while this one stores on; it stores
    until a call raises (the bank is closed), or 5 s after the close returned. (This
    thread runs the model: a thread that ran it and ends as the interpreter exits can
    abort the process in MLX's thread-local compile cache's destructor, so the
    closing thread is the other one.)"""
    out = flood.acks.out
    closed: list[float] = []

    def close() -> None:
        t0 = time.perf_counter()
        flood.pc.bank.close()
        out.line("closed", f"{time.perf_counter() - t0:.3f}")
        closed.append(time.monotonic())

    flood.survive = False  # the first error after the close ends the flood
    closer = threading.Timer(float(arg), close)
    closer.start()
    try:
        flood.until(lambda: bool(closed) and time.monotonic() - closed[0] > 5)
    except Exception as e:
        out.line("stopped", f"{type(e).__name__}:", one_line(e))
    closer.join(60)
    if closer.is_alive():
        out.line("hung", "close did not return")


MODES = {"kill": kill_mode, "full": full_mode, "close": close_mode}


def main(mode: str, path: str, model: str, seed: str, arg: str = "") -> int:
    from cas_bank.runtime import PrefixCache

    out = Out()
    bank = Bank.open(path)  # default settings: a background writer
    assert bank.writer is not None
    pc = PrefixCache(bank, loaded(model))  # default settings: stores in the background
    acks = Acks(out)
    out.line("ready")
    try:
        MODES[mode](Flood(pc, model, int(seed), acks), arg)
    finally:
        if mode != "close":  # closed there, during the flood
            bank.close()
        acks.close()
    out.line("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
