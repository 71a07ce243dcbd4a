"""Rough edges of `cas-bank`, through the real command: `import` into a new path names
`--create`; `export` reports the end records it carries; `ls --ends` prints the end
hashes `show` takes; salted namespaces are marked and `--namespace MODEL` means the
unsalted one; `serve --block-size` on a bank of another size is refused, as its help
says."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import attention_spec, prefix_layers
from tool_banks import CLI, assert_one_line_error, cas_bank, cas_bank_json

from cas_bank import Bank, BankConfig

B = 4
TOKENS = list(range(2 * B + 2))  # two blocks and a tail: an end record


@pytest.fixture(scope="module")
def salted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model's unsalted namespace and two tenants' salted ones, each with the same
    prompt and its end record."""
    path = tmp_path_factory.mktemp("edges") / "bank"
    spec = attention_spec()
    with Bank.open(path, BankConfig(block_size=B)) as bank:
        for salt in (None, "tenant-a", "tenant-b"):
            ns = bank.namespace(spec, salt=salt)
            ns.store(TOKENS, prefix_layers(spec, TOKENS))
            ns.store_end(TOKENS, prefix_layers(spec, TOKENS))
    return path


def test_salted_namespaces_are_marked_and_the_model_name_means_the_unsalted_one(
    salted: Path,
) -> None:
    stats = cas_bank_json("stats", salted)
    names = {n["name"]: n["salted"] for n in stats["namespace_list"]}
    assert names.pop("tiny-attn") is False
    assert len(names) == 2 and all(n.startswith("tiny-attn+salt@") and s for n, s in names.items())
    plain = cas_bank_json("ls", salted, "--namespace", "tiny-attn")
    assert {b["namespace"] for b in plain["blocks"]} == {"tiny-attn"} and plain["total"] == 2
    tenant = sorted(names)[0]
    one = cas_bank_json("ls", salted, "--namespace", tenant)
    assert {b["namespace"] for b in one["blocks"]} == {tenant}
    assert "tiny-attn+salt@" in cas_bank("tree", salted, check=True).stdout


def test_ls_ends_prints_the_end_hashes_show_takes(salted: Path) -> None:
    listed = cas_bank_json("ls", salted, "--ends", "--namespace", "tiny-attn")
    assert listed["total"] == 1
    (row,) = listed["ends"]
    assert (row["tokens"], row["tail"], row["namespace"]) == (len(TOKENS), 2, "tiny-attn")
    human = cas_bank("ls", salted, "--ends", check=True).stdout
    assert row["end"][:16] in human and human.count("tiny-attn+salt@") == 2
    shown = cas_bank_json("show", salted, row["end"][:16])
    assert shown["end"] == row["end"] and shown["tokens"] == len(TOKENS)
    assert "--ends` lists them" in cas_bank("ls", salted, check=True).stdout


def test_export_reports_its_end_records_and_import_names_create(
    salted: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    bundle = tmp_path / "x.casb"
    args = ("export", salted, "--tokens", tokens, "--namespace", "tiny-attn", "-o", bundle)
    assert cas_bank_json(*args)["ends"] == 1
    bundle.unlink()
    assert "0 states, 1 end record\n" in cas_bank(*args, check=True).stdout
    proc = cas_bank("import", tmp_path / "new", bundle)
    assert_one_line_error(proc, "no bank at", "`--create` makes one (block size 4")
    assert not (tmp_path / "new").exists()


def test_serve_block_size_help_and_refusal_agree(tmp_path: Path) -> None:
    help_text = " ".join(cas_bank("serve", "--help", check=True).stdout.split())
    assert "an existing bank keeps its own and refuses another value" in help_text
    bank = tmp_path / "bank"
    Bank.open(bank, BankConfig(block_size=64)).close()
    proc = subprocess.run(
        [*CLI, "serve", "--bank", str(bank), "--block-size", "16", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc, "block_size=64", "block_size=16", "leave out --block-size")
