"""`cas-bank` run for real in subprocesses: stats, ls, show (human and --json) on a bank
with an attention, a hybrid and a shared-prefix fleet namespace; bad arguments give one
line and a non-zero exit; and the read-only tools run beside a live writer process
without harming it."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, attention_spec, child_env
from tool_banks import (
    CLI,
    TEXTS,
    BuiltBank,
    assert_one_line_error,
    build_bank,
    cas_bank,
    cas_bank_json,
)

from cas_bank import Bank, BankConfig, ModelSpec
from cas_bank.blocks.store import Family
from cas_bank.index.records import TIME


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltBank:
    return build_bank(tmp_path_factory.mktemp("cli") / "bank")


# -- stats -----------------------------------------------------------------------------
def test_stats_counts_blocks_states_namespaces_and_dedup(built: BuiltBank) -> None:
    data = cas_bank_json("stats", built.path)
    assert data["blocks"] == 29 and data["states"] == 2 and data["namespaces"] == 3
    assert [n["name"] for n in data["namespace_list"]] == ["fleet", "tiny-attn", "tiny-hybrid"]
    assert data["block_size"] == BLOCK_SIZE
    # Fleet: 4 agents store 6+5+5+4 = 20 blocks of which 10 are unique.
    stored = 7 + 7 + 5 + 20
    assert data["logical_tokens"] == stored * BLOCK_SIZE
    assert data["unique_tokens"] == 29 * BLOCK_SIZE
    assert data["dedup_ratio"] == pytest.approx(stored / 29)
    assert data["corrupt_reads"] == 0 and data["payload_bytes"] > 0

    out = cas_bank("stats", built.path, check=True).stdout
    assert "3 (fleet, tiny-attn, tiny-hybrid)" in out
    assert f"dedup ratio     {stored / 29:.2f}" in out
    assert "hits / misses   0 / 0" in out  # labels padded to one column


# -- ls --------------------------------------------------------------------------------
def test_ls_lists_every_block_with_namespace_depth_size_chains(built: BuiltBank) -> None:
    data = cas_bank_json("ls", built.path)
    assert data["total"] == 29 and len(data["blocks"]) == 29
    by_hash = {b["hash"]: b for b in data["blocks"]}
    system = by_hash[built.chains["agent0"][0].hex()]
    assert (system["namespace"], system["depth"], system["chains"]) == ("fleet", 0, 4)
    state_block = by_hash[built.chains["hybrid"][1].hex()]
    assert state_block["state_bytes"] > 0 and state_block["namespace"] == "tiny-hybrid"
    assert by_hash[built.chains["hybrid"][0].hex()]["state_bytes"] is None
    assert all(b["last_use"] is not None for b in data["blocks"])  # stores record uses

    lines = cas_bank("ls", built.path, check=True).stdout.splitlines()
    assert lines[0].split() == [
        "hash",
        "namespace",
        "depth",
        "size",
        "state",
        "ends",
        "chains",
        "last",
        "use",
    ]
    assert len(lines) == 30
    # Aligned: every row's depth column ends where the header's does.
    end = lines[0].index("depth") + len("depth")
    assert all(line[end - 1].isdigit() and line[end] == " " for line in lines[1:])


def test_ls_filters_sorts_and_limits(built: BuiltBank) -> None:
    fleet = cas_bank_json("ls", built.path, "--namespace", "fleet", "--sort", "chains")
    assert fleet["total"] == 10
    assert [b["chains"] for b in fleet["blocks"]] == [4, 4, 4, 2, 1, 1, 1, 1, 1, 1]
    big = cas_bank_json("ls", built.path, "--sort", "size", "--limit", "2")
    assert all(b["state_bytes"] for b in big["blocks"])  # blocks with states are largest
    out = cas_bank("ls", built.path, "--namespace", "tiny-hybrid", "--limit", "2").stdout
    assert "(2 of 5 blocks shown)" in out


def test_ls_sorts_by_last_use_from_the_access_family(tmp_path: Path) -> None:
    built = build_bank(tmp_path / "bank")
    newest = built.chains["text1"][3]
    with Bank.open(built.path) as bank:
        bank.store.put_batch([(Family.ACCESS, newest, TIME.pack(time.time() + 3600))])
    data = cas_bank_json("ls", built.path, "--sort", "last-use", "--limit", "1")
    assert data["blocks"][0]["hash"] == newest.hex()


# -- show ------------------------------------------------------------------------------
def test_show_decodes_layers_tokens_and_text(built: BuiltBank) -> None:
    chain = built.chains["text0"]
    data = cas_bank_json("show", built.path, chain[1].hex()[:10])
    assert data["hash"] == chain[1].hex() and data["namespace"] == "tiny-attn"
    assert data["depth"] == 1 and data["parent"] == chain[0].hex()
    assert data["children"] == [chain[2].hex()] and data["chains"] == 1
    assert data["tokens"] == list(TEXTS[0].encode()[4:8])
    assert data["text"] == TEXTS[0][4:8]
    assert data["payload"]["status"] == "ok" and data["state"] is None
    layers = data["layers"]
    assert [(r["layer"], r["array"]) for r in layers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["shape"] == [1, 2, BLOCK_SIZE, 8] and r["dtype"] == "float16" for r in layers)

    out = cas_bank("show", built.path, chain[0].hex()[:8], check=True).stdout
    assert "parent     namespace root" in out
    assert f"text       {TEXTS[0][:4]!r}" in out
    assert "1x2x4x8" in out and "float16" in out and "digest ok" in out
    assert "not stored at this boundary" in out


def test_show_a_hybrid_block_with_its_state(built: BuiltBank) -> None:
    chain = built.chains["hybrid"]
    data = cas_bank_json("show", built.path, chain[3].hex())
    assert data["state"]["status"] == "ok" and data["text"] is None  # no tokenizer recorded
    kinds = {(r["source"], r["layer"], r["kind"], r["dtype"]) for r in data["layers"]}
    assert ("state", 0, "recurrent", "bfloat16") in kinds
    assert ("state", 2, "recurrent", "float32") in kinds
    assert ("block", 1, "attention", "bfloat16") in kinds
    states = [r for r in data["layers"] if r["source"] == "state"]
    assert sorted(r["shape"] for r in states) == [[1, 2, 4, 4]] * 2 + [[1, 3, 24]] * 2
    out = cas_bank("show", built.path, chain[3].hex()[:12], check=True).stdout
    assert f"stored at token {4 * BLOCK_SIZE}" in out and "recurrent" in out
    assert "tokenizer 'org/some-hf-tokenizer' is not one the tools decode" in out


def test_show_a_shared_block_lists_its_branches(built: BuiltBank) -> None:
    data = cas_bank_json("show", built.path, built.chains["agent0"][2].hex()[:12])
    assert data["chains"] == 4 and data["tokenizer"] == "byte:512"
    assert data["text"] == bytes(built.prompts["agent0"][8:12]).decode()
    assert sorted(data["children"]) == sorted(
        built.chains[a][3].hex() for a in ("agent0", "agent2", "agent3")
    )


# -- bad arguments ---------------------------------------------------------------------
def _ambiguous_prefix(built: BuiltBank) -> str:
    hashes = sorted({h.hex() for chain in built.chains.values() for h in chain})
    for a, b in itertools.pairwise(hashes):
        if a[0] == b[0]:
            return a[0]
    raise AssertionError("29 random hashes always share a first digit")


@pytest.mark.parametrize("command", [["ls"], ["verify", "--fix"]])
def test_no_such_bank_is_one_line_and_creates_nothing(command: list[str], tmp_path: Path) -> None:
    assert_one_line_error(cas_bank(command[0], tmp_path / "nope", *command[1:]), "no bank at")
    assert not (tmp_path / "nope").exists()


def test_bad_arguments_are_one_line(built: BuiltBank, tmp_path: Path) -> None:
    prefix = _ambiguous_prefix(built)
    assert_one_line_error(cas_bank("show", built.path, prefix), "ambiguous", "give more digits")
    assert_one_line_error(cas_bank("show", built.path, "xyz"), "not a block hash")
    assert_one_line_error(cas_bank("show", built.path, "f" * 64), "no block hash starts with")
    proc = cas_bank("ls", built.path, "--sort", "colour")
    assert_one_line_error(proc, "invalid choice")
    assert proc.returncode == 2
    assert_one_line_error(cas_bank("ls", built.path, "--limit", "0"), "at least 1")
    assert_one_line_error(cas_bank("ls", built.path, "--namespace", "nope"), "no namespace")
    assert_one_line_error(cas_bank("import", tmp_path / "nope", built.path / "CURRENT"), "damaged")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert_one_line_error(cas_bank("stats", plain), "no bank at")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_one_line_error(cas_bank("salvage", built.path, a_file), "is a file")
    bundle = tmp_path / "chain.casb"
    leaf = built.chains["agent0"][-1].hex()[:16]
    cas_bank("export", built.path, "--leaf", leaf, "-o", bundle, check=True)
    assert_one_line_error(cas_bank("import", a_file, bundle, "--create"), "is a file")
    binary = tmp_path / "tokens.bin"
    binary.write_bytes(bytes(range(256)))
    assert_one_line_error(cas_bank("explain", built.path, "--tokens", binary), "not text")
    empty = tmp_path / "empty"
    Bank.open(empty).close()
    proc = cas_bank("export", empty, "--tokens", binary, "-o", tmp_path / "x.casb")
    assert_one_line_error(proc, "not text")
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[1, 2, 3]")
    proc = cas_bank("export", empty, "--tokens", tokens, "-o", tmp_path / "x.casb")
    assert_one_line_error(proc, "has no namespace")


def test_a_reader_that_goes_away_is_not_an_error(built: BuiltBank, tmp_path: Path) -> None:
    """`cas-bank gc BANK ... | head -1`: the output is cut short, the command succeeds."""
    bank = tmp_path / "bank"
    shutil.copytree(built.path, bank)
    cmd = " ".join(f"'{a}'" for a in [*CLI, "gc", bank, "--max-bytes", "1K"])
    done = subprocess.run(
        ["bash", "-c", f"{cmd} | head -1; exit ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("budget"), done
    assert done.stderr == "", done.stderr


# -- a live writer ---------------------------------------------------------------------
# Payloads of 4 KiB and more (the "wide" model) live in BlobDB files, which RocksDB
# secondaries cannot read; flushes every few stores make the writer create and delete
# files while the tools look.
WRITER = """
import sys, time
from pathlib import Path
from conftest import attention_spec, hybrid_spec, random_layers, random_state
from cas_bank import Bank, BankConfig, ModelSpec

