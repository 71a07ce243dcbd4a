"""The bank's options (`tools/bank_args.py`), one set for both servers: the same names,
defaults and help in `cas-bank serve` and `cas-bank mlx-lm-server`, refused values
named before anything is opened, and the servers applying them (a disk budget that
evicts, the hot-tier size in /metrics, stores off or inline), run through the real
commands."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cas_bank.tools.cli import build_parser
from hf_models import model_dir
from runtime_helpers import metric
from server_kit import TIMEOUT, chat, start_server
from test_mlx_lm_server import chat as mlx_lm_chat
from test_mlx_lm_server import start as start_mlx_lm
from tool_banks import assert_one_line_error

from cas_bank import Bank, BankConfig

CLI = [sys.executable, "-m", "cas_bank.tools.cli"]
SERVERS = ("serve", "mlx-lm-server")
BANK_OPTIONS = {
    "--block-size",
    "--max-bytes",
    "--hot-bytes",
    "--stores",
    "--remote",
    "--remote-tls-ca",
    "--remote-tls-cert",
    "--remote-tls-key",
}


def bank_options(command: str) -> dict[str, tuple[object, ...]]:
    """Each option of the command's "bank options" section: what a user sees of it."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    group = next(g for g in parser._action_groups if g.title == "bank options")
    return {
        a.option_strings[0]: (a.dest, a.default, a.help, a.choices, a.metavar, a.type, a.nargs)
        for a in group._group_actions
    }


def help_section(command: str) -> str:
    """The "bank options" section of `cas-bank COMMAND --help`, as printed."""
    env = {**os.environ, "COLUMNS": "100"}
    out = subprocess.run(
        [*CLI, command, "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    section = out.stdout.split("\nbank options:\n", 1)[1]
    return section.split("\n\n", 1)[0]


def test_both_servers_take_the_same_bank_options_with_the_same_defaults_and_help() -> None:
    serve, mlx_lm = bank_options("serve"), bank_options("mlx-lm-server")
    assert set(serve) == BANK_OPTIONS
    assert serve == mlx_lm
    assert serve["--stores"][1] == "background" and serve["--hot-bytes"][1] is None
    assert "256MiB" in str(serve["--hot-bytes"][2])  # BankConfig's default, stated
    assert help_section("serve") == help_section("mlx-lm-server")


@pytest.mark.parametrize("command", SERVERS)
@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--block-size", "70000", "bad --block-size: "),
        ("--max-bytes", "lots", "argument --max-bytes: 'lots' is not a size"),
        ("--hot-bytes", "-1", "argument --hot-bytes: '-1' is not a size"),
        ("--stores", "later", "argument --stores: invalid choice: 'later'"),
    ],
)
def test_a_refused_bank_option_is_one_line_naming_it_before_anything_is_made(
    tmp_path: Path, command: str, option: str, value: str, said: str
) -> None:
    bank = tmp_path / "bank"
    argv = [*CLI, command, "--bank", str(bank), option, value, "--port", "0"]
    argv += ["--model", str(tmp_path)] if command == "mlx-lm-server" else []
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, said)
    assert not bank.exists()


def test_mlx_lm_servers_old_inline_stores_still_works_with_a_warning() -> None:
    args = build_parser().parse_known_args(["mlx-lm-server", "--inline-stores"])[0]
    assert args.stores == "inline"
    args = build_parser().parse_known_args(["mlx-lm-server"])[0]
    assert args.stores == "background"
    proc = subprocess.run(
        [*CLI, "mlx-lm-server", "--inline-stores", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--inline-stores is deprecated" in proc.stderr and "--stores inline" in proc.stderr
    assert "mlx-lm-server needs --model" in proc.stderr  # and it went on to the checks


def test_serve_keeps_the_bank_under_max_bytes_and_shows_its_hot_bytes(tmp_path: Path) -> None:
    budget = 64 * 1024
    server = start_server(
        tmp_path / "bank", tmp_path / "server.log", "--max-bytes", "64K", "--hot-bytes", "3M"
    )
    try:
        for i in range(8):  # distinct prompts: ~30 KB stored each
            system = f"Conversation {i}: you answer questions about topic {i}. " * 12
            chat(
                server.url,
                [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            )
        text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        assert metric(text, "cas_bank_hot_budget_bytes") == 3 * 1024 * 1024
    finally:
        server.stop()
    assert server.proc.returncode == 0
    with Bank.open(tmp_path / "bank", BankConfig(hot_bytes=0), mode="read_only") as bank:
        stats = bank.stats()
    assert stats.blocks_evicted > 0
    assert 0 < stats.stored_bytes <= budget


def test_mlx_lm_server_takes_stores_off_and_inline_and_its_hot_bytes(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "qwen3", "tiny-qwen3")
    bank, log = tmp_path / "bank", tmp_path / "server.log"
    messages = [{"role": "system", "content": "You answer briefly. " * 20}]
    messages += [{"role": "user", "content": "hi"}]
    stored = []
    for stores in ("off", "inline"):
        server = start_mlx_lm(bank, model, log, "--stores", stores, "--hot-bytes", "2M")
        try:
            for _ in range(2):
                mlx_lm_chat(server.url, messages)
            text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
            assert metric(text, "cas_bank_hot_budget_bytes") == 2 * 1024 * 1024
        finally:
            assert server.stop() == 0, log.read_text()
        with Bank.open(bank, BankConfig(hot_bytes=0), mode="read_only") as b:
            stored.append(b.stats().stored_bytes)
    assert stored[0] == 0 < stored[1]
