"""A fleet of agents sharing one long system prompt, on the GDN hybrid model.

Every agent's first prompt is the shared system prompt plus `distinct` tokens of its
own; every later turn appends `distinct` more of its own tokens (a reply and the next
message). Each request is served the way a runtime serves it with cas_bank:
`PrefixCache.restore`, then `PrefixCache.prefill` of the rest (which stores the new
blocks and the states the policy asks for). Time to first token is that request's
wall time.

Beside it, what an mlx-lm user keeps today: after each turn, the agent's whole cache
in a per-session file (`save_prompt_cache`, one file per agent, overwritten each
turn; the sum over every turn's save is printed too). The files hold KV buffers cut
to their offsets, which favours them.

The lower bound on the bank's bytes: every distinct token's KV once (the system
prompt once, each agent's own tokens once) plus the recurrent states the bank keeps,
at their raw array sizes: those the policy keeps at block boundaries and the one at
each stored prompt's end (in its end record: the state a next turn resumes from,
which a boundary state record held before end records). The bank's bytes are its
directory after a close (every file: tables, blob files, logs, manifest).

Scaling (why the defaults are what they are): the hybrid's GDN layers loop over tokens
in Python on CPU, so a prompt costs roughly 1-2 ms per token on 2 cores. The first agent
prefills the whole system prompt; the second does too (its miss is the branch point
where the state at the end of the system prompt gets stored, see docs/design.md, "State
capture policy"); every later request prefills only its own new tokens. 100 agents x 2
turns of 256 tokens took about 1-2 min here; turns or agents scale that linearly.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from cas_bank.runtime import PrefixCache, build_model
from mlx_lm.models.cache import save_prompt_cache

from benchmarks.ceilings import dir_bytes, median, percentile
from benchmarks.ttft import PREFILL_STEP, trimmed
from cas_bank import Bank, BankConfig, BankStats, ModelSpec


@dataclass(frozen=True)
class FleetSettings:
    agents: int = 100
    system_tokens: int = 4096
    distinct_tokens: int = 256  # each agent's own new tokens per turn
    turns: int = 2
    model: str = "tiny-hybrid"
    block_size: int = 64
    admit: str = "always"  # BankConfig.admit


@dataclass
class _Served:
    """What serving the fleet left: each request's figures, the bytes of every turn's
    session files, the wall time, and the model's spec."""

    requests: list[dict[str, Any]]
    saved_bytes_all_turns: int
    serve_s: float
    spec: ModelSpec


def run(workdir: Path, s: FleetSettings) -> dict[str, Any]:
    """Serve every agent's every turn; return bytes, hit rate and TTFT figures."""
    if s.agents < 1 or s.turns < 1 or s.system_tokens < 1 or s.distinct_tokens < 1:
        raise ValueError(f"agents, turns and token counts must be >= 1: {s}")
    workdir.mkdir(parents=True, exist_ok=True)
    files = workdir / "sessions"
    files.mkdir()
    bank_path = workdir / "bank"
    served = _serve(bank_path, files, s)
    with Bank.open(bank_path, mode="read_only") as bank:
        stats = bank.stats()  # after the close: memtables flushed, sizes final
    return {
        "settings": asdict(s),
        "requests": len(served.requests),
        "serve_s": served.serve_s,
        "distinct_tokens": _distinct(s),
        "aligned": s.system_tokens % s.block_size == 0 and s.distinct_tokens % s.block_size == 0,
        "bytes": _bytes(bank_path, files, s, served, stats),
        "bytes_written": stats.bytes_written,
        "blocks_deferred": stats.blocks_deferred,
        **_latencies(served.requests),
        "bank_hit_rate": stats.hit_rate,
        "per_request": served.requests,
    }


def _serve(bank_path: Path, files: Path, s: FleetSettings) -> _Served:
    """Every agent's every turn in one bank: restore, prefill (which stores), and the
    session file mlx-lm would save instead."""
    lm = build_model(s.model)
    rng = np.random.default_rng(2024)
    vocab = 256  # byte-level ids: valid for every embedded model
    system = rng.integers(0, vocab, s.system_tokens).astype(np.uint32)
    history = [system.copy() for _ in range(s.agents)]
    requests: list[dict[str, Any]] = []
    saved = 0
    t_start = time.perf_counter()
    config = BankConfig(block_size=s.block_size, admit=s.admit)  # type: ignore[arg-type]
    with Bank.open(bank_path, config) as bank:
        pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
        for turn in range(s.turns):
            for a in range(s.agents):
                prompt = np.concatenate(
                    [history[a], rng.integers(0, vocab, s.distinct_tokens).astype(np.uint32)]
                )
                figures, cache = _request(pc, prompt)
                requests.append({"turn": turn, "agent": a} | figures)
                history[a] = prompt
                f = files / f"agent-{a}.safetensors"
                save_prompt_cache(str(f), trimmed(cache))
                saved += f.stat().st_size
        spec = pc.spec
    return _Served(requests, saved, time.perf_counter() - t_start, spec)


