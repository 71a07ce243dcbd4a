"""A fault campaign in the spirit of RocksDB's db_stress (`make torture`; not part of the
default test run). Usage: python tests/torture.py [--seconds 180] [--seed 0]

Random rounds against real banks, each followed by a verify and an exact-restore check:
- kill: a child stores prompts into the main bank and is SIGKILLed at a random moment;
  every store it acknowledged must restore exactly, full length (lost stores = 0);
- evict: the same on a copy with a small disk budget (stores evict as they go);
- flip / truncate: a copy of the main bank with bytes overwritten in, or the tail cut
  off, one file of a random kind (table, blob, log, MANIFEST, CURRENT, OPTIONS);
- full: stores into a bank on a small tmpfs until the disk is full, then space is
  freed and stores resume (needs root to mount; skipped otherwise);
- bg_kill / bg_full / bg_close: the same faults (a SIGKILL, a full disk, and a close
  during a flood of stores) on stores through the background writer, a child storing
  through `PrefixCache` with default settings (`tests/torture_background.py`).
Checks run in a worker process: a crash there is counted (it must stay 0), and every
hit is compared bit for bit with the prompt's own KV (wrong restores must stay 0).
Counts are printed by round kind (`round_<kind>`, `<kind>_acknowledged`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torture_background import BackgroundRounds, fail

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

WRITER = """
import sys
from pathlib import Path
from typing import Any
from cas_bank import Bank, BankConfig
from conftest import prefix_layers
from damage_kit import B, prompts, wide_spec
path, seed, budget = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = BankConfig(block_size=B, hot_bytes=0, max_bytes=budget or None)
with Bank.open(path, config) as bank:
    ns = bank.namespace(wide_spec())
    for i, p in enumerate(prompts(40, seed)):
        ns.store(p, prefix_layers(wide_spec(), p))
        print(i, flush=True)
"""

WORKER = """
import json, sys
from pathlib import Path
from typing import Any
from damage_kit import check_bank, prompts
from torture_prefix import check_prefix_bank
for line in sys.stdin:
    job = json.loads(line)
    try:
        if job["prefix"]:
            out = check_prefix_bank(Path(job["path"]), job["acked"])
        else:
            ps = [prompts(40, s)[i] for s, i in job["acked"]]
            out = check_bank(Path(job["path"]), ps, full=job["full"])
    except AssertionError as e:
        out = "WRONG " + str(e)
    except Exception as e:
        out = f"CRASH {type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
"""


ROUNDS = ["kill", "kill", "evict", "flip", "flip", "flip", "truncate", "truncate", "full"]
ROUNDS += ["bg_kill", "bg_kill", "bg_kill", "bg_close", "bg_close", "bg_full"]
# Must stay 0: a run with any of them exits 1.
FAILURES = (
    "wrong_restores",
    "lost_acknowledged_stores",
    "crashes",
    "hangs",  # a child that did not end (a close that did not return)
    "verify_problems",
    "store_errors",  # a background store failing with anything but a full disk
    "runtime_errors",  # a PrefixCache call raising in a bg_kill or bg_full round
    "no_recovery",  # no store written once a full disk's space was freed
)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), e.get("PYTHONPATH", "")])
    return e


class Worker:
    """The checking process; restarted (and the crash counted) if it dies."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def check(self, path: Path, acked: Sequence[Any], full: bool, prefix: bool = False) -> str:
        """A bank checked by `damage_kit.check_bank`, or (`prefix`) by
        `torture_prefix.check_prefix_bank`, `acked` being its `[model, seed, i, digest]`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env(),
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"path": str(path), "acked": acked, "full": full, "prefix": prefix}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            return f"CRASH rc={self.proc.returncode}"
        return str(json.loads(line))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def kill_round(path: Path, seed: int, rng: random.Random, budget: int = 0) -> list[tuple[int, int]]:
    """Store with a child, SIGKILL it after a random delay; the stores it acknowledged."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(path), str(seed), str(budget)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env(),
    )
    time.sleep(rng.uniform(2.5, 6.0))
    child.send_signal(signal.SIGKILL)
    out, _ = child.communicate()
    return [(seed, int(i)) for i in out.split()]


