"""The native chain-hash helper (cas_bank._chain); everything else is in pyproject.toml.

Built by `pip install -e .` with the system C compiler from the vendored, official
BLAKE3 C sources (cas_bank/_native/blake3, CC0): the portable code everywhere, plus
the SSE4.1 intrinsics on x86-64 (chosen at run time by BLAKE3's own CPU check).
If it cannot be built, cas_bank hashes in Python instead: the same values, ~1 us a
block slower.
"""

import platform

from setuptools import Extension, setup

B3 = "cas_bank/_native/blake3"
sources = ["cas_bank/_native/chain.c", f"{B3}/blake3.c", f"{B3}/blake3_dispatch.c"]
sources.append(f"{B3}/blake3_portable.c")
macros = [
    ("BLAKE3_NO_SSE2", None),
    ("BLAKE3_NO_AVX2", None),
    ("BLAKE3_NO_AVX512", None),
    ("BLAKE3_USE_NEON", "0"),
]
if platform.machine().lower() in ("x86_64", "amd64"):
    sources.append("cas_bank/_native/sse41.c")  # a block's two compressions: ~2x faster
else:
    macros.append(("BLAKE3_NO_SSE41", None))


setup(
    ext_modules=[
        Extension(
            "cas_bank._chain",
            sources=sources,
            define_macros=macros,
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
