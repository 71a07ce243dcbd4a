"""What may open as a bank: a cas_bank bank, or an empty or new directory. An empty
path, a file, a directory of other files and another program's RocksDB database are
refused by every command (readers and writers, `serve` too) with one line naming the
problem and a non-zero exit, and nothing in them changes (`cas_bank.blocks.bankdir`).
A missing or empty directory is "no bank at ..." to every command that does not
create one."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cas_bank.tools.cli import main
from conftest import BLOCK_SIZE, attention_spec, random_layers
from rocksdict import Options, Rdict
from tool_banks import CLI, assert_one_line_error

from cas_bank import Bank, BankConfig, BankLockedError, NotABankError
from cas_bank.maintenance.bundle import chain_to_leaf, export_chain


def _file(home: Path) -> str:
    (home / "a_file").write_text("not a bank\n")
    return str(home / "a_file")


def _other_files(home: Path) -> str:
    (home / "project").mkdir()
    (home / "project" / "config.json").write_text('{"theirs": true}\n')
    (home / "project" / "notes.txt").write_text("keep me\n")
    return str(home / "project")


def _other_rocksdb(home: Path) -> str:
    db = Rdict(str(home / "db"))
    db["theirs"] = "data"
    db.close()
    return str(home / "db")


def _other_rocksdb_with_meta(home: Path) -> str:
    """A family named like a bank's, but another comparator (rocksdict's default)."""
    options = Options()
    options.create_missing_column_families(True)
    db = Rdict(str(home / "db"), options=options)
    db.create_column_family("meta", Options())["k"] = 1
    db.close()
    return str(home / "db")


def _empty_path(home: Path) -> str:
    (home / "mine.txt").write_text("the current directory\n")
    return ""


KINDS: dict[str, tuple[Callable[[Path], str], str]] = {
    "file": (_file, "is a file, not a bank directory"),
    "other files": (_other_files, "holds no cas_bank bank but 2 other entries"),
    "other rocksdb": (_other_rocksdb, "not a cas_bank bank (column families ['default'])"),
    "other rocksdb, meta family": (_other_rocksdb_with_meta, "not a cas_bank bank (Invalid"),
    "empty path": (_empty_path, "the bank path is empty"),
}

COMMANDS = {
    "stats": ["stats", "{bank}"],
    "ls": ["ls", "{bank}"],
    "tree": ["tree", "{bank}"],
    "show": ["show", "{bank}", "abcd"],
    "verify": ["verify", "{bank}"],
    "verify --fix": ["verify", "{bank}", "--fix"],
    "explain": ["explain", "{bank}", "--tokens", "{tokens}"],
    "export": ["export", "{bank}", "--tokens", "{tokens}", "-o", "{out}/x.casb"],
    "import": ["import", "{bank}", "{bundle}"],
    "import --create": ["import", "{bank}", "{bundle}", "--create"],
    "gc": ["gc", "{bank}", "--max-bytes", "100"],
    "salvage from": ["salvage", "{bank}", "{out}/new"],
    "salvage into": ["salvage", "{good}", "{bank}"],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A good bank, a bundle of one of its chains and a token file."""
    where = tmp_path_factory.mktemp("sources")
    tokens = list(range(2 * BLOCK_SIZE))
    with Bank.open(where / "good", BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(attention_spec())
        leaf = ns.store(tokens, random_layers(ns.spec, len(tokens))).chain[-1]
        export_chain(bank, chain_to_leaf(bank, leaf), where / "chain.casb")
    (where / "tokens.json").write_text(str(tokens))
    return {
        "good": str(where / "good"),
        "bundle": str(where / "chain.casb"),
        "tokens": str(where / "tokens.json"),
    }


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `root`: size, mtime and a digest of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            size = st.st_size if p.is_file() else 0
            out[str(p.relative_to(root))] = (size, st.st_mtime_ns, digest)
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's refusal of a bad argument
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _argv(command: str, bank: str, sources: dict[str, str], out: Path) -> list[str]:
    values = {**sources, "bank": bank, "out": str(out)}
    return [a.format(**values) for a in COMMANDS[command]]


@pytest.mark.parametrize("kind", KINDS)
def test_every_command_refuses_what_is_not_a_bank(
    kind: str,
    sources: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make, needle = KINDS[kind]
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    monkeypatch.chdir(home)  # `''` must not make the current directory a bank
    bank = make(home)
    before = _snapshot(home)
    for command in COMMANDS:
        rc, stdout, stderr = _run(_argv(command, bank, sources, out), capsys)
        lines = stderr.strip().splitlines()
        assert rc != 0 and stdout == "", (command, rc, stdout)
        assert len(lines) == 1 and lines[0].startswith("cas-bank: error: "), (command, stderr)
        want = needle
        if command == "salvage into" and kind.startswith("other rocksdb"):
            want = "holds a database already: salvage writes a new bank"
        assert want in lines[0], (command, lines[0])
        assert "--debug" not in lines[0], (command, lines[0])  # no raw exception
        assert _snapshot(home) == before, command
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_no_bank_is_the_same_line_from_every_command(
    kind: str, sources: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank, out = tmp_path / "bank", tmp_path / "out"
    out.mkdir()
    if kind == "empty":
        bank.mkdir()
    creating = {"import --create", "salvage into"}  # these make the bank: not an error
    for command in [c for c in COMMANDS if c not in creating]:
        rc, stdout, stderr = _run(_argv(command, str(bank), sources, out), capsys)
        assert rc == 1 and stdout == "", (command, stderr)
        assert stderr.strip().splitlines() == [f"cas-bank: error: no bank at {bank}"] or (
            command == "import" and "`--create` makes one (block size 4" in stderr
        ), (command, stderr)
        assert bank.exists() == (kind == "empty") and not (bank.exists() and any(bank.iterdir()))
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("mode", ["read_write", "read_only", "secondary"])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "empty path"])
def test_bank_open_refuses_in_every_mode(kind: str, mode: str, tmp_path: Path) -> None:
    make, needle = KINDS[kind]
    path = Path(make(tmp_path))
    before = _snapshot(tmp_path)
    with pytest.raises(NotABankError, match=needle.split(" (")[0]):
        Bank.open(path, mode=mode)  # type: ignore[arg-type]
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "other rocksdb, meta family"])
def test_serve_refuses_the_directory_before_serving(kind: str, tmp_path: Path) -> None:
    """The real `cas-bank serve` process: one line, exit 1 (2 for the empty path)."""
    make, needle = KINDS[kind]
    home = tmp_path / "home"
    home.mkdir()
    bank = make(home)
    before = _snapshot(home)
    proc = subprocess.run(
        [*CLI, "serve", "--bank", bank, "--port", "0"],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc, needle)
    assert proc.stdout == ""
    assert _snapshot(home) == before


