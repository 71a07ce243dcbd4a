"""The fault campaign's rounds through the background writer (`tests/torture.py`): a
child (`tests/torture_child.py`) stores through `PrefixCache` with default settings,
as every runtime and server does, and reports each store acknowledged (its `result()`
or a `Bank.flush()` after it returned) in a line it writes before going on.

- bg_kill: the child stores into the campaign's PrefixCache bank and is SIGKILLed at a
  random moment, or just after it began queueing a burst of stores (the writer's queue
  full);
- bg_full: the child stores into a bank on a small tmpfs, fills the disk while stores
  are queued (refused: `BankFullError`), frees it and stores until the bank writes
  again, then closes (needs root to mount; skipped otherwise);
- bg_close: the child stores without pause into the PrefixCache bank while another
  of its threads closes the bank; close must return and the child exit.
After each round a worker reopens the bank, restores the stores acknowledged in the
round and up to 100 earlier ones (`torture_prefix.check_prefix_bank`: bit-identical,
or counted lost or wrong) and runs `verify` (0 problems). A child's own restores of
stores it acknowledged (`repeat`) count too.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from torture_prefix import MODELS

HERE = Path(__file__).resolve().parent
CHILD = HERE / "torture_child.py"
READY_S = 120  # a child on a busy machine builds its model within this
ROUND_S = 240  # a full or close round ends within this, or it hangs


@dataclass
class ChildRun:
    """What a child reported (`torture_child`'s lines) and how it ended."""

    lines: list[list[str]] = field(default_factory=list)
    returncode: int | None = None
    killed: bool = False
    hung: bool = False
    stderr: str = ""

    def events(self, word: str) -> list[list[str]]:
        return [parts[1:] for parts in self.lines if parts and parts[0] == word]

    def acked(self) -> dict[int, str]:
        return {int(i): d for i, d in self.events("ack")}

    def queued(self) -> set[int]:
        return {int(i) for i, _ in self.events("queued")}

    def writer_queue(self) -> int:
        """Stores the writer held when the child last queued some (0: none yet)."""
        queued = self.events("queued")
        return int(queued[-1][1]) if queued else 0

    def crashed(self) -> bool:
        return self.hung or (not self.killed and self.returncode != 0)


def run_child(
    mode: str, args: list[str], env: dict[str, str], kill: Callable[[ChildRun], None] | None
) -> ChildRun:
    """Run the child; `kill(run)` (called once it is ready) returns when it is time to
    SIGKILL it; without it the child must end by itself within ROUND_S."""
    run = ChildRun()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), mode, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        reader = threading.Thread(target=_read, args=(child.stdout, run), daemon=True)
        reader.start()
        deadline = time.monotonic() + READY_S
        while not run.events("ready") and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if kill is not None and child.poll() is None and run.events("ready"):
            kill(run)
            run.killed = child.poll() is None
            child.send_signal(signal.SIGKILL)
        try:
            run.returncode = child.wait(ROUND_S)
        except subprocess.TimeoutExpired:
            run.hung = True
            child.kill()
            run.returncode = child.wait()
        reader.join()
        err.seek(0)
        run.stderr = err.read()[-2000:]
    return run


def _read(stream: IO[str], run: ChildRun) -> None:
    for line in stream:
        run.lines.append(line.split())


def kill_moment(rng: random.Random) -> Callable[[ChildRun], None]:
    """A random time after the child is ready, or just after its k-th burst began."""
    if rng.random() < 0.35:
        delay = rng.uniform(0.2, 5.0)
        return lambda run: time.sleep(delay)
    k, delay = rng.randint(1, 2), rng.uniform(0.0, 0.04)

    def after_burst(run: ChildRun) -> None:
        deadline = time.monotonic() + 20
        while len(run.events("burst")) < k and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)

    return after_burst


def fail(stats: Counter[str], kind: str, key: str, n: int = 1) -> None:
    """`n` of failure `key` (`torture.FAILURES`) in a round of `kind`: counted in all
    and under the kind (`<kind>_<key>`)."""
    stats[key] += n
    stats[f"{kind}_{key}"] += n


