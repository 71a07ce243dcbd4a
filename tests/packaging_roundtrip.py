"""A store/restore round trip as a user of the installed package runs it (no tests/ on
the path, no checkout): run by tests/test_packaging.py in a fresh virtualenv.

Usage: python packaging_roundtrip.py BANK_DIR {native|python|any}. Prints one JSON line:
where cas_bank came from, which helpers are loaded, which modules of the runtime were
imported. Exit status 1 on a restore that is not bit-exact.
"""

from __future__ import annotations

import json
import logging
import sys

import mlx.core as mx
import numpy as np

import cas_bank
from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec, native
from cas_bank.restore import file_read

RUNTIME_MODULES = ("fastapi", "uvicorn", "mlx_lm", "rich")


def main(bank_dir: str, want: str) -> int:
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cas_bank").addHandler(handler)
    spec = ModelSpec(
        name="pkg",
        layers=tuple(LayerSpec.attention(kv_heads=2, head_dim=64, dtype="bfloat16") for _ in "ab"),
        weights_digest="w-pkg",
    )
    rng = np.random.default_rng(7)
    n = 256  # 4 blocks of 64 tokens: 64 KiB payloads, read through the file tier
    layers = [
        tuple(
            mx.array(rng.integers(0, 1 << 16, (1, 2, n, 64), dtype=np.uint16)).view(mx.bfloat16)
            for _ in "kv"
        )
        for _ in spec.layers
    ]
    tokens = rng.integers(0, 50_000, n).tolist()
    config = BankConfig(block_size=64, file_min_bytes=16 * 1024)
    with Bank.open(bank_dir, config) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, layers)
    with Bank.open(bank_dir, config) as bank:  # reopened: payloads come from the files
        hit = bank.namespace(spec).restore(tokens)
    ok = hit is not None and hit.tokens == n
    for want_layer, got_layer in zip(layers, hit.layers if hit else [], strict=False):
        for a, b in zip(want_layer, got_layer, strict=True):
            ok = (
                ok
                and np.asarray(a.view(mx.uint16)).tobytes()
                == np.asarray(b[..., :n, :].view(mx.uint16)).tobytes()
            )
    s = native.status()
    print(
        json.dumps(
            {
                "file": cas_bank.__file__,
                "version": cas_bank.__version__,
                "loaded": list(s.loaded),
                "missing": s.missing,
                "native_reader": file_read._read_into is not None,
                "runtime_imported": [m for m in RUNTIME_MODULES if sys.modules.get(m) is not None],
                "warnings": warnings,
                "exact": ok,
            }
        )
    )
    expected = {"native": s.complete, "python": not s.loaded}.get(want, True)  # or "any"
    return 0 if ok and expected else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