def _cut_short_first_open(tmp_path: Path) -> Path:
    """What a first open killed before `CURRENT` leaves (copied from a real open), and
    the `lost+found` of a fresh volume mounted there."""
    scratch = tmp_path / "scratch"
    Rdict(str(scratch)).close()
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "lost+found").mkdir()
    for name in ("LOCK", "LOG", "IDENTITY", "rocksdict-config.json"):
        if (scratch / name).exists():
            shutil.copy(scratch / name, bank / name)
    (bank / "LOG.old.1700000000000000").write_text("an older open's log\n")
    return bank


def test_a_first_open_cut_short_opens_as_a_new_bank(tmp_path: Path) -> None:
    bank = _cut_short_first_open(tmp_path)
    with pytest.raises(FileNotFoundError, match="no bank at"):
        Bank.open(bank, mode="read_only")  # a reader finds no bank, as in an empty one
    tokens = list(range(2 * BLOCK_SIZE))
    with Bank.open(bank, BankConfig(block_size=BLOCK_SIZE)) as b:
        ns = b.namespace(attention_spec())
        ns.store(tokens, random_layers(ns.spec, len(tokens)))
    with Bank.open(bank) as b:
        assert b.namespace(attention_spec()).match(tokens) == len(tokens)


def test_rocksdb_data_without_current_is_still_refused(tmp_path: Path) -> None:
    bank = _cut_short_first_open(tmp_path)
    (bank / "MANIFEST-000001").write_bytes(b"\0" * 16)
    (bank / "000004.log").write_bytes(b"")
    with pytest.raises(NotABankError, match="2 other entries"):
        Bank.open(bank)