path, stop = Path(sys.argv[1]), Path(sys.argv[2])
wide = ModelSpec(name="wide", layers=attention_spec().layers * 8, weights_digest="w-wide")
stored = 0
with Bank.open(path, BankConfig(block_size=4, hot_bytes=0)) as bank:
    attn, hyb = bank.namespace(wide), bank.namespace(hybrid_spec())
    while not stop.exists():
        toks = [stored % 7] * 4 + list(range(1000 + 20 * stored, 1000 + 20 * stored + 12))
        attn.store(toks, random_layers(attn.spec, len(toks), seed=stored))
        hyb.store(toks, random_layers(hyb.spec, len(toks), seed=stored),
                  {8: random_state(hyb.spec, stored)})
        stored += 1
        if stored % 4 == 0:
            bank.store.flush()
        print(stored, flush=True)
        time.sleep(0.01)
print("done", stored, flush=True)
"""


def _writer_tokens(i: int) -> list[int]:
    return [i % 7] * 4 + list(range(1000 + 20 * i, 1000 + 20 * i + 12))


def test_tools_run_beside_a_live_writer_and_leave_it_unharmed(tmp_path: Path) -> None:
    path, stop = tmp_path / "bank", tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert writer.stdout is not None
        for _ in range(5):  # a few stores (and a flush) before the tools look
            assert writer.stdout.readline().strip(), writer.stderr.read() if writer.stderr else ""
        assert list(path.glob("*.blob")), "the writer has flushed payloads to blob files"
        stats = cas_bank_json("stats", path)
        assert stats["blocks"] >= 5 * 4 and stats["namespaces"] == 2
        listing = cas_bank_json("ls", path, "--namespace", "wide")
        assert listing["total"] >= 5 * 4 and listing["blocks"][0]["payload_bytes"] > 4096
        seen = cas_bank_json("verify", path)
        assert seen["ok"], seen["problems"]
        assert seen["blocks_checked"] >= stats["blocks"]
        leaf = listing["blocks"][-1]["hash"]
        shown = cas_bank_json("show", path, leaf)
        assert shown["payload"]["status"] == "ok" and len(shown["layers"]) == 32
        bundle = tmp_path / "chain.casb"
        cas_bank("export", path, "--leaf", leaf, "-o", bundle, check=True)
        imported = cas_bank_json("import", tmp_path / "copy", bundle, "--create")
        assert imported["blocks_written"] == 4
        # Commands that write need the writer's lock: a clear refusal, nothing touched.
        assert_one_line_error(cas_bank("verify", path, "--fix"), "held by another writer")
        assert writer.poll() is None
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    stored = int(out.split()[-1])

    final = cas_bank_json("verify", path)
    # Per namespace: 7 distinct first blocks (the ids repeat mod 7), then 3 new blocks.
    assert final["ok"] and final["blocks_checked"] == 2 * (min(stored, 7) + 3 * stored)
    assert final["states_checked"] == stored and final["looks"] == 1
    with Bank.open(path, BankConfig(block_size=BLOCK_SIZE)) as bank:
        wide = ModelSpec(name="wide", layers=attention_spec().layers * 8, weights_digest="w-wide")
        ns = bank.namespace(wide)
        for i in range(stored):
            assert ns.match(_writer_tokens(i)) == 16


def test_large_tables_are_laid_out_like_rich_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `RICH_TABLE_ROWS` rows `table` formats text itself (rich's layout is slow
    per row): the output must be the same."""
    from cas_bank.tools import common

    cols = ["hash", "namespace", "depth", "size", "chains"]
    rows = [("ab12", "fleet", 3, "640 B", 12), ("cd3456", "tiny-hybrid", 10, "1.2 KiB", 1)]
    outputs = []
    for limit in (len(rows), len(rows) - 1):
        monkeypatch.setattr(common, "RICH_TABLE_ROWS", limit)
        common.emit(common.table(cols, rows))
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert outputs[0].splitlines()[1] == "ab12    fleet            3  640 B        12"
