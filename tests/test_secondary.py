"""A secondary open (the tools' way to read beside a live writer) restores real-size
payloads. RocksDB crashes the process when a secondary instance reads BlobDB values,
so RocksStore reads payloads through a read-only instance: this test runs the reader
in a child process so that a regression fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from conftest import PYTHON, TESTS_DIR

CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import mlx.core as mx, numpy as np
    from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec

    spec = ModelSpec(name="big", layers=(LayerSpec.attention(4, 64, "float16"),),
                     weights_digest="w")
    rng = np.random.default_rng(0)
    kv = lambda: mx.array(rng.standard_normal((1, 4, 256, 64)).astype(np.float16))
    keys, values = kv(), kv()
    tokens = list(range(256))
    writer = Bank.open({path!r}, BankConfig(block_size=64, hot_bytes=0))
    writer.namespace(spec).store(tokens[:128], [(keys, values)])
    writer.store.flush()  # payloads now live in blob files (>= 4 KiB each)

    reader = Bank.open({path!r}, BankConfig(hot_bytes=0), mode="secondary")
    hit = reader.namespace(spec).restore(tokens)
    assert hit is not None and hit.tokens == 128, hit
    assert mx.array_equal(hit.layers[0][0], keys[..., :128, :]).item()

    writer.namespace(spec).store(tokens, [(keys, values)])
    writer.store.flush()
    assert reader.namespace(spec).restore(tokens).tokens == 128  # not caught up yet
    reader.refresh()
    hit = reader.namespace(spec).restore(tokens)
    assert hit.tokens == 256 and mx.array_equal(hit.layers[0][1], values).item()
    assert reader.stats().corrupt_reads == 0
    reader.close(); writer.close()
    print("ok")
    """
)


def test_a_secondary_bank_restores_blob_payloads_and_follows_the_writer(tmp_path: Path) -> None:
    code = CHILD.format(tests=str(TESTS_DIR), path=str(tmp_path / "bank"))
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().endswith("ok")
