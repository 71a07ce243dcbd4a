"""One host of the several-hosts test, run as its own process (`python remote_host.py
ROLE BANK URL`): `store-N,M` stores agents N and M's prompts (plain and hybrid) and the
end records of their next prompts (`asked`: the prompt and a partial block more, with
logits) and publishes them; `restore` restores every agent's prompts and next prompts
from an empty bank. It prints a JSON line: digests of what it restored and, per stored
block, its payload and state sizes, and the sizes of its end records.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import blake3
from conftest import bits, flat_arrays, prefix_layers, random_state, remote_config

from cas_bank import Bank, LayerSpec, ModelSpec
from cas_bank.blocks.store import Family
from cas_bank.index.chain import Header

BLOCK = 16
SYSTEM_BLOCKS, OWN_BLOCKS, AGENTS = 4, 2, 3


def plain_spec() -> ModelSpec:
    att = LayerSpec.attention(kv_heads=4, head_dim=64, dtype="float16")
    return ModelSpec(name="hosts-plain", layers=(att, att), weights_digest="w-hosts-plain")


def hybrid_spec() -> ModelSpec:
    gdn = LayerSpec.recurrent([((1, 3, 256), "bfloat16"), ((1, 4, 32, 32), "float32")])
    att = LayerSpec.attention(kv_heads=4, head_dim=64, dtype="bfloat16")
    return ModelSpec(name="hosts-hybrid", layers=(gdn, att), weights_digest="w-hosts-hybrid")


def prompt(agent: int) -> list[int]:
    system = [(7 * t) % 997 for t in range(SYSTEM_BLOCKS * BLOCK)]
    own = [(agent * 131 + 3 * t) % 991 for t in range(OWN_BLOCKS * BLOCK)]
    return system + own


def asked(agent: int) -> list[int]:
    """The agent's prompt and a partial block more: an end record's prompt."""
    return [*prompt(agent), *[(agent * 17 + t) % 977 for t in range(BLOCK // 2 + agent)]]


def end_logits(agent: int) -> Any:
    import mlx.core as mx
    import numpy as np

    return mx.array(np.random.default_rng(500 + agent).standard_normal(64).astype(np.float32))


def end_state(agent: int) -> list[Any]:
    return random_state(hybrid_spec(), 2000 + agent)


def state_at(agent: int, boundary: int) -> list[Any]:
    seed = boundary if boundary == SYSTEM_BLOCKS * BLOCK else 1000 + agent
    return random_state(hybrid_spec(), seed)


def digest(arrays: list[Any]) -> str:
    h = blake3.blake3()
    for layer in arrays:
        if layer is not None:
            for a in flat_arrays(layer):
                h.update(bits(a))
    return h.hexdigest()


def main(role: str, bank_dir: str, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"restored": {}, "exact": {}, "blocks": {}}
    with Bank.open(bank_dir, remote_config(url, block_size=BLOCK)) as bank:
        if role.startswith("store-"):
            for agent in map(int, role.split("-")[1].split(",")):
                toks = prompt(agent)
                bank.namespace(plain_spec()).store(toks, prefix_layers(plain_spec(), toks))
                ends = (SYSTEM_BLOCKS * BLOCK, len(toks))
                states = {b: state_at(agent, b) for b in ends}
                layers = prefix_layers(hybrid_spec(), toks)
                bank.namespace(hybrid_spec()).store(toks, layers, states)
                more = asked(agent)
                for spec in (plain_spec(), hybrid_spec()):
                    state = end_state(agent) if spec.is_hybrid else None
                    bank.namespace(spec).store_end(
                        more, prefix_layers(spec, more), state, logits=end_logits(agent)
                    )
        else:
            for agent in range(AGENTS):
                toks = prompt(agent)
                for name, spec in (("plain", plain_spec()), ("hybrid", hybrid_spec())):
                    hit = bank.namespace(spec).restore(toks)
                    out["restored"][f"{name}-{agent}"] = (
                        [hit.tokens, digest(hit.layers)] if hit is not None else None
                    )
                bank.flush()  # the fetched blocks are local now: the repeat fetches its end
                for name, spec in (("plain", plain_spec()), ("hybrid", hybrid_spec())):
                    hit = bank.namespace(spec).restore(asked(agent))  # an exact repeat
                    out["exact"][f"{name}-{agent}"] = (
                        [hit.tokens, digest(hit.layers), digest([[hit.logits]])]
                        if hit is not None and hit.logits is not None
                        else None
                    )
        bank.flush()  # waits for the publishes (and the local writes of fetched blocks)
        for key, raw in bank.store.iterate(Family.HEADERS):
            h = Header.decode(key, raw)
            out["blocks"][key.hex()] = [h.payload_size, h.state_size]
        out["ends"] = {k.hex(): len(v) for k, v in bank.store.iterate(Family.ENDS)}
        out["stats"] = bank.stats().model_dump()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
