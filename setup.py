"""The native helpers; everything else is in pyproject.toml.

- cas_bank._chain: the chain hashes of a prompt's blocks in one call;
- cas_bank._fill: a payload file read straight into destination arrays and verified.

Built by `pip install -e .` with the system C compiler from the vendored, official
BLAKE3 C sources (cas_bank/_native/blake3, CC0): the portable code everywhere, plus
the SSE4.1 intrinsics and the AVX2 assembly on x86-64 (chosen at run time by BLAKE3's own CPU
check). If they cannot be built, cas_bank does the same work in Python: the same
values, slower (~1 us a block for hashing; the read path copies once more).
"""

import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

B3 = "cas_bank/_native/blake3"
sources = [f"{B3}/blake3.c", f"{B3}/blake3_dispatch.c"]
sources.append(f"{B3}/blake3_portable.c")
macros = [
    ("BLAKE3_NO_SSE2", None),
    ("BLAKE3_NO_AVX512", None),
    ("BLAKE3_USE_NEON", "0"),
]
if platform.machine().lower() in ("x86_64", "amd64"):
    sources.append("cas_bank/_native/sse41.c")  # a block's two compressions: ~2x faster
    # Bulk payload hashing, 8 chunks at once: BLAKE3's own assembly (1.7x its AVX2
    # intrinsics measured here: 3.5 against 2.0 GB/s a core).
    sources.append(f"{B3}/blake3_avx2_x86-64_unix.S")
else:
    macros += [("BLAKE3_NO_SSE41", None), ("BLAKE3_NO_AVX2", None)]


class BuildExt(build_ext):
    """build_ext that hands `.S` sources to the C compiler (gcc and clang assemble them)."""

    def build_extension(self, ext: Extension) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions = [*self.compiler.src_extensions, ".S"]
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            f"cas_bank.{name}",
            sources=[f"cas_bank/_native/{main}.c", *sources],
            define_macros=macros,
            extra_compile_args=["-O3"],
            optional=True,
        )
        for name, main in (("_chain", "chain"), ("_fill", "fill"))
    ],
)
