"""The bank across processes: reopen in another process, SIGKILL during stores, and a
directory held by another writer process.

Children are real python processes that import cas_bank and this directory's
conftest (through PYTHONPATH, see `conftest.child_env`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import blake3
from conftest import (
    attention_spec,
    bits,
    check_every_block,
    child_env,
    flat_arrays,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    quantized_spec,
    random_state,
)

from cas_bank import Bank, BankConfig, BankLockedError, LayerSpec, ModelSpec
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header

B = 4


def run_child(code: str, *args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- store in one process, restore in another -------------------------------------
CASES = """
import numpy as np
from conftest import attention_spec, quantized_spec, hybrid_spec, prefix_layers, random_state

def cases():
    rng = np.random.default_rng(42)
    out = {}
    for name, spec in [("fp32", attention_spec("float32")), ("fp16", attention_spec("float16")),
                       ("bf16", attention_spec("bfloat16")), ("quant", quantized_spec()),
                       ("hybrid", hybrid_spec())]:
        tokens = [int(t) for t in rng.integers(0, 2**32, 3 * 4 + 2, dtype=np.uint64)]
        states = {8: random_state(spec, 8)} if spec.is_hybrid else None
        out[name] = (spec, tokens, states)
    return out
"""

STORE_CHILD = (
    CASES
    + """
import sys
from cas_bank import Bank, BankConfig
with Bank.open(sys.argv[1], BankConfig(block_size=4)) as bank:
    for name, (spec, tokens, states) in cases().items():
        bank.namespace(spec).store(tokens, prefix_layers(spec, tokens, pad=5), states)
"""
)

RESTORE_CHILD = (
    CASES
    + """
import json, sys
import blake3
from conftest import bits, flat_arrays
from cas_bank import Bank
out = {}
with Bank.open(sys.argv[1], mode=sys.argv[2]) as bank:
    for name, (spec, tokens, _) in cases().items():
        hit = bank.namespace(spec).restore(tokens)
        out[name] = [hit.tokens] + [
            blake3.blake3(bits(a)).hexdigest() for layer in hit.layers for a in flat_arrays(layer)
        ]
print(json.dumps(out))
"""
)


def _expected(name: str) -> list[Any]:
    """What the restore child must print, computed here from the same seeds."""
    import numpy as np

    rng = np.random.default_rng(42)
    specs = {
        "fp32": attention_spec("float32"),
        "fp16": attention_spec("float16"),
        "bf16": attention_spec("bfloat16"),
        "quant": quantized_spec(),
        "hybrid": hybrid_spec(),
    }
    for n, spec in specs.items():
        tokens = [int(t) for t in rng.integers(0, 2**32, 3 * 4 + 2, dtype=np.uint64)]
        if n != name:
            continue
        n_tok = 8 if spec.is_hybrid else 12
        layers = prefix_layers(spec, tokens)
        state = random_state(spec, 8) if spec.is_hybrid else None
        digests = []
        for i, ls in enumerate(spec.layers):
            src = state[i] if ls.kind == "recurrent" else layers[i]
            for a in flat_arrays(src):
                cut = a if ls.kind == "recurrent" else a[..., :n_tok, :]
                digests.append(blake3.blake3(bits(cut)).hexdigest())
        return [n_tok, *digests]
    raise KeyError(name)


def test_store_in_one_process_restore_in_another(bank_path: Path) -> None:
    run_child(STORE_CHILD, str(bank_path))
    for mode in ("read_write", "read_only"):
        got = json.loads(run_child(RESTORE_CHILD, str(bank_path), mode))
        assert set(got) == {"fp32", "fp16", "bf16", "quant", "hybrid"}
        for name, digests in got.items():
            assert digests == _expected(name), (mode, name)


# -- SIGKILL in the middle of stores ----------------------------------------------
def big_spec() -> ModelSpec:
    """Blocks of 16 tokens x 4 layers x 8 heads x 128 dims, fp16: 256 KiB each."""
    return ModelSpec(
        name="kill-test",
        layers=tuple(LayerSpec.attention(8, 128, "float16") for _ in range(4)),
        weights_digest="w-kill",
    )


KILL_BLOCK = 16

STORE_LOOP_CHILD = """
import sys
import numpy as np
from test_bank_process import big_spec, kill_prompt, KILL_BLOCK
from conftest import prefix_layers
from cas_bank import Bank, BankConfig
path, start, durability = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = big_spec()
config = BankConfig(block_size=KILL_BLOCK, durability=durability)
if start == 0:  # a first session that ends cleanly: its stores are on disk in any mode
    with Bank.open(path, config) as bank:
        for i in range(3):
            tokens = kill_prompt(-1 - i)
            bank.namespace(spec).store(tokens, prefix_layers(spec, tokens))
with Bank.open(path, config) as bank:
    ns = bank.namespace(spec)
    i = start
    while True:
        tokens = kill_prompt(i)
        ns.store(tokens, prefix_layers(spec, tokens))
        print(i, flush=True)  # acknowledged: the store returned
        i += 1
