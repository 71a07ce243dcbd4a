"""The native helpers; everything else is in pyproject.toml.

- cas_bank._chain: the chain hashes of a prompt's blocks in one call;
- cas_bank._fill: a payload file read straight into destination arrays and verified.

Built by `pip install` (a wheel, an sdist or `-e .`) with the system C compiler from the
vendored, official BLAKE3 C sources (cas_bank/_native/blake3, CC0): the portable code
everywhere; on x86-64 the SSE4.1 intrinsics and the AVX2 assembly, chosen at run
time by BLAKE3's own CPU check; on arm64 (Apple silicon, aarch64 Linux) the NEON
intrinsics. If they cannot be built (no C compiler), the
install still succeeds and cas_bank does the same work in Python: the same values,
slower (~1 us a block for hashing; the read path copies once more). That is said
loudly here and at run time (`cas-bank --version`, `cas_bank.native`).
`CAS_BANK_REQUIRE_NATIVE=1` makes a failed build an error instead (CI's wheel build).
What the C code needs of the platform: docs/design.md, "Native helpers".
"""

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "cas_bank/_native"
B3 = f"{NATIVE}/blake3"
# The extensions (module name, its C source in NATIVE) and the flags they build with on
# every platform (tests/native/macos.py compiles them with these for macOS).
EXTENSIONS = (("_chain", "chain"), ("_fill", "fill"))
COMPILE_ARGS = ["-O3"]


def blake3_build(machine: str) -> tuple[list[str], list[tuple[str, str | None]]]:
    """BLAKE3's sources and macros for a CPU (`platform.machine()`'s name)."""
    sources = [f"{B3}/blake3.c", f"{B3}/blake3_dispatch.c", f"{B3}/blake3_portable.c"]
    macros: list[tuple[str, str | None]] = [("BLAKE3_NO_SSE2", None), ("BLAKE3_NO_AVX512", None)]
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        sources.append(f"{NATIVE}/sse41.c")  # a block's two compressions: ~2x faster
        # Bulk payload hashing, 8 chunks at once: BLAKE3's own assembly (1.7x its AVX2
        # intrinsics measured here: 3.5 against 2.0 GB/s a core).
        sources.append(f"{B3}/blake3_avx2_x86-64_unix.S")
        macros.append(("BLAKE3_USE_NEON", "0"))
    elif machine in ("arm64", "aarch64"):
        # NEON is part of every arm64 CPU (Apple silicon, aarch64 Linux): BLAKE3's NEON
        # code hashes 4 chunks at once.
        sources.append(f"{B3}/blake3_neon.c")
        macros += [("BLAKE3_USE_NEON", "1"), ("BLAKE3_NO_SSE41", None), ("BLAKE3_NO_AVX2", None)]
    else:
        macros += [("BLAKE3_USE_NEON", "0"), ("BLAKE3_NO_SSE41", None), ("BLAKE3_NO_AVX2", None)]
    return sources, macros


def target_machine() -> str:
    """The CPU the extensions are built for: macOS's ARCHFLAGS (a cross build on a Mac,
    `-arch arm64`) or this machine's."""
    arch = os.environ.get("ARCHFLAGS", "").split()
    if sys.platform == "darwin" and len(arch) == 2 and arch[0] == "-arch":
        return arch[1]
    return platform.machine()


class BuildExt(build_ext):
    """build_ext that hands `.S` sources to the C compiler (gcc and clang assemble them)
    and says loudly when a helper cannot be built."""

    def build_extension(self, ext: Extension) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions = [*self.compiler.src_extensions, ".S"]
        try:
            super().build_extension(ext)
        except Exception as e:
            if os.environ.get("CAS_BANK_REQUIRE_NATIVE", "") not in ("", "0"):
                raise
            print(
                f"\n*** cas_bank: the native helper {ext.name} was NOT built ({e}).\n"
                "*** cas_bank works without it, slower: install a C compiler and reinstall.\n",
                file=sys.stderr,
            )
            raise


def main() -> None:
    sources, macros = blake3_build(target_machine())
    required = os.environ.get("CAS_BANK_REQUIRE_NATIVE", "") not in ("", "0")
    setup(
        cmdclass={"build_ext": BuildExt},
        ext_modules=[
            Extension(
                f"cas_bank.{name}",
                sources=[f"{NATIVE}/{source}.c", *sources],
                depends=[f"{B3}/blake3.h", f"{B3}/blake3_impl.h", f"{NATIVE}/pair.h"],
                define_macros=macros,
                extra_compile_args=COMPILE_ARGS,
                optional=not required,
            )
            for name, source in EXTENSIONS
        ],
    )


# tests/native/build.py and macos.py import this file for `blake3_build` and the
# extensions (setuptools runs it as __main__).
if __name__ == "__main__":
    main()
