"""Eviction order on a mixed workload: what each policy keeps under a disk budget.

    .venv/bin/python -m benchmarks.eviction_policy [--requests 4000] [--json] [--tiny]

A real bank (RocksDB, the real eviction) on a synthetic layout: one attention layer of
one KV head of 8 fp16 values (32 bytes a token, 16-token blocks), no compression, and
a fake clock (one tick a request), so a run takes seconds and does no model forward.
Each request restores its prompt less the last token, as a runtime does, then stores
the prompt and its reply (a runtime stores what it prefilled and generated):
"prefilled tokens" are prompt tokens less restored tokens.

The workload, from a fixed seed:
- agents (half of the requests): one of a few shared system prompts (1024 tokens;
  Zipf-like popularity) and a one-off task of 96-160 tokens; halfway through, the
  system prompts change (a new set: what was popular ages out);
- one-off long prompts (15%): 3000-5000 unique tokens, never sent again;
- multi-turn conversations (35%): 24 running at once, each a unique 256-768-token
  first message, then 3-10 turns each adding a 32-96-token message and a
  32-128-token reply; a finished one is replaced by a new one.

Each policy (`BankConfig.eviction_policy`) runs the same requests at each budget;
printed side by side: token hit rate (restored / prompt tokens), prefilled tokens,
and per kind of request. `--json` prints everything.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import mlx.core as mx
import numpy as np

from cas_bank import Bank, BankConfig, LayerSpec, ModelSpec
from cas_bank.config import EvictionPolicy

BLOCK = 16
BYTES_PER_TOKEN = 2 * 8 * 2  # keys and values, one head of 8 fp16
POLICIES: tuple[EvictionPolicy, ...] = get_args(EvictionPolicy)
KINDS = ("agent", "one_off", "conversation")
SPEC = ModelSpec(
    name="eviction-policy-bench",
    layers=(LayerSpec.attention(kv_heads=1, head_dim=8, dtype="float16"),),
    weights_digest="bench-eviction-policy",
)


@dataclass(frozen=True)
class Settings:
    requests: int = 4000
    budgets_tokens: tuple[int, ...] = (16_384, 32_768, 65_536)
    system_prompts: int = 4
    system_tokens: int = 1024
    conversations: int = 24
    one_off_tokens: tuple[int, int] = (3000, 5000)
    p_agent: float = 0.5
    p_one_off: float = 0.15
    seed: int = 44


def tiny_settings() -> Settings:
    return Settings(requests=200, budgets_tokens=(8192,), conversations=6)


@dataclass
class Request:
    kind: str
    prompt: list[int]
    reply: list[int]


@dataclass
class Conversation:
    history: list[int]
    turns_left: int


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    restored_tokens: int = 0
    hits: int = 0  # requests that restored anything

    def add(self, prompt: int, restored: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.restored_tokens += restored
        self.hits += restored > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "restored_tokens": self.restored_tokens,
            "prefilled_tokens": self.prompt_tokens - self.restored_tokens,
            "token_hit_rate": self.restored_tokens / max(1, self.prompt_tokens),
            "request_hit_rate": self.hits / max(1, self.requests),
        }


@dataclass
class Result:
    policy: str
    budget_tokens: int
    total: Tally = field(default_factory=Tally)
    by_kind: dict[str, Tally] = field(default_factory=lambda: {k: Tally() for k in KINDS})
    blocks_evicted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_tokens": self.budget_tokens,
            "budget_bytes": self.budget_tokens * BYTES_PER_TOKEN,
            **self.total.as_dict(),
            "blocks_evicted": self.blocks_evicted,
            "by_kind": {k: t.as_dict() for k, t in self.by_kind.items()},
        }


def workload(s: Settings) -> list[Request]:
    """The requests, the same for every policy."""
    rng = np.random.default_rng(s.seed)
    fresh = iter(range(1000, 1 << 31))  # token ids: never repeated unless reused on purpose

    def unique(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    def systems() -> list[list[int]]:
        return [unique(s.system_tokens) for _ in range(s.system_prompts)]

    def conversation() -> Conversation:
        return Conversation(unique(int(rng.integers(256, 769))), int(rng.integers(3, 11)))

    popularity = 1.0 / np.arange(1, s.system_prompts + 1)
    popularity /= popularity.sum()
    sys_prompts = systems()
    chats = [conversation() for _ in range(s.conversations)]
    out: list[Request] = []
    for i in range(s.requests):
        if i == s.requests // 2:
            sys_prompts = systems()  # a new set of system prompts: the old ones age out
        r = rng.random()
        if r < s.p_agent:
            k = int(rng.choice(s.system_prompts, p=popularity))
            task = unique(int(rng.integers(96, 161)))
            out.append(Request("agent", sys_prompts[k] + task, unique(int(rng.integers(32, 129)))))
        elif r < s.p_agent + s.p_one_off:
            n = int(rng.integers(s.one_off_tokens[0], s.one_off_tokens[1] + 1))
            out.append(Request("one_off", unique(n), unique(int(rng.integers(32, 129)))))
        else:
            j = int(rng.integers(len(chats)))
            chat = chats[j]
            prompt = chat.history + unique(int(rng.integers(32, 97)))
            reply = unique(int(rng.integers(32, 129)))
            out.append(Request("conversation", prompt, reply))
            chat.history = prompt + reply
            chat.turns_left -= 1
            if chat.turns_left == 0:
                chats[j] = conversation()
    return out


def kv(n: int) -> list[Any]:
    shape = (1, 1, n, 8)
    return [(mx.zeros(shape, dtype=mx.float16), mx.zeros(shape, dtype=mx.float16))]


def run_one(
    root: Path, policy: EvictionPolicy, budget_tokens: int, requests: list[Request]
) -> Result:
    config = BankConfig(
        block_size=BLOCK,
        max_bytes=budget_tokens * BYTES_PER_TOKEN,
        eviction_policy=policy,
        compression="none",
        file_min_bytes=None,
        hot_bytes=0,
        spare_bytes=0,
        write_behind=0,
    )
    result = Result(policy, budget_tokens)
    now = [0.0]
    with Bank.open(root / f"{policy}-{budget_tokens}", config) as bank:
        bank.access.set_clock(lambda: now[0])
        ns = bank.namespace(SPEC)
        for req in requests:
            now[0] += 1.0
            hit = ns.restore(req.prompt[:-1])
            restored = hit.tokens if hit is not None else 0
            result.total.add(len(req.prompt), restored)
            result.by_kind[req.kind].add(len(req.prompt), restored)
            now[0] += 0.5
            tokens = req.prompt + req.reply
            ns.store(tokens, kv(len(tokens)))
        result.blocks_evicted = bank.stats().blocks_evicted
        payload = bank.stats().payload_bytes
        assert payload <= config.max_bytes, (payload, config.max_bytes)  # type: ignore[operator]
    return result


def run(s: Settings, workdir: Path | None = None) -> dict[str, Any]:
    requests = workload(s)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="cas_bank_evict_bench_", dir=workdir) as d:
        for budget in s.budgets_tokens:
            for policy in POLICIES:
                results.append(run_one(Path(d), policy, budget, requests))
    return {
        "settings": s.__dict__,
        "block_size": BLOCK,
        "bytes_per_token": BYTES_PER_TOKEN,
        "results": [r.as_dict() for r in results],
    }


def table(out: dict[str, Any]) -> str:
    lines = [
        f"{'budget':>12} {'policy':>6} {'hit rate':>9} {'requests':>9} {'prefilled':>10} "
        f"{'agents':>7} {'one-off':>8} {'convers.':>9} {'evicted':>8}"
    ]
    for r in out["results"]:
        k = r["by_kind"]
        lines.append(
            f"{r['budget_tokens']:>6} tokens {r['policy']:>6} {r['token_hit_rate']:>9.3f} "
            f"{r['request_hit_rate']:>9.3f} {r['prefilled_tokens']:>10} "
            f"{k['agent']['token_hit_rate']:>7.3f} {k['one_off']['token_hit_rate']:>8.3f} "
            f"{k['conversation']['token_hit_rate']:>9.3f} {r['blocks_evicted']:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=Settings.requests)
    parser.add_argument("--tiny", action="store_true", help="a few requests (a smoke run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    s = tiny_settings() if args.tiny else Settings(requests=args.requests)
    out = run(s)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            "hit rate: restored / prompt tokens, overall and per kind of request; requests:"
            " the share that restored any token; evicted: blocks"
        )
        print(table(out))
    return out


if __name__ == "__main__":
    main()
