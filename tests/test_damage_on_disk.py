"""Real RocksDB files damaged on disk (issue: never a crash, never a silent wipe).

Each case damages a copy of a real bank: bytes overwritten in the blocks and headers
tables (RocksDB parsed such bytes as structure and crashed the process), a truncated
MANIFEST (a read-write open deleted every table file), a deleted blob file, and a
directory holding some other RocksDB. Child processes do the damaged reads, so a
crash fails the test instead of ending the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import CHECKS, child_env, prefix_layers
from damage_kit import build, check_bank, family_tables, flip_byte
from tool_banks import CLI, cas_bank

from cas_bank import Bank, BankConfig, BankDamagedError, CasBankError

# Overwrites of 64 random bytes: (family, variant); the offset is variant * 397 modulo
# the table's size. Variant 260 of the blocks table crashed the process before.
VARIANTS = [("blocks", i) for i in range(200, 272, 4)] + [("blocks", 260)]
VARIANTS += [("headers", i) for i in range(201, 241, 8)]

CHILD = """
import json, shutil, sys
from pathlib import Path
from damage_kit import check_bank, flip, prompts
src, work = Path(sys.argv[1]), Path(sys.argv[2])
tables = json.loads(sys.argv[3])
for family, i in json.loads(sys.argv[4]):
    d = work / f"{family}-{i}"
    shutil.copytree(src, d)
    table = d / tables[family][0]
    flip(table, (i * 397) % table.stat().st_size, 64, i)
    print(family, i, check_bank(d, prompts()), flush=True)
    shutil.rmtree(d)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "bank"
    build(path)
    return path


