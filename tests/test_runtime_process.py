"""Restart: blocks and states stored by one process restore in a fresh process, with
the model rebuilt from the same seed, to bit-identical logits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
from cas_bank.runtime import PrefixCache
from runtime_helpers import bit_equal, random_tokens, same_schedule_logits, tiny

from cas_bank import Bank, BankConfig

MODELS = ("tiny-hybrid", "tiny-qwen3")

# The child: reopen the bank, rebuild each model from its seed, restore the longer
# prompt, prefill the rest, write the logits and what was restored.
CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from cas_bank import Bank
    from cas_bank.runtime import PrefixCache, build_model

    bank_dir, out_dir, prompt_json, names = sys.argv[1:5]
    prompt = json.loads(prompt_json)
    result = {}
    with Bank.open(bank_dir) as bank:
        for name in names.split(','):
            pc = PrefixCache(bank, build_model(name, seed=3), chunk_size=32)
            cache, n = pc.restore(prompt)
            logits = pc.prefill(prompt, cache, n)
            np.save(f"{out_dir}/{name}.npy", np.array(logits))
            result[name] = {"restored": n, "ends": pc.last_prefill.chunk_ends}
    print(json.dumps(result))
    """
)


def test_blocks_stored_by_one_process_restore_in_a_fresh_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    first = random_tokens(rng, 90)
    second = [*first, *random_tokens(rng, 25)]
    bank_dir = tmp_path / "bank"
    stored_ends = {}
    with Bank.open(bank_dir, BankConfig(block_size=16)) as bank:
        for name in MODELS:
            pc = PrefixCache(bank, tiny(name, seed=3), chunk_size=32)
            pc.prefill(first, pc.new_cache())
            assert pc.last_prefill is not None
            stored_ends[name] = pc.last_prefill.chunk_ends
        pcs = {name: PrefixCache(bank, tiny(name, seed=3), chunk_size=32) for name in MODELS}

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            str(bank_dir),
            str(tmp_path),
            json.dumps(second),
            ",".join(MODELS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for name in MODELS:
        n = result[name]["restored"]
        assert n == len(first)  # the first prompt's end record: all of it
        child_logits = mx.array(np.load(tmp_path / f"{name}.npy"))
        pc = pcs[name]
        reference = same_schedule_logits(
            pc, first, stored_ends[name], second, n, result[name]["ends"]
        )
        assert bit_equal(child_logits, reference), name
