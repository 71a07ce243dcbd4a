"""Writes the payload case that tests/native/test_native.c fills, with the package's own
codec and file reader (so the C test follows their format): a payload file of two
arrays as `codec.encode` writes it, the head `restore.file_read` expects of it, and the
rows the fill must produce.

Usage: python tests/native/make_cases.py OUT_DIR. Writes, for each payload check
(OUT_DIR/xxh3, OUT_DIR/blake3), case.txt (one line:
lead size, head size, then each array's bytes a block; then the digest's context),
payload.bin, head.bin and
rows.bin (each array's block bytes, in order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from cas_bank.arrays import DTYPES
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import PAYLOAD_CONTEXT, Check
from cas_bank.restore import file_read

CHECKS: tuple[Check, ...] = ("xxh3", "blake3")


def main(out: Path, check: Check) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    # Rows of different sizes (as quantized KV has); 16 tokens a block; 22 KiB in all, so
    # a run of the short-runs build (16 KiB) and the segment boundaries inside one are met.
    shapes = [(1, 4, 16, 128), (1, 4, 16, 40), (1, 2, 16, 8)]
    dtypes = [DTYPES["bfloat16"], DTYPES["float16"], DTYPES["float32"]]
    arrays = [
        rng.integers(0, 1 << 16, s, dtype=np.uint16).view(d.storage)
        if d.storage.itemsize == 2
        else rng.standard_normal(s).astype(d.storage)
        for s, d in zip(shapes, dtypes, strict=True)
    ]
    payload = codec.encode(arrays, dtypes, "none", check)
    digest = codec.embedded_digest(payload)
    reader = file_read.BlockFiles(
        [np.zeros((*s[:-2], 32, s[-1]), d.storage) for s, d in zip(shapes, dtypes, strict=True)],
        shapes,
        dtypes,
        16,
    )
    head = reader._head(digest)
    (out / "payload.bin").write_bytes(payload)
    (out / "head.bin").write_bytes(head)
    (out / "rows.bin").write_bytes(b"".join(a.tobytes() for a in arrays))
    sizes = " ".join(str(a.nbytes) for a in arrays)
    (out / "case.txt").write_text(f"{codec.LEAD.size} {len(head)} {sizes}\n{PAYLOAD_CONTEXT}\n")


if __name__ == "__main__":
    for kind in CHECKS:  # new banks' XXH3-128, and blake3 as banks before format 4
        main(Path(sys.argv[1]) / kind, kind)