class BackgroundRounds:
    """The three round kinds. `acked`: every store acknowledged into the campaign's
    PrefixCache bank so far (`[model, seed, i, digest]`); after a round the worker
    restores this round's and up to RECHECK earlier ones (`check(path, acked)`)."""

    RECHECK = 100

    def __init__(self, root: Path, env: dict[str, str], check: Callable[..., str]) -> None:
        self.root, self.env, self.check = root, env, check
        self.bank = root / "prefix"
        self.acked: list[list[object]] = []
        self.rng = random.Random(0)

    def kill(self, seed: int, rng: random.Random, stats: Counter[str]) -> str:
        model = rng.choice(MODELS)
        run = run_child("kill", [str(self.bank), model, str(seed)], self.env, kill_moment(rng))
        stats["bg_kill_prompts_unacknowledged_at_kill"] += len(run.queued() - set(run.acked()))
        stats["bg_kill_with_stores_queued"] += run.writer_queue() > 0
        return self._checked(self._count(run, "bg_kill", model, seed, stats))

    def close(self, seed: int, rng: random.Random, stats: Counter[str]) -> str:
        model = rng.choice(MODELS)
        delay = f"{rng.uniform(0.2, 4.0):.2f}"
        run = run_child("close", [str(self.bank), model, str(seed), delay], self.env, None)
        new = self._count(run, "bg_close", model, seed, stats)
        if not run.events("closed"):
            fail(stats, "bg_close", "hangs")
            print(f"  bg_close: close did not return {run.lines[-3:]}", flush=True)
        stopped = run.events("stopped")
        stats[f"bg_close_then_{stopped[0][0].rstrip(':') if stopped else 'no_error'}"] += 1
        return self._checked(new)

    def full(self, seed: int, rng: random.Random, stats: Counter[str]) -> str | None:
        """None when no tmpfs can be mounted here."""
        mnt = self.root / "bg_mnt"
        mnt.mkdir(exist_ok=True)
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True
        )
        if mounted.returncode:
            return None
        try:
            model = rng.choice(MODELS)
            args = [str(mnt / "bank"), model, str(seed), str(mnt / "filler")]
            run = run_child("full", args, self.env, None)
            acked = self._count(run, "bg_full", model, seed, stats)
            stats["bg_full_refused"] += len(run.events("refused"))
            stats["bg_full_never_full"] += len(run.events("never_full"))
            if not run.events("recovered"):
                fail(stats, "bg_full", "no_recovery")
                print(f"  bg_full: no store written once space was freed {run.lines[-3:]}")
            # Bank.close raising a refused store's BankFullError again (it was reported
            # by its result() already) skips the last counters: see the report of #41.
            stats["bg_full_close_skipped_counters"] += "without the last counters" in run.stderr
            (mnt / "filler").unlink(missing_ok=True)  # left by a child that did not end
            return self.check(mnt / "bank", acked)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    def _checked(self, new: list[list[object]]) -> str:
        """Check this round's acknowledged stores and a sample of the earlier ones."""
        earlier = self.acked
        self.acked = earlier + new
        again = self.rng.sample(earlier, min(self.RECHECK, len(earlier)))
        return self.check(self.bank, new + again)

    def _count(
        self, run: ChildRun, kind: str, model: str, seed: int, stats: Counter[str]
    ) -> list[list[object]]:
        """Tally what the child said; the stores it acknowledged."""
        acked: list[list[object]] = [[model, seed, i, d] for i, d in run.acked().items()]
        stats[f"{kind}_acknowledged"] += len(acked)
        stats["background_acknowledged_stores"] += len(acked)
        repeats = Counter(verdict for _, verdict in run.events("repeat"))
        stats[f"{kind}_repeats_exact"] += repeats["exact"]
        failed, raised = run.events("failed"), run.events("raised")
        for key, n in [
            ("lost_acknowledged_stores", repeats["missed"]),
            ("wrong_restores", repeats["wrong"]),
            ("store_errors", len(failed)),
            ("runtime_errors", len(raised)),
            ("crashes", int(run.crashed() and not run.hung)),
            ("hangs", int(run.hung)),
        ]:
            if n:
                fail(stats, kind, key, n)
        if run.crashed() or failed or raised or repeats["missed"] or repeats["wrong"]:
            why = "hung" if run.hung else f"rc={run.returncode}"
            said = f"failed={failed[:2]} raised={[' '.join(r) for r in raised[:2]]} {repeats}"
            print(f"  {kind}: {why} {said} {run.stderr[-600:]}", flush=True)
        return acked
