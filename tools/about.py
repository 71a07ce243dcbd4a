"""`cas-bank --version`: the package's version, whether the native helpers are loaded
(else the slower Python paths run: `cas_bank.native`), and MLX's version and device."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

import mlx.core as mx

from cas_bank import __version__, native
from cas_bank.arrays import cpu_fillable, mlx_backend


def version_text() -> str:
    device = mx.default_device()
    fill = "in place" if cpu_fillable() else "through a copy (mx.array)"
    return "\n".join(
        [
            f"cas-bank {__version__}",
            native.status().summary(),
            f"mlx {getattr(mx, '__version__', '?')}, device {device} ({mlx_backend()}): "
            f"restores fill its arrays {fill}",
            f"python {platform.python_version()} on {sys.platform} {platform.machine()}",
        ]
    )


class VersionAction(argparse.Action):
    """Prints `version_text()` and exits, before any command is required."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=kw.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_text())
        parser.exit()