@pytest.fixture(scope="module")
def built_blake3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same bank with blake3 records (as every bank before format version 4)."""
    path = tmp_path_factory.mktemp("damage-blake3") / "bank"
    build(path, check="blake3")
    return path


@pytest.fixture(params=CHECKS)
def built_any(request: pytest.FixtureRequest) -> Path:
    """`built` for each payload check: the tests of damaged payloads run on both."""
    return Path(request.getfixturevalue("built" if request.param == "xxh3" else "built_blake3"))


def _files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir()}


def test_overwritten_table_bytes_are_misses_or_refusals_never_a_crash(
    built: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(CHILD),
            str(built),
            str(tmp_path),
            json.dumps(family_tables(built)),
            json.dumps(VARIANTS),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    results = [line.split(maxsplit=2)[2] for line in done.stdout.splitlines()]
    assert len(results) == len(VARIANTS)
    # Damage is seen: as misses counted by restores, or as a refusal to open. A damaged
    # headers table may be seen by `verify` alone: restores take the headers' copies in
    # the chain records (`index.chain`) and never read them (every restore is exact:
    # `check_bank` checks each against the truth).
    for (family, _), r in zip(VARIANTS, results, strict=True):
        assert (
            r == "refused"
            or "corrupt=0" not in r
            or (family == "headers" and r.endswith("verify=bad"))
        ), results


def test_truncated_manifest_is_refused_and_nothing_is_deleted(built: Path, tmp_path: Path) -> None:
    path = tmp_path / "bank"
    shutil.copytree(built, path)
    (manifest,) = path.glob("MANIFEST-*")
    with manifest.open("r+b") as fh:
        fh.truncate(600)
    before = _files(path)
    with pytest.raises(BankDamagedError, match="MANIFEST") as e:
        Bank.open(path)
    assert str(path) in str(e.value) and "salvage" in str(e.value)
    with pytest.raises(CasBankError, match="MANIFEST"):
        Bank.open(path, mode="read_only")
    fixed = cas_bank("verify", path, "--fix")
    # Refused either way, naming salvage: "does not open cleanly", or, where the cut
    # took the `meta` family's record (RocksDB creates the families in an order that
    # varies from build to build), "its MANIFEST lists only some of a bank's families".
    assert fixed.returncode == 1 and "Nothing was changed" in fixed.stderr, fixed.stderr
    assert "salvage" in fixed.stderr
    assert "does not open cleanly" in fixed.stderr or "lists only some" in fixed.stderr
    scratch = tmp_path / "tmp"  # the tool's private directories go here
    scratch.mkdir()
    stats = subprocess.run(
        [*CLI, "stats", str(path)],
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stats.returncode == 1 and "MANIFEST" in stats.stderr, stats.stderr
    assert list(scratch.iterdir()) == []  # nothing left behind
    assert _files(path) == before  # every table and blob file is still there


def test_another_rocksdb_is_refused_and_left_alone(tmp_path: Path) -> None:
    from rocksdict import Rdict

    path = tmp_path / "other"
    db = Rdict(str(path))
    db["theirs"] = "data"
    db.close()
    before = _files(path)
    with pytest.raises(BankDamagedError, match="not a cas_bank bank"):
        Bank.open(path)
    assert cas_bank("verify", path, "--fix").returncode == 1
    assert _files(path) == before
    db = Rdict(str(path))
    assert db["theirs"] == "data"
    db.close()


def test_a_deleted_blob_file_is_a_counted_miss(built_any: Path, tmp_path: Path) -> None:
    path = tmp_path / "bank"
    shutil.copytree(built_any, path)
    for blob in path.glob("*.blob"):
        blob.unlink()
    from damage_kit import prompts

    result = check_bank(path, prompts())
    assert result == "refused" or ("hits=0" in result and "verify=ok" not in result), result


def test_salvage_copies_what_verifies_into_a_new_bank(built_any: Path, tmp_path: Path) -> None:
    from damage_kit import prompts
    from tool_banks import cas_bank_json

    path = tmp_path / "bank"
    shutil.copytree(built_any, path)
    (manifest,) = path.glob("MANIFEST-*")
    with manifest.open("r+b") as fh:
        fh.truncate(600)
    before = _files(path)
    report = cas_bank_json("salvage", path, tmp_path / "new")
    assert report["repaired"] and report["blocks_copied"] > 0
    assert _files(path) == before  # the damaged bank is left as it was
    assert check_bank(tmp_path / "new", prompts(), full=True).endswith("verify=ok")
    with Bank.open(tmp_path / "new") as new:  # each block counted once: no history
        stats = new.stats()
        assert stats.logical_tokens == stats.unique_tokens > 0 and stats.dedup_ratio == 1.0


def test_a_damaged_blob_record_is_reported_alone_and_fix_keeps_the_rest(
    built_any: Path, tmp_path: Path
) -> None:
    """RocksDB's walk of a family ends quietly at a record whose checksum fails (as if
    the family ended there): the records after it must still be read, and `--fix`
    must remove the damaged block and what lies below it, nothing else."""
    from cas_bank.maintenance.verify import verify

    path = tmp_path / "bank"
    shutil.copytree(built_any, path)
    blob = max(path.glob("*.blob"), key=lambda p: p.stat().st_size)
    flip_byte(blob, blob.stat().st_size // 2)  # in the middle: inside some record's value
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as bank:
        blocks = bank.stats().blocks
        report = verify(bank)
    kinds = [p.kind for p in report.problems]
    damaged = [p for p in report.problems if p.kind != "unreachable"]
    assert len(damaged) == 1 and damaged[0].kind == "payload_corrupt", kinds
    assert report.blocks_checked == blocks  # every record read, past the damage too
    with Bank.open(path, BankConfig(hot_bytes=0)) as bank:
        fixed = verify(bank, fix=True)
        assert len(fixed.removed_blocks) == len(report.problems)
        assert bank.stats().blocks == blocks - len(report.problems)


def test_a_damaged_headers_table_block_is_verified_around(built: Path, tmp_path: Path) -> None:
    """RocksDB cannot walk the headers past a damaged table block: verify reads the
    rest one by one (found by their payloads' keys), reports the headers it cannot
    read, and checks every block whose header it can."""
    from damage_kit import flip

    from cas_bank.maintenance.verify import verify

    path = tmp_path / "bank"
    shutil.copytree(built, path)
    table = family_tables(path)["headers"][0]
    flip(path / table, 100, 16, seed=1)  # inside the first data block
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as bank:
        blocks = bank.stats().blocks
        report = verify(bank)
    unreadable = [p for p in report.problems if p.kind == "bad_header"]
    assert unreadable and "damaged on disk" in unreadable[0].detail
    assert report.blocks_checked + len(unreadable) == blocks


def test_damaged_last_use_records_are_reported_and_never_stop_the_bank(
    built: Path, tmp_path: Path
) -> None:
    """The access family is advice: with a damaged table there, `ls` lists, a store
    that must evict still stores, and verify reports the damage (salvage, not --fix)."""
    from damage_kit import flip, prompts, wide_spec
    from tool_banks import cas_bank_json

    from cas_bank.maintenance.verify import verify

    path = tmp_path / "bank"
    shutil.copytree(built, path)
    flip(path / family_tables(path)["access"][0], 100, 16, seed=2)
    listing = cas_bank_json("ls", path)
    with Bank.open(path, BankConfig(hot_bytes=0), mode="read_only") as bank:
        assert listing["total"] == bank.stats().blocks
        report = verify(bank)
    assert [p.kind for p in report.problems] == ["bad_access"]
    assert "salvage" in report.problems[0].detail
    spec, extra = wide_spec(), prompts(1, seed=5)[0]
    with Bank.open(path, BankConfig(hot_bytes=0, max_bytes=200_000)) as bank:
        ns = bank.namespace(spec)
        ns.store(extra, prefix_layers(spec, extra))  # evicts to the budget
        assert bank.stats().payload_bytes <= 200_000 and ns.match(extra) == len(extra)


def test_salvage_copies_again_when_a_writer_deletes_a_file_mid_copy(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live writer may delete a table file (a flush, a compaction) while salvage
    copies the directory: the copy starts again; after a few tries, a clear error."""
    import cas_bank.maintenance.salvage as salvage_module

    real = shutil.copytree
    calls = []

    def vanishing(src: Path, dst: Path, *args: object, **kw: object) -> object:
        if Path(src) != built:  # shutil's own calls for subdirectories
            return real(src, dst, *args, **kw)  # type: ignore[arg-type]
        calls.append(src)
        if len(calls) == 1:  # as shutil reports a file gone between listing and copy
            real(src, dst, *args, **kw)  # type: ignore[arg-type]
            raise shutil.Error([(str(src / "000099.sst"), str(dst), "No such file")])
        return real(src, dst, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(salvage_module.shutil, "copytree", vanishing)
    report = salvage_module.salvage(built, tmp_path / "new")
    assert len(calls) == 2 and report.blocks_copied > 0

    def always(src: Path, dst: Path, *args: object, **kw: object) -> object:
        raise FileNotFoundError(f"{src}/000099.sst")

    monkeypatch.setattr(salvage_module.shutil, "copytree", always)
    with pytest.raises(CasBankError, match="a writer changed its files"):
        salvage_module.salvage(built, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_salvage_leaves_out_a_file_it_cannot_read_and_goes_on(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error on one table file (a bad sector) is what salvage is for: the file
    is left out of the copy and named, RocksDB's repair does without it, and what still
    verifies is copied (no retry, no blame on a writer)."""
    import errno

    import cas_bank.maintenance.salvage as salvage_module

    bad = family_tables(built)["headers"][0]
    real = shutil.copy2

    def failing(source: str, target: str, **kw: object) -> object:
        if Path(source).name == bad:
            raise OSError(errno.EIO, "Input/output error", source)
        return real(source, target, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(salvage_module.shutil, "copy2", failing)
    report = salvage_module.salvage(built, tmp_path / "new")
    assert [f.split(":")[0] for f in report.unreadable_files] == [str(built / bad)]
    assert report.repaired
