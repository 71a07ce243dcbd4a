"""A full disk, for real: a small tmpfs mounted for the test (tests run as root; the
tests are skipped, saying why, where mounting is not allowed).

A full disk degrades the bank, then it recovers: stores fail fast with
`BankFullError` (naming the path and the bytes needed), restores keep working and
stay exact, `degraded` says why, and once space is freed the bank writes again
without a reopen; `close()` always releases the lock; no acknowledged store is lost.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import kv_prefix_bits, layers_bits, prefix_layers, tokens_of
from damage_kit import B, restore_until, wide_spec

from cas_bank import Bank, BankConfig, BankFullError


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "mnt"
    mount_tmpfs(where, "8m")
    try:
        yield where
    finally:
        unmount(where)


def fill(disk: Path, leave: int) -> Path:
    """A file taking all but `leave` bytes of `disk`."""
    import shutil

    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with filler.open("wb") as fh:
        fh.write(b"\0" * max(0, free - leave))
    return filler


def exact(bank: Bank, prompt: list[int]) -> int:
    spec = wide_spec()
    hit = bank.namespace(spec).restore(prompt)
    assert hit is not None
    truth = kv_prefix_bits(prefix_layers(spec, prompt), spec, hit.tokens)
    assert layers_bits(hit.layers, spec) == truth
    return hit.tokens


@pytest.mark.parametrize("files", [False, True], ids=["payloads in RocksDB", "payload files"])
def test_full_disk_degrades_then_recovers(small_disk: Path, files: bool) -> None:
    spec = wide_spec()
    rng = np.random.default_rng(3)
    path = small_disk / "bank"
    acknowledged: list[list[int]] = []
    config = BankConfig(block_size=B, hot_bytes=0, file_min_bytes=0 if files else None)
    bank = Bank.open(path, config)
    try:
        ns = bank.namespace(spec)
        first = tokens_of(rng, 10 * B)
        ns.store(first, prefix_layers(spec, first))
        acknowledged.append(first)
        filler = fill(small_disk, 256 << 10)
        with pytest.raises(BankFullError) as caught:
            for _ in range(200):
                p = tokens_of(rng, 10 * B)
                ns.store(p, prefix_layers(spec, p))
                acknowledged.append(p)
        err = caught.value
        assert str(path) in str(err) and err.needed > 0 and "bytes" in str(err)
        assert bank.degraded is not None
        assert not list(path.rglob("*.tmp"))  # no half-written payload file is left
        # Fails fast while full, even for a store with nothing new; restores work.
        t0 = time.perf_counter()
        with pytest.raises(BankFullError):
            ns.store(first, prefix_layers(spec, first))
        assert time.perf_counter() - t0 < 1.0
        for p in acknowledged:
            assert exact(bank, p) == 10 * B
        filler.unlink()  # space freed: the bank resumes by itself
        late = tokens_of(rng, 10 * B)
        assert ns.store(late, prefix_layers(spec, late)).blocks_written == 10
        acknowledged.append(late)
        assert bank.degraded is None
        for p in acknowledged:
            assert exact(bank, p) == 10 * B
    finally:
        bank.close()
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:  # nothing acknowledged lost
        for p in acknowledged:
            assert exact(bank, p) == 10 * B


def test_close_on_a_full_disk_releases_the_lock(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = wide_spec()
    rng = np.random.default_rng(4)
    path = small_disk / "bank"
    bank = Bank.open(path, BankConfig(block_size=B, hot_bytes=0))
    ns = bank.namespace(spec)
    first = tokens_of(rng, 10 * B)
    ns.store(first, prefix_layers(spec, first))
    assert exact(bank, first) == 10 * B  # its spares' shapes are recorded at close
    filler = fill(small_disk, 64 << 10)
    with pytest.raises(BankFullError):
        for _ in range(100):
            p = tokens_of(rng, 10 * B)
            ns.store(p, prefix_layers(spec, p))
    bank.close()  # no exception, and the lock is released
    assert "spares' shapes are not kept" in caplog.text  # advice: the close went on
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as reader:
        assert exact(reader, first) == 10 * B
    filler.unlink()
    with Bank.open(path, BankConfig(hot_bytes=0)) as again:
        assert exact(again, first) == 10 * B


def test_export_on_a_full_disk_leaves_no_partial_file(tmp_path: Path, small_disk: Path) -> None:
    from damage_kit import build

    from cas_bank.maintenance.bundle import export_chain

    ps = build(tmp_path / "bank", n=2)
    fill(small_disk, 8 << 10)
    with Bank.open(tmp_path / "bank", BankConfig(hot_bytes=0)) as bank:
        chain = bank.namespace(wide_spec()).matched(ps[0])
        with pytest.raises(BankFullError) as caught:
            export_chain(bank, chain, small_disk / "x.bundle")
    assert str(small_disk) in str(caught.value)
    assert not list(small_disk.glob("x.bundle*"))


def test_the_server_answers_on_a_full_disk_and_says_degraded(small_disk: Path) -> None:
    from cas_bank.runtime.engine import Engine
    from cas_bank.runtime.generation import GenerationRequest
    from cas_bank.runtime.server import create_app
    from fastapi.testclient import TestClient

    engine = Engine.open(small_disk / "bank", "tiny-qwen3", block_size=16)
    try:
        client = TestClient(create_app(engine))
        filler = fill(small_disk, 32 << 10)
        for i in range(40):
            prompt = [int(t) for t in np.random.default_rng(i).integers(1, 200, 300)]
            result = engine.generate(GenerationRequest(prompt=prompt, max_tokens=1))
            assert result.completion_tokens == 1  # answered, stored or not
            assert engine.bank.writer is not None  # its stores tried (a full disk: skipped)
            engine.bank.writer.flush()  # (Bank.flush would write counters: refused here)
            if engine.bank.degraded is not None:
                break
        assert engine.bank.degraded is not None
        health = client.get("/health").json()
        assert health["status"] == "degraded" and "full" in health["degraded"]
        assert "cas_bank_bank_degraded 1" in client.get("/metrics").text
        filler.unlink()
        again = [int(t) for t in np.random.default_rng(99).integers(1, 200, 300)]
        engine.generate(GenerationRequest(prompt=again, max_tokens=1))
        engine.bank.writer.flush()
        assert engine.bank.degraded is None
        assert client.get("/health").json()["status"] == "ok"
    finally:
        engine.close()


def test_readers_write_nothing_even_on_a_read_only_mount(tmp_path: Path) -> None:
    from damage_kit import build, check_bank
    from tool_banks import cas_bank_json

    where = tmp_path / "ro"
    mount_tmpfs(where, "16m")
    try:
        path = where / "bank"
        ps = build(path, n=4)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
        with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as bank:
            assert exact(bank, ps[0]) == 10 * B
        with Bank.open(path, BankConfig(hot_bytes=0), mode="secondary") as bank:
            bank.refresh()
            assert bank.stats().blocks > 0
        stats = cas_bank_json("stats", path)
        assert stats["blocks"] > 0 and stats["disk_bytes"] > 0
        report = cas_bank_json("verify", path)
        assert report["ok"] and report["looks"] == 1
        assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
        assert check_bank(path, ps) == "refused"  # a writer cannot open it: a clear error
    finally:
        unmount(where)


def test_a_background_store_that_finds_the_disk_full_is_skipped(small_disk: Path) -> None:
    """`skip_store_when_full` holds for stores the background writer makes: the write
    is skipped with a warning, the writer's flush does not raise it, the bank says
    degraded."""
    from cas_bank.runtime import PrefixCache, build_model

    config = BankConfig(block_size=16, write_behind=2, file_min_bytes=0, hot_bytes=0)
    bank = Bank.open(small_disk / "bank", config)
    try:
        model = build_model("tiny-qwen3")
        pc = PrefixCache(bank, model, skip_store_when_full=True, background=True)
        fill(small_disk, 64 << 10)
        tokens = [t % 500 + 1 for t in range(600)]
        pc.prefill(tokens, pc.new_cache(), end=True)
        assert bank.writer is not None
        bank.writer.flush()  # the queued stores: the one that met the full disk is skipped
        assert pc.last_pending is not None and pc.last_pending.result().blocks_written == 0
        assert bank.degraded is not None
    finally:
        bank.close()


def refuse_one_background_store(bank: Bank, disk: Path, rng: np.random.Generator) -> Path:
    """Fill `disk`, let a background store find it full (its `result()` raises), and
    return the filler; the bank is then degraded until the filler goes."""
    ns = bank.namespace(wide_spec())
    filler = fill(disk, 32 << 10)
    with pytest.raises(BankFullError):
        for _ in range(20):
            p = tokens_of(rng, 1000 * B)
            ns.store_later(p, prefix_layers(wide_spec(), p)).result()
    assert bank.degraded is not None
    return filler


def test_restores_on_another_thread_while_the_bank_resumes(small_disk: Path) -> None:
    """The first store after space is freed reopens RocksDB on the writer's thread;
    restores on another thread meanwhile wait for it (before: `bank ... is closed`,
    `DbClosedError` or `Already mutably borrowed` for the reopen's duration)."""
    spec, rng = wide_spec(), np.random.default_rng(5)
    errors: list[str] = []
    for attempt in range(3):
        with Bank.open(
            small_disk / f"bank{attempt}", BankConfig(block_size=B, hot_bytes=0)
        ) as bank:
            ns = bank.namespace(spec)
            first = tokens_of(rng, 10 * B)
            ns.store(first, prefix_layers(spec, first))
            refuse_one_background_store(bank, small_disk, rng).unlink()
            started, stop = threading.Event(), threading.Event()
            args = (bank, spec, first, started, stop, errors)
            thread = threading.Thread(target=restore_until, args=args)
            thread.start()
            started.wait(10)
            late = tokens_of(rng, 10 * B)
            ns.store_later(late, prefix_layers(spec, late)).result()  # the reopen
            stop.set()
            thread.join()
            assert bank.degraded is None and exact(bank, late) == 10 * B
    assert errors == []


def test_a_read_write_open_on_a_full_disk_says_the_disk_is_full(small_disk: Path) -> None:
    """RocksDB writes a MANIFEST when it opens for writing: on a full disk that is a
    `BankFullError` naming the bank (was a bare `Exception: IO error: No space ...`)."""
    spec, rng = wide_spec(), np.random.default_rng(6)
    path = small_disk / "bank"
    first = tokens_of(rng, 10 * B)
    with Bank.open(path, BankConfig(block_size=B)) as bank:
        bank.namespace(spec).store(first, prefix_layers(spec, first))
    filler = fill(small_disk, 0)
    with pytest.raises(BankFullError) as caught:
        Bank.open(path, BankConfig(hot_bytes=0)).close()
    assert f"bank at {path} cannot be opened for writing: the disk is full" in str(caught.value)
    assert "read_only" in str(caught.value)
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as reader:
        assert exact(reader, first) == 10 * B
    filler.unlink()
    with Bank.open(path, BankConfig(hot_bytes=0)) as again:
        assert exact(again, first) == 10 * B


def test_close_after_space_is_freed_saves_the_counters(small_disk: Path) -> None:
    """A background store refused on a full disk, reported by its `result()`: once
    space is freed and the bank writes again, `close()` does not take that old error
    for a full disk: it saves the counters and last uses (before: 5 restores counted
    read 0 after reopening)."""
    spec, rng = wide_spec(), np.random.default_rng(7)
    path = small_disk / "bank"
    bank = Bank.open(path, BankConfig(block_size=B, hot_bytes=0))
    ns = bank.namespace(spec)
    first = tokens_of(rng, 10 * B)
    ns.store(first, prefix_layers(spec, first))
    refuse_one_background_store(bank, small_disk, rng).unlink()
    late = tokens_of(rng, 10 * B)
    ns.store_later(late, prefix_layers(spec, late)).result()
    assert bank.degraded is None
    for _ in range(5):
        assert exact(bank, first) == 10 * B
    restores = bank.stats().restores
    bank.close()
    with Bank.open(path, BankConfig(hot_bytes=0)) as again:
        assert again.stats().restores == restores >= 5


def test_refused_background_stores_hold_no_memory(small_disk: Path) -> None:
    """A store the background writer could not write keeps its exception for the next
    `flush()`; its traceback's frames held the store's KV snapshot, so each refused
    store held its arrays until then (12 MiB after 20 on a tiny model). Now only the
    first is kept, without its frames' locals; `flush()` still raises it."""
    import tracemalloc

    spec, rng = wide_spec(), np.random.default_rng(9)
    bank = Bank.open(small_disk / "bank", BankConfig(block_size=B, hot_bytes=0))
    try:
        ns = bank.namespace(spec)
        refuse_one_background_store(bank, small_disk, rng)
        prompts = [tokens_of(rng, 20 * B) for _ in range(20)]
        kvs = [prefix_layers(spec, p) for p in prompts]  # made before the tracing
        size = sum(a.nbytes for layer in kvs[0] for a in layer)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for p in prompts:
                pending = ns.store_later(p, kvs.pop(0))
                with contextlib.suppress(BankFullError):
                    pending.result()
                    raise AssertionError("a store on a full disk was written")
                del pending
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 2 * size, f"20 refused stores of {size} bytes each hold {grown} bytes"
        with pytest.raises(BankFullError):
            bank.flush()  # the first refusal since the last flush, as before
    finally:
        bank.close()
