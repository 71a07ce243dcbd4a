"""The configs the `cas-bank` tools open banks with: no hot tier and no spares (a tool
restores nothing; a reopened bank with spares would make its last session's at the
open, up to `spare_bytes`: 1 GiB by default), whatever options a command adds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cas_bank.tools import common, quota_cmd
from cas_bank.tools.cli import build_parser
from cas_bank.tools.remote_args import SECRET_ENV
from conftest import prefix_layers

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.maintenance.salvage import salvage
from cas_bank.restore.spares import Spares

SPEC = ModelSpec(
    name="tools",
    layers=tuple(LayerSpec.attention(kv_heads=4, head_dim=256, dtype="float16") for _ in "ab"),
    weights_digest="w-tools",
)
TOKENS = [int(t) for t in np.arange(256) % 97]


def test_the_tools_config_holds_no_spares_nor_hot_tier() -> None:
    config = common._TOOL_CONFIG
    assert (config.spare_bytes, config.hot_bytes) == (0, 0)


def test_revoke_with_a_shared_tier_opens_the_bank_without_spares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "a fleet secret of the test")
    remote = "valkey://127.0.0.1:6379"
    args = build_parser().parse_args(["revoke", "BANK", "tenant", "--remote", remote])
    config = quota_cmd._revoke_config(args)
    assert config is not None and config.remote == remote
    assert (config.spare_bytes, config.hot_bytes) == (0, 0)


def test_salvage_makes_no_spares_of_the_bank_it_reads(
    bank_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bank whose last session restored (its spares' shapes recorded at close):
    salvage opens its copy without spares, so nothing is made ahead there."""
    with Bank.open(bank_path, BankConfig(block_size=64, hot_bytes=0)) as bank:
        ns = bank.namespace(SPEC)
        ns.store(TOKENS, prefix_layers(SPEC, TOKENS))
        assert ns.restore(TOKENS, room_for=300) is not None
        assert bank.resources.spares.wanted_recently()
    asked: list[int] = []
    make_ahead = Spares.make_ahead

    def counted(self: Spares, recorded: Any) -> int:
        asked.append(make_ahead(self, recorded))
        return asked[-1]

    monkeypatch.setattr(Spares, "make_ahead", counted)
    report = salvage(bank_path, tmp_path / "salvaged")
    assert report.blocks_copied == len(TOKENS) // 64
    assert not any(asked)