def test_a_bank_being_created_is_locked_not_foreign(tmp_path: Path) -> None:
    """Another process between its LOCK and its CURRENT: the lock is what it says."""
    bank = _cut_short_first_open(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(bank / "LOCK")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(BankLockedError, match="another writer process"):
            Bank.open(bank)
    finally:
        holder.communicate("")
    assert not (bank / "CURRENT").exists()


_HOLD_LOCK = """
import fcntl, sys
f = open(sys.argv[1], "r+")
fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""


def test_another_databases_meta_family_is_not_a_banks(tmp_path: Path) -> None:
    """A bank's comparator and a family named `meta`, but no format record in it: the
    writer refuses it before its open would add a bank's families to it."""
    options = Options(raw_mode=True)
    options.create_missing_column_families(True)
    db = Rdict(str(tmp_path / "db"), options=options)
    db.create_column_family("meta", Options(raw_mode=True))[b"theirs"] = b"data"
    db.close()
    before = _snapshot(tmp_path)
    with pytest.raises(NotABankError, match=r"not a cas_bank bank .*no cas_bank format record"):
        Bank.open(tmp_path / "db")
    assert _snapshot(tmp_path) == before
    assert sorted(Rdict.list_cf(str(tmp_path / "db"))) == ["default", "meta"]


@pytest.mark.parametrize("mode", ["read_write", "read_only"])
def test_a_bank_whose_manifest_lost_its_meta_family_is_damaged_not_foreign(
    mode: str, tmp_path: Path
) -> None:
    """A truncated MANIFEST lists the families created before the cut, in an order
    RocksDB picks: one that names only a bank's families, without `meta`, is a damaged
    bank (salvage takes it), never another program's database."""
    from cas_bank import BankDamagedError

    options = Options(raw_mode=True)
    options.create_missing_column_families(True)
    db = Rdict(str(tmp_path / "db"), options=options)
    for name in ("headers", "blocks"):
        db.create_column_family(name, Options(raw_mode=True))
    db.close()
    before = _snapshot(tmp_path)
    with pytest.raises(BankDamagedError, match=r"damaged: its MANIFEST .*salvage") as e:
        Bank.open(tmp_path / "db", mode=mode)  # type: ignore[arg-type]
    assert not isinstance(e.value, NotABankError)
    assert _snapshot(tmp_path) == before
    # One family no bank has: another program's.
    db = Rdict(str(tmp_path / "db"), options=options)
    db.create_column_family("theirs", Options(raw_mode=True))
    db.close()
    with pytest.raises(NotABankError, match="not a cas_bank bank"):
        Bank.open(tmp_path / "db", mode=mode)  # type: ignore[arg-type]


def test_reopening_a_bank_keeps_a_bounded_number_of_info_logs(tmp_path: Path) -> None:
    """Every open starts a RocksDB info log; a bank opened by each tool call and each
    restart keeps only the newest few (RocksDB's default kept 1000)."""
    from cas_bank.blocks.rocks_options import INFO_LOGS_KEPT

    tokens = list(range(2 * BLOCK_SIZE))
    for _ in range(INFO_LOGS_KEPT + 4):
        with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK_SIZE)) as b:
            ns = b.namespace(attention_spec())
            ns.store(tokens, random_layers(ns.spec, len(tokens)))
    logs = [p.name for p in (tmp_path / "bank").iterdir() if p.name.startswith("LOG")]
    assert "LOG" in logs
    assert len(logs) <= INFO_LOGS_KEPT, sorted(logs)
    with Bank.open(tmp_path / "bank", mode="read_only") as b:
        assert b.namespace(attention_spec()).match(tokens) == len(tokens)