def _request(pc: PrefixCache, prompt: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
    """One request: restore, prefill the rest (storing it); its figures and its cache."""
    t0 = time.perf_counter()
    cache, n = pc.restore(prompt)
    t1 = time.perf_counter()
    pc.prefill(prompt, cache, start=n)
    t2 = time.perf_counter()
    rep = pc.last_prefill
    assert rep is not None
    figures = {
        "tokens": len(prompt),
        "restored": n,
        "ttft_s": t2 - t0,
        "restore_s": t1 - t0,
        "forward_s": rep.forward_s,
        "store_s": rep.store_s,
    }
    return figures, cache


def _distinct(s: FleetSettings) -> int:
    """Tokens the fleet's prompts hold once each: the system prompt and every new turn."""
    return s.system_tokens + s.agents * s.turns * s.distinct_tokens


def _bytes(
    bank_path: Path, files: Path, s: FleetSettings, served: _Served, stats: BankStats
) -> dict[str, Any]:
    """The bank's bytes against their lower bound and against mlx-lm's session files."""
    # cas_bank keeps full blocks only: the distinct tokens it can hold are those below
    # each prompt's last block boundary (all of them when the sizes are block-aligned).
    kv_lower = _distinct(s) * served.spec.token_bytes
    # A hybrid model's end record always holds the state at its end (index.ends).
    end_states = stats.ends if served.spec.is_hybrid else 0
    states_kept = stats.states + end_states
    state_lower = states_kept * served.spec.state_bytes
    lower = kv_lower + state_lower
    bank_bytes = dir_bytes(bank_path)
    session_bytes = dir_bytes(files)
    return {
        "cas_bank_dir": bank_bytes,
        "cas_bank_tables_and_blobs": stats.disk_bytes,
        "payload_bytes": stats.payload_bytes,
        "state_bytes": stats.state_bytes,
        "states_kept": states_kept,
        "end_states_kept": end_states,
        "lower_bound": lower,
        "lower_bound_kv": kv_lower,
        "lower_bound_states": state_lower,
        "ratio_to_lower_bound": bank_bytes / lower,
        "session_files_latest": session_bytes,
        "session_files_all_turns": served.saved_bytes_all_turns,
        "session_over_cas_bank": session_bytes / bank_bytes,
    }


def _latencies(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The requests' hit rate, TTFT percentiles and the median of each part."""
    ttft = [r["ttft_s"] for r in requests]
    warm = [r["ttft_s"] for r in requests if r["restored"] > 0]
    queried = sum(r["tokens"] for r in requests)
    hit = sum(r["restored"] for r in requests)
    return {
        "hit_rate": hit / queried,
        "ttft": {
            "p50_s": median(ttft),
            "p99_s": percentile(ttft, 99),
            "max_s": max(ttft),
            "warm_p50_s": median(warm) if warm else None,
            "warm_p99_s": percentile(warm, 99) if warm else None,
            "misses": len(ttft) - len(warm),
        },
        "split_p50_s": {
            "restore": median([r["restore_s"] for r in requests]),
            "forward": median([r["forward_s"] for r in requests]),
            "store": median([r["store_s"] for r in requests]),
        },
    }


def admission(workdir: Path, s: FleetSettings) -> dict[str, Any]:
    """The same fleet under each admission policy: bytes written against hit rate."""
    out: dict[str, Any] = {"settings": asdict(s), "policies": {}}
    for admit in ("always", "second_use"):
        res = run(workdir / admit, replace(s, admit=admit))
        out["policies"][admit] = {
            "bytes_written": res["bytes_written"],
            "blocks_deferred": res["blocks_deferred"],
            "hit_rate": res["hit_rate"],
            "bank_dir_bytes": res["bytes"]["cas_bank_dir"],
            "ttft_p50_s": res["ttft"]["p50_s"],
            "misses": res["ttft"]["misses"],
        }
    return out


@dataclass(frozen=True)
class BranchSettings:
    """Agents that share a system prompt and branch at arbitrary points: each request
    is the system prompt, or an earlier request cut at a random token past the system
    prompt (a regenerated answer, an edited message, a fork), plus new tokens of its
    own. The same requests at every block size, with partial blocks and without. Each
    request is stored with its end record, as `cas-bank serve` stores a prompt."""

    agents: int = 48
    system_tokens: int = 1000  # not block-aligned, as a real system prompt is not
    own_tokens: tuple[int, int] = (32, 256)  # each request's new tokens, uniform
    from_system: float = 0.3  # share of requests that branch off the system prompt itself
    model: str = "tiny-qwen3"  # attention-only: a hybrid takes no partial block
    block_sizes: tuple[int, ...] = (16, 64, 256)


def branch_prompts(s: BranchSettings) -> list[np.ndarray]:
    """The requests, seeded: the same list for every block size."""
    rng = np.random.default_rng(23)
    system = rng.integers(0, 256, s.system_tokens).astype(np.uint32)
    prompts: list[np.ndarray] = []
    for _ in range(s.agents):
        base = system
        if prompts and rng.random() >= s.from_system:
            src = prompts[int(rng.integers(len(prompts)))]
            base = src[: int(rng.integers(s.system_tokens, len(src) + 1))]
        own = rng.integers(0, 256, int(rng.integers(s.own_tokens[0], s.own_tokens[1] + 1)))
        prompts.append(np.concatenate([base, own.astype(np.uint32)]))
    return prompts


def branching(workdir: Path, s: BranchSettings) -> dict[str, Any]:
    """Prefilled tokens, hit rate, blocks stored and restore/TTFT times of the branching
    agents at each block size, with partial blocks and without (whole blocks only)."""
    lm = build_model(s.model)
    prompts = branch_prompts(s)
    queried = sum(len(p) for p in prompts)
    out: dict[str, Any] = {"settings": asdict(s), "requests": len(prompts), "runs": {}}
    for bs in s.block_sizes:
        for partial in (True, False):
            path = workdir / f"b{bs}-{'partial' if partial else 'whole'}"
            config = BankConfig(block_size=bs, partial_blocks=partial)
            restored, restore_s, ttft_s = [], [], []
            with Bank.open(path, config) as bank:
                pc = PrefixCache(bank, lm, chunk_size=PREFILL_STEP)
                for prompt in prompts:
                    t0 = time.perf_counter()
                    cache, n = pc.restore(prompt)
                    t1 = time.perf_counter()
                    pc.prefill(prompt, cache, start=n, end=True)  # as `cas-bank serve` does
                    ttft_s.append(time.perf_counter() - t0)
                    restore_s.append(t1 - t0)
                    restored.append(n)
                stats = bank.stats()
            hits = [t for t, n in zip(restore_s, restored, strict=True) if n]
            out["runs"][f"{bs}/{'partial' if partial else 'whole'}"] = {
                "block_size": bs,
                "partial": partial,
                "prefilled_tokens": queried - sum(restored),
                "hit_rate": sum(restored) / queried,
                "partial_tokens": stats.partial_tokens,
                "blocks_stored": stats.blocks,
                "blocks_per_restore": sum(n // bs for n in restored) / len(prompts),
                "restore_p50_s": median(hits) if hits else None,
                "ttft_p50_s": median(ttft_s),
                "misses": sum(1 for n in restored if n == 0),
            }
    out["queried_tokens"] = queried
    return out


def tiny_branch_settings() -> BranchSettings:
    return BranchSettings(agents=6, system_tokens=100, own_tokens=(8, 40), block_sizes=(16, 64))


def admission_settings() -> FleetSettings:
    """Smaller than the default fleet (it runs twice): 20 agents, 3 turns."""
    return FleetSettings(agents=20, system_tokens=1024, distinct_tokens=256, turns=3)


def tiny_settings() -> FleetSettings:
    return FleetSettings(agents=3, system_tokens=128, distinct_tokens=64, turns=2)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the fleet benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=main.__doc__)
    p.add_argument("--agents", type=int, default=FleetSettings.agents)
    p.add_argument("--turns", type=int, default=FleetSettings.turns)
    p.add_argument("--system-tokens", type=int, default=FleetSettings.system_tokens)
    p.add_argument("--distinct-tokens", type=int, default=FleetSettings.distinct_tokens)
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    p.add_argument(
        "--branching", action="store_true", help="the branching agents, partial blocks or not"
    )
    args = p.parse_args(argv)
    if args.branching:
        b = tiny_branch_settings() if args.tiny else BranchSettings()
        with tempfile.TemporaryDirectory(prefix="cas_bank_branch_") as tmp:
            res = branching(Path(tmp), b)
        print(json.dumps(res, indent=2, default=str))
        return res
    s = (
        tiny_settings()
        if args.tiny
        else FleetSettings(
            agents=args.agents,
            turns=args.turns,
            system_tokens=args.system_tokens,
            distinct_tokens=args.distinct_tokens,
        )
    )
    with tempfile.TemporaryDirectory(prefix="cas_bank_fleet_") as tmp:
        res = run(Path(tmp), s)
    out = {k: v for k, v in res.items() if k != "per_request"}
    print(json.dumps(out, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
