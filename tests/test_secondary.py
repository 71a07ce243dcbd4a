"""A secondary open (the tools' way to read beside a live writer) restores real-size
payloads. RocksDB crashes the process when a secondary instance reads BlobDB values,
so RocksStore reads payloads through a read-only instance: this test runs the reader
in a child process so that a regression fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
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


def test_a_reader_missing_a_payload_the_writer_evicted_counts_a_miss_not_damage(
    tmp_path: Path,
) -> None:
    """A reader beside a live writer sees headers as of its open: a payload the writer
    evicted since is a miss, never a corrupt read (nor a suspect block)."""
    from conftest import attention_spec, prefix_layers

    from cas_bank import Bank, BankConfig

    spec = attention_spec()
    a, b = list(range(1, 13)), list(range(100, 112))
    path = tmp_path / "bank"
    with Bank.open(path, BankConfig(block_size=4, file_min_bytes=0, max_bytes=3000)) as w:
        ns = w.namespace(spec)
        ns.store(a, prefix_layers(spec, a))
        w.flush()
        for mode in ("secondary", "read_only"):
            with Bank.open(path, mode=mode) as reader:
                assert reader.namespace(spec).match(a) == len(a)
                ns.store(b, prefix_layers(spec, b))  # over budget: a is evicted
                w.flush()
                assert ns.match(a) < len(a)  # leaf-first: its last blocks went
                hit = reader.namespace(spec).restore(a)
                assert hit is None or hit.tokens < len(a)
                assert reader.stats().corrupt_reads == 0
            ns.store(a, prefix_layers(spec, a))  # back for the next mode
            w.flush()


def test_a_walk_of_payloads_goes_on_across_a_refresh(tmp_path: Path) -> None:
    """A secondary walks payloads through its reader of blob files; a refresh that
    reopens that reader mid-walk leaves the walk going on after its last key (it
    ended quietly with the old reader), and a close mid-walk says the bank is closed."""
    from conftest import attention_spec, prefix_layers

    from cas_bank import Bank, BankConfig
    from cas_bank.blocks.store import Family

    spec, prompt = attention_spec(), list(range(1, 1201))  # 300 blocks: several steps
    path = tmp_path / "bank"
    with Bank.open(path, BankConfig(block_size=4, hot_bytes=0)) as w:
        w.namespace(spec).store(prompt, prefix_layers(spec, prompt))
        w.flush()
        keys = list(w.store.keys(Family.BLOCKS))
        assert len(keys) == 300
        with Bank.open(path, BankConfig(hot_bytes=0), mode="secondary") as reader:
            walk = reader.store.keys(Family.BLOCKS)
            first = next(walk)
            reader.refresh()
            assert [first, *walk] == keys
            walk = reader.store.keys(Family.BLOCKS)
            next(walk)
        with pytest.raises(RuntimeError, match="closed"):
            list(walk)
