"""The demo runs to the end, with a small fleet, and its numbers say what it claims.

Once in this process (`run_demo`, checking the report) and once as the command a
user runs (`cas-bank demo`, checking the printed tables).
"""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
from pathlib import Path

from cas_bank.runtime.demo import report_tables, run_demo, system_prompt
from rich.console import Console

from cas_bank import Bank

BLOCK = 32


def test_the_demo_restores_shared_prompts_and_conversations_across_a_restart(
    tmp_path: Path,
) -> None:
    steps: list[str] = []
    bank_dir = tmp_path / "bank"
    report = run_demo(
        2, 2, max_tokens=8, block_size=BLOCK, bank_dir=bank_dir, progress=steps.append
    )

    assert len(steps) == 2 * 3 + 2  # requests, then snapshot measurements
    assert [(r.phase, r.agent, r.turn) for r in report.rows] == [
        ("before restart", 0, 1),
        ("before restart", 1, 1),
        ("before restart", 0, 2),
        ("before restart", 1, 2),
        ("after restart", 0, 3),
        ("after restart", 1, 3),
    ]
    assert report.system_prompt_tokens == len(system_prompt().encode()) >= 1000
    assert report.rows[0].cached_tokens == 0  # a fresh bank
    by_agent = {a: [r for r in report.rows if r.agent == a] for a in (0, 1)}
    for rows in by_agent.values():
        for before, after in itertools.pairwise(rows):
            # Each turn restores at least the previous turn's prompt (its full blocks,
            # but the last token's), also across the restart.
            assert after.cached_tokens >= (before.prompt_tokens - 1) // BLOCK * BLOCK
            assert after.prompt_tokens > before.prompt_tokens
    assert 0.5 < report.hit_rate < 1.0
    assert report.rows[0].ttft_s > 0
    # One copy of the shared system prompt against one per session.
    assert 0 < report.bank_stored_bytes < report.snapshot_bytes
    assert report.bank_disk_bytes > 0
    assert report.snapshot_tokens > 2 * report.system_prompt_tokens

    # The bank given with bank_dir is kept, closed, with what the report counted.
    with Bank.open(bank_dir) as bank:
        stats = bank.stats()
    assert stats.payload_bytes + stats.state_bytes == report.bank_stored_bytes

    out = io.StringIO()
    console = Console(file=out, width=200)
    for table in report_tables(report):
        console.print(table)
    text = out.getvalue()
    assert "after restart" in text and "hit rate" in text and "save_prompt_cache" in text


def test_cas_bank_demo_prints_the_tables(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "cas_bank.tools.cli", "demo", "--agents", "1", "--turns", "1"]
    cmd += ["--max-tokens", "2", "--block-size", str(BLOCK)]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the demo's temporary bank goes
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    for expected in ("prompt", "cached", "prefilled", "TTFT ms", "after restart", "hit rate"):
        assert expected in done.stdout, done.stdout
    # Without --bank the bank is temporary, and removed (MLX keeps its own "mlx" dir there).
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("cas_bank")] == []
