"""Banks for the `cas-bank` tool tests, and a way to run the real CLI on them.

`build_bank` makes one real bank (RocksDB in a tmp dir, block size 4) holding three
namespaces:
- `tiny-attn` (attention only, `tokenizer="bytes"`): two unrelated text prompts;
- `tiny-hybrid` (GDN + attention, a tokenizer the tools do not load): one chain with
  states at two boundaries;
- `fleet` (attention only, `tokenizer="byte:512"`): four agents whose prompts share a
  3-block system prompt, two of them also a 4th block, so the prefix tree branches twice.
`cas_bank` runs the installed `cas-bank` console script in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from conftest import BLOCK_SIZE, attention_spec, hybrid_spec, random_array, random_state

from cas_bank import Bank, BankConfig, ModelSpec, Namespace

_SCRIPT = Path(sys.executable).with_name("cas-bank")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "cas_bank.tools.cli"]

TEXTS = ("the quick brown fox jumps over!", "lorem ipsum dolor sit amet ...")  # 31, 30 bytes
SYSTEM = list(range(100, 100 + 3 * BLOCK_SIZE))  # the fleet's shared system prompt


def attn_text_spec() -> ModelSpec:
    return attention_spec().model_copy(update={"tokenizer": "bytes"})


def fleet_spec() -> ModelSpec:
    """Recorded as the runtime records its byte tokenizer."""
    return attention_spec(name="fleet").model_copy(update={"tokenizer": "byte:512"})


def hybrid_text_spec() -> ModelSpec:
    """A tokenizer the tools do not load (a Hugging Face name)."""
    return hybrid_spec().model_copy(update={"tokenizer": "org/some-hf-tokenizer"})


def fleet_prompts() -> list[list[int]]:
    """Four agents: all share SYSTEM; agents 0 and 1 also share one more block."""
    shared_tool = [7] * BLOCK_SIZE
    return [
        SYSTEM + shared_tool + [1] * (2 * BLOCK_SIZE),
        SYSTEM + shared_tool + [2] * BLOCK_SIZE,
        SYSTEM + [3] * (2 * BLOCK_SIZE) + [9, 9],  # a partial tail, never stored
        SYSTEM + [4] * BLOCK_SIZE,
    ]


def chain_layers(ns: Namespace, tokens: list[int]) -> list[Any]:
    """Random KV where each block's part is seeded by its chain hash, as a real model's
    KV depends on the prefix only: prompts sharing blocks have identical KV there."""
    seeds = [np.frombuffer(h, dtype=np.uint64) for h in ns.chain(tokens)]
    seeds.append(np.array([len(tokens)], dtype=np.uint64))  # the partial tail, if any
    tail = len(tokens) % BLOCK_SIZE
    out: list[Any] = []
    for i, ls in enumerate(ns.spec.layers):
        if ls.kind == "recurrent":
            out.append(None)
            continue
        arrays = []
        for j, s in enumerate(ls.arrays):
            pieces = []
            for b, seed in enumerate(seeds):
                n = BLOCK_SIZE if b < len(seeds) - 1 else tail
                rng = np.random.default_rng([*seed.tolist(), i, j])
                pieces.append(random_array(s.with_tokens(n), s.dtype, rng))
            arrays.append(mx.concatenate(pieces, axis=-2))
        out.append(tuple(arrays))
    return out


@dataclass
class BuiltBank:
    path: Path
    chains: dict[str, list[bytes]] = field(default_factory=dict)  # name -> chain hashes
    prompts: dict[str, list[int]] = field(default_factory=dict)
    layers: dict[str, list[Any]] = field(default_factory=dict)  # what was stored
    states: dict[str, dict[int, list[Any]]] = field(default_factory=dict)


def build_bank(path: Path, check: str | None = None) -> BuiltBank:
    """The three-namespace bank described above (stored, closed); `check`: the payload
    check its records carry (None: a new bank's own)."""
    built = BuiltBank(path)
    with Bank.open(path, BankConfig(block_size=BLOCK_SIZE, payload_check=check)) as bank:  # type: ignore[arg-type]
        attn = bank.namespace(attn_text_spec())
        for i, text in enumerate(TEXTS):
            toks = list(text.encode())
            layers = chain_layers(attn, toks)
            name = f"text{i}"
            built.chains[name] = attn.store(toks, layers).chain
            built.prompts[name], built.layers[name] = toks, layers

        hyb = bank.namespace(hybrid_text_spec())
        toks = list(range(500, 500 + 5 * BLOCK_SIZE))
        layers = chain_layers(hyb, toks)
        states = {
            2 * BLOCK_SIZE: random_state(hyb.spec, 21),
            4 * BLOCK_SIZE: random_state(hyb.spec, 22),
        }
        built.chains["hybrid"] = hyb.store(toks, layers, states).chain
        built.prompts["hybrid"], built.layers["hybrid"], built.states["hybrid"] = (
            toks,
            layers,
            states,
        )

        fleet = bank.namespace(fleet_spec())
        for i, toks in enumerate(fleet_prompts()):
            layers = chain_layers(fleet, toks)
            name = f"agent{i}"
            built.chains[name] = fleet.store(toks, layers).chain
            built.prompts[name], built.layers[name] = toks, layers
    return built


def cas_bank(*args: str | Path, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `cas-bank ARGS...`; `check=True` asserts exit status 0."""
    proc = subprocess.run(
        [*CLI, *(str(a) for a in args)], capture_output=True, text=True, timeout=60
    )
    if check:
        assert proc.returncode == 0, f"cas-bank {args} -> {proc.returncode}: {proc.stderr}"
    return proc


def cas_bank_json(*args: str | Path) -> Any:
    """Run `cas-bank ARGS... --json` (expecting success) and parse its output."""
    proc = cas_bank(*args, "--json", check=True)
    return json.loads(proc.stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """A failed command: non-zero exit, nothing on stdout, one `cas-bank: error:` line."""
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cas-bank: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
