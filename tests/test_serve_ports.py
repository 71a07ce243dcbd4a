"""`--port` out of range is one line naming the range, for both servers, before any
bank is opened (it was an OverflowError from the socket)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("command", "port"),
    [("serve", "99999"), ("serve", "http"), ("mlx-lm-server", "99999"), ("mlx-lm-server", "-1")],
)
def test_a_port_out_of_range_is_one_line(tmp_path: Path, command: str, port: str) -> None:
    bank = tmp_path / "bank"
    argv = [sys.executable, "-m", "cas_bank.tools.cli", command, "--bank", str(bank)]
    argv += ["--model", "tiny-qwen3"] if command == "mlx-lm-server" else []
    r = subprocess.run([*argv, "--port", port], capture_output=True, text=True, timeout=120)
    assert r.returncode in (1, 2), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cas-bank: error: argument --port:"), r.stderr
    assert ("0 (a free one) to 65535" if port != "http" else "not a port number") in lines[0]
    assert "Traceback" not in r.stderr and not bank.exists()