def damage(path: Path, rng: random.Random, how: str) -> str:
    kinds = {
        "table": list(path.glob("*.sst")),
        "blob": list(path.glob("*.blob")),
        "log": [p for p in path.glob("*.log") if p.stat().st_size],
        "manifest": list(path.glob("MANIFEST-*")),
        "current": [path / "CURRENT"],
        "options": list(path.glob("OPTIONS-*")),
    }
    kind = rng.choice([k for k, v in kinds.items() if v])
    target = rng.choice(kinds[kind])
    size = target.stat().st_size
    if how == "truncate":
        with target.open("r+b") as fh:
            fh.truncate(rng.randrange(size) if size else 0)
    else:
        n = rng.choice([1, 8, 64])
        off = rng.randrange(max(1, size - n))
        with target.open("r+b") as fh:
            fh.seek(off)
            fh.write(bytes(rng.randrange(256) for _ in range(min(n, size))))
    return kind


def full_round(root: Path, worker: Worker, seed: int, stats: Counter[str]) -> None:
    mnt = root / "mnt"
    mnt.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode:
        stats["full_skipped"] += 1
        return
    try:
        from conftest import prefix_layers
        from damage_kit import B, prompts, wide_spec

        from cas_bank import Bank, BankConfig, BankFullError

        acked: list[tuple[int, int]] = []
        with Bank.open(mnt / "bank", BankConfig(block_size=B, hot_bytes=0)) as bank:
            ns = bank.namespace(wide_spec())
            filler = mnt / "filler"
            filler.write_bytes(b"\0" * max(0, shutil.disk_usage(mnt).free - (400 << 10)))
            full = 0
            for i, p in enumerate(prompts(40, seed)):
                try:
                    ns.store(p, prefix_layers(wide_spec(), p))
                    acked.append((seed, i))
                except BankFullError:
                    full += 1
                    if full == 3:
                        filler.unlink()
            stats["full_refused"] += full
        result = worker.check(mnt / "bank", acked, True)
        tally(stats, "full", result)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def background_round(
    rounds: BackgroundRounds, kind: str, seed: int, rng: random.Random, stats: Counter[str]
) -> None:
    """One bg_* round (`torture_background`), checked by the worker."""
    result = getattr(rounds, kind.removeprefix("bg_"))(seed, rng, stats)
    if result is None:  # no tmpfs here
        stats[f"{kind}_skipped"] += 1
    else:
        tally(stats, kind, result)


def tally(stats: Counter[str], kind: str, result: str) -> None:
    """Count a round's check; a failure also under its kind (`<kind>_<failure>`)."""
    stats["rounds"] += 1
    stats[f"round_{kind}"] += 1
    head = result.split(" ", 1)[0]
    failure = {
        "WRONG": "wrong_restores",
        "CRASH": "crashes",
        "LOST": "lost_acknowledged_stores",
        "BAD": "verify_problems",
    }.get(head)
    if failure is not None:
        fail(stats, kind, failure, int(result.split()[1]) if head == "LOST" else 1)
        print(f"  {kind}: {result}", flush=True)
    elif result == "refused":
        stats["refused_with_a_clear_error"] += 1
    else:
        stats["checked_and_exact"] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="cas_bank_torture_"))
    main_bank, acked = root / "main", []
    stats: Counter[str] = Counter()
    worker = Worker()
    deadline = time.monotonic() + args.seconds
    seed = 1
    background = BackgroundRounds(
        root, env(), lambda path, acked: worker.check(path, acked, True, prefix=True)
    )
    try:
        while time.monotonic() < deadline:
            kind = rng.choice(ROUNDS)
            seed += 1
            stats["faults"] += 1
            if kind == "kill":
                acked += kill_round(main_bank, seed, rng)
                tally(stats, kind, worker.check(main_bank, acked, True))
            elif kind == "evict":
                copy = root / "evict"
                shutil.rmtree(copy, ignore_errors=True)
                if main_bank.exists():
                    shutil.copytree(main_bank, copy)
                kill_round(copy, seed, rng, budget=600 << 10)
                tally(stats, kind, worker.check(copy, acked, False))
            elif kind in ("flip", "truncate"):
                if not main_bank.exists():
                    continue
                copy = root / "damaged"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(main_bank, copy)
                stats[f"{kind}_{damage(copy, rng, kind)}"] += 1
                tally(stats, kind, worker.check(copy, acked, False))
            elif kind == "full":
                full_round(root, worker, seed, stats)
            else:
                background_round(background, kind, seed, rng, stats)
            stats["acknowledged_stores"] = len(acked)
    finally:
        worker.close()
        shutil.rmtree(root, ignore_errors=True)
    for key in FAILURES:
        stats.setdefault(key, 0)
    print(json.dumps(dict(sorted(stats.items())), indent=1))
    return 1 if any(stats[key] for key in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
