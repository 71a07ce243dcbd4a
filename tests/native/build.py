"""Builds and runs tests/native/test_native.c for a CPU: this machine's, or another's
with a cross compiler under qemu-user (`make test-native`).

The sources and macros are setup.py's own (`blake3_build`), so the C test builds what
the package ships for that CPU. Targets:

- `host`: this machine's compiler, run directly;
- `aarch64`: Debian's `aarch64-linux-gnu-gcc` (static), run by `qemu-aarch64-static`
  (BLAKE3's NEON code);
- `x86_64-noavx2`: this machine's compiler on x86-64, run by `qemu-x86_64-static -cpu
  Nehalem` (SSE4.2, no AVX or AVX2: BLAKE3's run-time dispatch must pick its SSE4.1
  code), and `-cpu qemu64` (SSE2 only: the portable code).

Usage: python tests/native/build.py OUT_DIR [TARGET ...] (all by default). A target
whose tools are missing is skipped and named; `--require` makes that a failure.
Exit status 1 if a build or a run failed.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = ROOT / "tests" / "native" / "test_native.c"


def _setup() -> object:
    spec = importlib.util.spec_from_file_location("cas_bank_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() is not called
    return module


# target -> (compiler, machine setup.py builds for, how to run: [] directly)
TARGETS: dict[str, tuple[str, str, list[list[str]]]] = {
    "host": ("cc", platform.machine(), [[]]),
    "aarch64": ("aarch64-linux-gnu-gcc", "aarch64", [["qemu-aarch64-static"]]),
    # The host again, reading a file in runs of 16 KiB of one row each (an XXH3 run that
    # meets a second row ends there: the case's 22 KiB body in three runs, a blake3 one
    # in two): a head read with the first run, runs between, the size checked with the
    # last.
    "host-short-runs": ("cc", platform.machine(), [[]]),
    "x86_64-noavx2": (
        "cc",
        "x86_64",
        [["qemu-x86_64-static", "-cpu", "Nehalem"], ["qemu-x86_64-static", "-cpu", "qemu64"]],
    ),
}

EXTRA_FLAGS: dict[str, list[str]] = {"host-short-runs": ["-DSTAGE_BYTES=16384", "-DMAX_ROWS=1"]}


def build(target: str, out: Path) -> Path:
    cc, machine, _ = TARGETS[target]
    sources, macros = _setup().blake3_build(machine)  # type: ignore[attr-defined]
    flags = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in macros]
    flags += EXTRA_FLAGS.get(target, [])
    exe = out / f"test_native-{target}"
    cmd = [cc, "-std=gnu11", "-D_GNU_SOURCE", "-O2", "-Wall", "-static", *flags, str(TEST)]
    cmd += [str(ROOT / s) for s in sources] + ["-o", str(exe), "-lpthread"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return exe


def main(argv: list[str]) -> int:
    require = "--require" in argv
    args = [a for a in argv if a != "--require"]
    out = Path(args[0]).resolve()
    targets = args[1:] or list(TARGETS)
    out.mkdir(parents=True, exist_ok=True)
    case = out / "case"
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "native" / "make_cases.py"), str(case)], check=True
    )
    failed = 0
    for target in targets:
        cc, _, runners = TARGETS[target]
        missing = [t for t in [cc, *(r[0] for r in runners if r)] if shutil.which(t) is None]
        if target == "x86_64-noavx2" and platform.machine() != "x86_64":
            missing.append("an x86-64 machine")
        if missing:
            print(f"test-native {target}: SKIPPED, missing {', '.join(missing)}")
            failed += require
            continue
        try:
            exe = build(target, out)
        except subprocess.CalledProcessError:
            print(f"test-native {target}: BUILD FAILED")
            failed += 1
            continue
        for runner in runners:
            for check in sorted(p.name for p in case.iterdir()):
                run = subprocess.run(
                    [*runner, str(exe), str(case / check)], capture_output=True, text=True
                )
                how = " ".join(runner) or "directly"
                status = "ok" if run.returncode == 0 else f"FAILED ({run.returncode})"
                said = (run.stdout + run.stderr).strip()
                print(f"test-native {target} ({how}), {check} payload: {status}: {said}")
                failed += run.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
