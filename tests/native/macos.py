"""Compiles the native helpers for macOS, arm64 and x86-64, against macOS's headers
(`make test-macos`; CI runs it): compile only, nothing is linked or run.

The compiler is zig's clang (`python -m ziglang cc`, the `ziglang` package of the dev
extra), which carries macOS's libc headers; each extension's sources, macros and flags
are setup.py's own (`EXTENSIONS`, `COMPILE_ARGS`, `blake3_build` for `arm64` and
`x86_64`), so the check compiles what a Mac's `pip install` compiles: on arm64
BLAKE3's NEON code (refused here if setup.py ever stops turning it on), on x86-64 the
SSE4.1 intrinsics and the AVX2 assembly. Python's headers are this machine's (no
macOS Python is at hand): the check is of the C against macOS's system headers.

Usage: python tests/native/macos.py OUT_DIR. Exit status 1, naming each source and
target that did not compile and showing the compiler's errors, if any did not.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# zig's target -> the machine name setup.py's blake3_build takes on a Mac.
TARGETS = {"aarch64-macos": "arm64", "x86_64-macos": "x86_64"}
ZIG_CC = [sys.executable, "-m", "ziglang", "cc"]


def _build_script() -> Any:
    """tests/native/build.py (its `_setup` loads setup.py without running it)."""
    spec = importlib.util.spec_from_file_location("cas_bank_native_build", HERE / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commands(setup: Any, target: str, out: Path) -> list[tuple[str, list[str]]]:
    """(source, compile command) for every source of every extension, for `target`."""
    sources, macros = setup.blake3_build(TARGETS[target])
    if TARGETS[target] == "arm64" and ("BLAKE3_USE_NEON", "1") not in macros:
        raise SystemExit(f"test-macos {target}: setup.py no longer builds BLAKE3's NEON code")
    flags = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in macros]
    flags += [*setup.COMPILE_ARGS, "-Wall", "-I", sysconfig.get_paths()["include"]]
    result = []
    for name, main_source in setup.EXTENSIONS:
        for source in [f"{setup.NATIVE}/{main_source}.c", *sources]:
            obj = out / target / name / (Path(source).name + ".o")
            obj.parent.mkdir(parents=True, exist_ok=True)
            cmd = [*ZIG_CC, "-target", target, "-c", *flags, source, "-o", str(obj)]
            result.append((source, cmd))
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/native/macos.py OUT_DIR", file=sys.stderr)
        return 2
    if importlib.util.find_spec("ziglang") is None:
        print("test-macos: FAILED: the ziglang package is missing (pip install -e '.[dev]')")
        return 1
    out = Path(argv[0]).resolve()
    setup = _build_script()._setup()
    failed = 0
    for target in TARGETS:
        for source, cmd in commands(setup, target, out):
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            said = (run.stdout + run.stderr).strip()
            if run.returncode != 0:
                print(f"test-macos {target}, {source}: COMPILE FAILED\n  {' '.join(cmd)}")
                print(said)
                failed += 1
            else:
                print(f"test-macos {target}, {source}: ok" + (f"\n{said}" if said else ""))
    if failed:
        print(f"test-macos: {failed} compiles FAILED for macOS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