"""


def kill_prompt(i: int) -> list[int]:
    """Prompt i of the kill test: one of three shared prefixes, then its own tokens."""
    rng = random.Random(i)
    shared = random.Random(i % 3).choices(range(50_000), k=2 * KILL_BLOCK)
    return shared + rng.choices(range(50_000), k=rng.randint(0, 4 * KILL_BLOCK))


def check_consistent(bank: Bank) -> int:
    """Every block verifies, and the counters (written in the same batches) agree."""
    n = check_every_block(bank.store)
    headers = [Header.decode(k, v) for k, v in bank.store.iterate(Family.HEADERS)]
    s = bank.stats()
    assert s.blocks == n
    assert s.payload_bytes == sum(h.payload_size for h in headers)
    assert s.blocks_written == n
    return n


def kill_rounds(bank_path: Path, durability: str, rounds: int, seed: int) -> list[int]:
    """Start a storing child, SIGKILL it at a random time, reopen and check; repeat."""
    chooser = random.Random(seed)
    acked: list[int] = []
    start = 0
    for _ in range(rounds):
        code = textwrap.dedent(STORE_LOOP_CHILD)
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(bank_path), str(start), durability],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        first = child.stdout.readline()  # wait until it stores: kill mid-loop, not at import
        assert first.strip(), child.stderr.read() if child.stderr else ""
        time.sleep(chooser.uniform(0.0, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        done = [int(line) for line in (first + out).split()]
        acked += done
        start = done[-1] + 1
        with Bank.open(bank_path, BankConfig(block_size=KILL_BLOCK)) as bank:
            assert check_consistent(bank) > 0
    return acked


def test_sigkill_during_stores_leaves_a_verified_bank(bank_path: Path) -> None:
    acked = kill_rounds(bank_path, "wal", rounds=4, seed=1)
    spec = big_spec()
    with Bank.open(bank_path) as bank:
        ns = bank.namespace(spec)
        # With the WAL, every store that returned survived the kill, bit for bit.
        for i in acked[-3:] + acked[:2]:
            tokens = kill_prompt(i)
            hit = ns.restore(tokens)
            full = len(tokens) // KILL_BLOCK * KILL_BLOCK
            assert hit is not None and hit.tokens == full
            want = kv_prefix_bits(prefix_layers(spec, tokens), spec, full)
            assert layers_bits(hit.layers, spec) == want
        for i in acked:
            tokens = kill_prompt(i)
            assert ns.match(tokens) == len(tokens) // KILL_BLOCK * KILL_BLOCK
        assert bank.stats().corrupt_reads == 0


def test_sigkill_without_wal_loses_stores_never_consistency(bank_path: Path) -> None:
    """Without the WAL a kill may lose stores since the last flush, never half of one;
    the first session's stores, flushed by its clean close, are all there."""
    kill_rounds(bank_path, "fast", rounds=2, seed=2)
    spec = big_spec()
    with Bank.open(bank_path) as bank:
        for i in range(3):
            tokens = kill_prompt(-1 - i)
            assert bank.namespace(spec).match(tokens) == len(tokens) // KILL_BLOCK * KILL_BLOCK


# -- a directory held by another writer process -----------------------------------
HOLDER_CHILD = """
import sys
from conftest import attention_spec, prefix_layers
from cas_bank import Bank, BankConfig
spec = attention_spec()
with Bank.open(sys.argv[1], BankConfig(block_size=4)) as bank:
    ns = bank.namespace(spec)
    first = list(range(8))
    ns.store(first, prefix_layers(spec, first))
    print("held", flush=True)
    sys.stdin.readline()
    second = list(range(100, 112))
    ns.store(second, prefix_layers(spec, second))
    print("stored", flush=True)
    sys.stdin.readline()
"""


def test_a_bank_held_by_another_writer(bank_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER_CHILD), str(bank_path)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    spec = attention_spec()
    try:
        assert holder.stdout.readline().strip() == "held"
        with Bank.open(bank_path, mode="read_only") as frozen:
            before = {f: list(frozen.store.iterate(f)) for f in Family}
        try:
            Bank.open(bank_path, BankConfig(block_size=B))
        except BankLockedError as e:
            assert f"bank at {bank_path} is held by another writer process" in str(e)
        else:
            raise AssertionError("a second writer was let in")
        with (
            Bank.open(bank_path, mode="read_only") as frozen,
            Bank.open(bank_path, mode="secondary") as follower,
        ):
            assert {f: list(frozen.store.iterate(f)) for f in Family} == before
            hit = frozen.namespace(spec).restore(list(range(8)))
            assert hit is not None and hit.tokens == 8
            want = kv_prefix_bits(prefix_layers(spec, list(range(8))), spec, 8)
            assert layers_bits(hit.layers, spec) == want
            holder.stdin.write("go\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "stored"
            second = list(range(100, 112))
            assert follower.namespace(spec).match(second) == 0
            follower.refresh()
            hit = follower.namespace(spec).restore(second)
            assert hit is not None and hit.tokens == 12
            assert frozen.namespace(spec).match(second) == 0  # frozen at its open
    finally:
        if holder.poll() is None:
            holder.stdin.write("done\n")
            holder.stdin.flush()
        holder.wait(timeout=30)
    assert holder.returncode == 0, holder.stderr.read() if holder.stderr else ""
    with Bank.open(bank_path) as bank:  # the writer is gone: the lock is free
        assert check_consistent(bank) == 5
