"""The first token against mlx-lm's in-memory cache, with library defaults.

mlx-lm's server keeps conversations in memory (`LRUPromptCache`): after an answer,
`insert_cache(model, prompt + answer, cache)`; on the next request,
`fetch_nearest_cache(model, prompt)`, which deep-copies the nearest stored cache (its
buffers as they are: a prefix that filled its buffer has no room left, and the first
token's update copies it once more) and returns the tokens left to prefill. Beside it,
the bank as a library caller uses it: `Bank.open(path)` and `PrefixCache(bank, model)`
with every default, `restore`, then `prefill` of the rest (which stores what is new,
through the background writer). Three situations:

(a) another agent sharing a stored prefix: the prefix (L tokens) stored by an earlier
    request of this process (`insert_cache`; `PrefixCache.store`), then a request of
    the prefix and one new token;
(b) the next turn of the same conversation: turn 1 (the L-token prompt) and its
    16-token answer went through the model (the live cache holds both, with the room
    mlx-lm's `KVCache` grows by); the conversation is stored after the answer
    (`insert_cache` and `PrefixCache.store` of prompt + answer, untimed, the background
    writer drained as a user's reading time would); the next request is prompt + answer
    + 64 new tokens. The forward-only limit: that live cache kept in the process and
    only the 64 new tokens through the model;
(c) after a restart: mlx-lm's LRU is empty, so it prefills the whole prompt (not run
    here: at least this machine's prefill rate, `benchmarks.prefill_or_restore`, times
    the prompt); mlx-lm's prompt-cache file of the prefix (`load_prompt_cache` and the
    new token's forward pass); the bank closed and opened again before each request
    (the page cache stays warm, as it does for the file).

Layouts: the medium models' caches at 1k and 4k tokens (16k with `large_settings`) and
`fp32-100mb` (6 layers x 4 KV heads x 128, float32: 100 MB at 4096 tokens), filled
with random KV of the right shapes (`benchmarks.restore.synthetic_cache`: no prefill
needed). Every way of a situation starts from the same cache, so each way's logits are
compared with the forward-only limit's on the same request. The ways of a situation
are timed one of each per round, their order rotated each round, and the ratios are
medians of each round's ratio (the forward pass, most of a TTFT on this CPU, runs at
two speeds for seconds at a time: `benchmarks.restore._timed`). The bank's spare
restore destinations are made before each way is timed, as a forward pass gives them
time in a runtime (`settle`).

mlx-lm's own `generate_step` prefills a prompt's last token in a pass of its own; the
mlx-lm ways here run the tokens left in one pass, as the limit does, which favours them.
The answer goes through the model in one pass (decoding feeds it a token at a time):
every way starts from the cache it leaves.

And in `cas-bank serve` (`benchmarks.first_token_serve`): the same three situations
through the server's app in this process, on the same bank (its Engine on the very
LoadedModel the prefix was stored with): way `serve` in (a) and (b), `serve_restarted`
in (c) (a fresh server on the bank's directory per request). Its requests are timed
beside the other ways of the first `serve_rounds` rounds of (a) and (c) (2 at default
sizes) and `serve_turn_rounds` of (b) (1: a 65-token pass), so its ratios are per-round
ones against the other ways of the same rounds. In (b) the server's turn 1 is its own
greedy answer to the prefix and one new token (untimed), and it prefills the answer's
last token too (sampled, never through the model): 65 tokens against the limit's 64.

Also measured: a restore with room in the same process (the bank's way in (a), alone),
as the defaults run it (a lease restored again is copied ahead by the spares' thread,
off the restore's path) and with its copy on its path, against a memcpy of the same
bytes and the file's load.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cas_bank.runtime import LoadedModel, PrefixCache, build_model
from mlx_lm.models.cache import KVCache, LRUPromptCache, load_prompt_cache, save_prompt_cache

from benchmarks import first_token_serve as serve
from benchmarks import prefill_or_restore
from benchmarks.ceilings import median, memcpy_samples, profile_top
from benchmarks.library_restore import _fp32_100mb
from benchmarks.restore import synthetic_cache
from benchmarks.ttft import eval_cache, kv_bytes
from cas_bank import Bank

MODEL_KEY = "model"  # `mlx_lm.server`'s model key: one model per LRU here
Way = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class FirstTokenSettings:
    layouts: tuple[str, ...] = (
        "medium-qwen3:1024",
        "medium-qwen3:4096",
        "medium-hybrid:1024",
        "medium-hybrid:4096",
        "fp32-100mb:4096",
    )
    answer_tokens: int = 16
    new_tokens: int = 64
    rounds: int = 7  # (a) and (c): a single-token pass each way
    turn_rounds: int = 3  # (b): a 64-token pass each way (seconds on the medium models)
    prefill_lengths: tuple[int, ...] = (64, 128)  # prefilled here (`prefill_or_restore`)
    logits_atol: float = 1e-3
    # `cas-bank serve`'s ways (`first_token_serve`): in the first rounds only. (a), (c):
    # a single-token pass each (~0.1-0.5 s on the medium models at 4k); (b): turn 1's
    # 16-token answer and a 65-token pass (5-26 s on the medium models). 0: not run.
    serve_rounds: int = 2
    serve_turn_rounds: int = 1


def large_settings() -> FirstTokenSettings:
    """The default layouts and the medium models at 16k tokens."""
    s = FirstTokenSettings()
    return replace(s, layouts=(*s.layouts, "medium-qwen3:16384", "medium-hybrid:16384"))


def tiny_settings() -> FirstTokenSettings:
    return FirstTokenSettings(
        layouts=("tiny-qwen3:128", "tiny-hybrid:128"),
        rounds=1,
        turn_rounds=1,
        prefill_lengths=(64,),
        serve_rounds=1,
        serve_turn_rounds=1,
    )


def layout_model(name: str) -> LoadedModel:
    """A layout's model: an embedded one, or `fp32-100mb` (`benchmarks.library_restore`)."""
    return _fp32_100mb() if name == "fp32-100mb" else build_model(name)


# -- the steps every way is made of ----------------------------------------------------
def _forward(model: Any, tokens: np.ndarray, cache: list[Any]) -> mx.array:
    """`tokens` through the model in one pass; the last position's logits, evaluated."""
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    mx.eval(logits)
    return logits


def with_room(cache: list[Any], room: int) -> list[Any]:
    """A copy of `cache` whose KV buffers have `room` more tokens (a cache in memory
    that writes the next tokens in place, as the forward-only limit has it)."""
    out = copy.deepcopy(cache)
    for entry in out:
        keys = getattr(entry, "keys", None)
        if not isinstance(entry, KVCache) or keys is None or keys.shape[-2] >= entry.offset + room:
            continue
        n = entry.offset
        grown = []
        for a in (entry.keys, entry.values):
            b = mx.zeros((*a.shape[:-2], n + room, a.shape[-1]), dtype=a.dtype)
            b[..., :n, :] = a[..., :n, :]
            grown.append(b)
        entry.keys, entry.values = grown
    eval_cache(out)
    return out


def _limit(model: Any, cache: list[Any], rest: np.ndarray) -> dict[str, Any]:
    """The forward-only limit: `rest` through the model on a cache already in memory."""
    t0 = time.perf_counter()
    logits = _forward(model, rest, cache)
    return {"ttft_s": time.perf_counter() - t0, "prefilled": len(rest), "logits": logits}


def _lru_way(lru: LRUPromptCache, model: Any, request: np.ndarray) -> dict[str, Any]:
    """mlx-lm's server on the next request: `fetch_nearest_cache` (a deep copy of the
    nearest cache, evaluated here to time it) and the forward pass of what is left."""
    t0 = time.perf_counter()
    cache, rest = lru.fetch_nearest_cache(MODEL_KEY, request.tolist())
    if cache is None:
        raise RuntimeError("mlx-lm's LRU held nothing for the request")
    eval_cache(cache)
    t1 = time.perf_counter()
    logits = _forward(model, np.asarray(rest, dtype=request.dtype), cache)
    t2 = time.perf_counter()
    return {
        "ttft_s": t2 - t0,
        "fetch_s": t1 - t0,
        "forward_s": t2 - t1,
        "restored": len(request) - len(rest),
        "prefilled": len(rest),
        "logits": logits,
    }


def _file_way(file: Path, model: Any, request: np.ndarray, restored: int) -> dict[str, Any]:
    """mlx-lm's prompt-cache file of the first `restored` tokens: load, then the rest."""
    t0 = time.perf_counter()
    cache = load_prompt_cache(str(file))
    eval_cache(cache)
    t1 = time.perf_counter()
    logits = _forward(model, request[restored:], cache)
    t2 = time.perf_counter()
    return {
        "ttft_s": t2 - t0,
        "load_s": t1 - t0,
        "forward_s": t2 - t1,
        "restored": restored,
        "prefilled": len(request) - restored,
        "logits": logits,
    }


def _bank_way(pc: PrefixCache, request: np.ndarray) -> dict[str, Any]:
    """The library caller's request: `PrefixCache.restore`, then `prefill` of the rest
    (with its store: a snapshot queued for the background writer)."""
    hits = pc.bank.stats().hot_hits
    t0 = time.perf_counter()
    cache, n = pc.restore(request)
    eval_cache(cache)
    t1 = time.perf_counter()
    logits = pc.prefill(request, cache, start=n)
    t2 = time.perf_counter()
    rep = pc.last_prefill
    return {
        "hot_hits": pc.bank.stats().hot_hits - hits,  # blocks its restore found in memory
        "ttft_s": t2 - t0,
        # The bank's own time: the request's but for its forward pass (the restore, the
        # store's snapshot, the bookkeeping), steadier than the TTFT on a busy host.
        "own_s": t2 - t0 - (rep.forward_s if rep is not None else t2 - t1),
        "restore_s": t1 - t0,
        "prefill_s": t2 - t1,
        "forward_s": rep.forward_s if rep is not None else t2 - t1,
        "store_s": rep.store_s if rep is not None else 0.0,
        "restored": n,
        "prefilled": len(request) - n,
        "logits": logits,
    }


def _rounds(
    ways: dict[str, Way],
    rounds: int,
    prepare: Callable[[int], dict[str, Any]],
    settle: Callable[[], None],
    only: dict[str, int] | None = None,
) -> list[dict[str, dict[str, Any]]]:
    """`rounds` rounds of every way, their order rotated each round; each round's state
    made first (untimed) by `prepare`. A way in `only` runs in that many first rounds
    only. Returns each round's samples by way."""
    only = only or {}
    out = []
    for r in range(rounds):
        state = prepare(r)
        order = [w for w in ways if r < only.get(w, rounds)]
        got = {}
        for way in order[r % len(order) :] + order[: r % len(order)]:
            settle()
            got[way] = ways[way](state)
        out.append(got)
    return out


def _summary(samples: list[dict[str, dict[str, Any]]], ref: str = "limit") -> dict[str, Any]:
    """Medians of every way's figures, each way's logits against `ref`'s of the same
    round (the largest difference, and whether every round was bit-identical), and the
    per-round ratios of TTFTs (`"x_over_y"`: the median of x's TTFT / y's, over the
    rounds both ran in). A way without logits (the server's) has no difference; one
    that ran in fewer rounds says how many (`"rounds"`) and the other ways' median
    TTFTs in those rounds (`"beside_ttft_s"`)."""
    ways = list(dict.fromkeys(w for s in samples for w in s))
    out: dict[str, Any] = {}
    for w in ways:
        mine = [s[w] for s in samples if w in s]
        keys = [k for k, v in mine[0].items() if isinstance(v, (int, float))]
        fig = {k: median([m[k] for m in mine]) for k in keys}
        if w != ref and "logits" in mine[0]:
            diffs = [
                float(mx.max(mx.abs(s[w]["logits"] - s[ref]["logits"]))) for s in samples if w in s
            ]
            fig["logits_max_diff"] = max(diffs)
        if len(mine) < len(samples):  # and the other ways' TTFTs in the same rounds
            fig["rounds"] = len(mine)
            fig["beside_ttft_s"] = {
                x: median([s[x]["ttft_s"] for s in samples if w in s and x in s])
                for x in ways
                if x != w
            }
        out[w] = fig
    out["ratios"] = {
        f"{x}_over_{y}": median(
            [s[x]["ttft_s"] / s[y]["ttft_s"] for s in samples if x in s and y in s]
        )
        for x in ways
        for y in ways
        if x != y
    }
    out["rounds"] = len(samples)
    return out


# -- one layout ------------------------------------------------------------------------
@dataclass
class _Case:
    """One layout's turn 1, stored: its prompt, its cache as a prefill leaves it (no room
    past the prompt), the bank (open) and mlx-lm's file of the same prefix."""

    lm: LoadedModel
    layout: str
    prompt: np.ndarray
    base: list[Any]
    states: dict[int, Any]
    nbytes: int
    path: Path
    file: Path
    bank: Bank
    pc: PrefixCache
    rng: np.random.Generator
    server: Any = None  # `cas-bank serve`'s app on `bank` (`first_token_serve`), or None
    used: set[int] = field(default_factory=set)  # the tokens after the prompt so far

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 256, n).astype(np.uint32)

    def after_prompt(self) -> np.ndarray:
        """The prompt and a token no request of this case put after it before: every
        way's request is new to the bank (an end record of the same request, stored by
        an earlier way or round, would be restored whole, with its logits)."""
        t = int(self.rng.integers(0, 256))
        while t in self.used:
            t = (t + 1) % 256
        self.used.add(t)
        return np.concatenate([self.prompt, np.array([t], dtype=self.prompt.dtype)])

    def settle(self) -> None:
        self.bank.resources.settle()


def _prepare(lm: LoadedModel, layout: str, length: int, workdir: Path) -> _Case:
    rng = np.random.default_rng(length)
    prompt = rng.integers(0, 256, length).astype(np.uint32)
    path, file = workdir / f"bank-{layout}", workdir / f"{layout}.safetensors"
    bank = Bank.open(path)  # library defaults: BankConfig()
    pc = PrefixCache(bank, lm)
    base, states = synthetic_cache(pc, length, rng)
    pc.store(prompt, base, states)
    bank.flush()
    save_prompt_cache(str(file), base)
    return _Case(lm, layout, prompt, base, states, kv_bytes(base), path, file, bank, pc, rng)


def _shared_prefix(case: _Case, s: FirstTokenSettings) -> dict[str, Any]:
    """(a): another agent's request on the stored prefix and one new token."""
    model, prompt = case.lm.model, case.prompt
    lru = LRUPromptCache()
    lru.insert_cache(MODEL_KEY, prompt.tolist(), copy.deepcopy(case.base))

    def prepare(r: int) -> dict[str, Any]:
        st = {"request": case.after_prompt(), "cache": with_room(case.base, KVCache.step)}
        if r < only.get("serve", 0):  # the server's own: the bank way stores `request`
            st["serve_request"] = case.after_prompt()
        return st

    ways: dict[str, Way] = {
        "limit": lambda st: _limit(model, st["cache"], st["request"][-1:]),
        "mlx_lm_lru": lambda st: _lru_way(lru, model, st["request"]),
        "bank": lambda st: _bank_way(case.pc, st["request"]),
    }
    only: dict[str, int] = {}
    if case.server is not None and s.serve_rounds > 0:
        ways["serve"] = lambda st: serve.serve_way(case.server, st["serve_request"])
        only["serve"] = s.serve_rounds
    _rounds(ways, 1, prepare, case.settle, only)  # warm-up, uncounted
    out = _summary(_rounds(ways, s.rounds, prepare, case.settle, only))
    request = prepare(0)["request"]
    out["restore_on_path_s"] = _restore_on_path(case, request, s.rounds)
    out["profile_restore"] = profile_top(lambda: eval_cache(case.pc.restore(request)[0]), 2, 6)
    case.settle()
    return out


def _restore_on_path(case: _Case, request: np.ndarray, repeats: int) -> float:
    """The same restore with room with its copy on its path (the spares' copies ahead
    off, `Spares.copy_ahead`: a lease's first restores go so): its copy against a
    memcpy's speed. Medians of `repeats` restores, each alone."""
    spares = case.bank.resources.spares
    ahead, spares.copy_ahead = spares.copy_ahead, False
    times = []
    try:
        for _ in range(repeats):
            case.settle()
            t0 = time.perf_counter()
            cache, _ = case.pc.restore(request)
            eval_cache(cache)
            times.append(time.perf_counter() - t0)
            del cache
    finally:
        spares.copy_ahead = ahead
        case.settle()
    return median(times)


def _next_turn(case: _Case, s: FirstTokenSettings) -> dict[str, Any]:
    """(b): the next turn of the conversation: prompt + answer stored, + new tokens."""
    model, prompt = case.lm.model, case.prompt

    def prepare(r: int) -> dict[str, Any]:
        answer, new = case.tokens(s.answer_tokens), case.tokens(s.new_tokens)
        live = copy.deepcopy(case.base)  # turn 1's prompt, as its prefill left it
        _forward(model, answer, live)  # the answer through the model: live holds both
        talk = np.concatenate([prompt, answer])
        lru = LRUPromptCache()
        lru.insert_cache(MODEL_KEY, talk.tolist(), copy.deepcopy(live))
        limit_cache = copy.deepcopy(live)
        case.pc.store(talk, live, case.states)  # after the answer, as the README's caller
        case.bank.flush()  # the user reads the answer: the writer is done by the next turn
        st = {"request": np.concatenate([talk, new]), "lru": lru, "cache": limit_cache}
        if r < only.get("serve", 0):  # the server's turn 1 and its own answer, untimed
            turn1 = case.after_prompt()
            said = serve.server_answer(case.server, turn1, s.answer_tokens)
            st["serve_request"] = np.concatenate([turn1, said, new])
        return st

    ways: dict[str, Way] = {
        "limit": lambda st: _limit(model, st["cache"], st["request"][-s.new_tokens :]),
        "mlx_lm_lru": lambda st: _lru_way(st["lru"], model, st["request"]),
        "bank": lambda st: _bank_way(case.pc, st["request"]),
    }
    only: dict[str, int] = {}
    if case.server is not None and s.serve_turn_rounds > 0:
        ways["serve"] = lambda st: serve.serve_way(case.server, st["serve_request"])
        only["serve"] = min(s.serve_turn_rounds, s.turn_rounds)
    return _summary(_rounds(ways, s.turn_rounds, prepare, case.settle, only))


def _after_restart(case: _Case, s: FirstTokenSettings) -> dict[str, Any]:
    """(c): after a restart: the file, and the bank reopened before each request (its
    open and close untimed). Call with the case's bank closed."""
    model, length = case.lm.model, len(case.prompt)

    def prepare(r: int) -> dict[str, Any]:
        st = {"request": case.after_prompt(), "cache": with_room(case.base, KVCache.step)}
        if r < only.get("serve_restarted", 0):
            st["serve_request"] = case.after_prompt()
        return st

    def reopened(st: dict[str, Any]) -> dict[str, Any]:
        with Bank.open(case.path) as bank:
            pc = PrefixCache(bank, case.lm)
            got = _bank_way(pc, st["request"])
            bank.resources.settle()
        return got

    ways: dict[str, Way] = {
        "limit": lambda st: _limit(model, st["cache"], st["request"][-1:]),
        "mlx_lm_file": lambda st: _file_way(case.file, model, st["request"], length),
        "bank_reopened": reopened,
    }
    only: dict[str, int] = {}
    if s.serve_rounds > 0:  # a fresh `cas-bank serve` on the same bank per request
        ways["serve_restarted"] = lambda st: serve.restarted_way(
            case.lm, case.path, st["serve_request"]
        )
        only["serve_restarted"] = s.serve_rounds
    _rounds(ways, 1, prepare, lambda: None, only)  # warm-up, uncounted
    return _summary(_rounds(ways, s.rounds, prepare, lambda: None, only))


def measure(
    lm: LoadedModel, layout: str, length: int, s: FirstTokenSettings, workdir: Path
) -> dict[str, Any]:
    """(a), (b) and (c) for one layout, and the copy a restore with room makes against
    a memcpy of the same bytes."""
    case = _prepare(lm, layout, length, workdir)
    try:
        if s.serve_rounds > 0 or s.serve_turn_rounds > 0:  # the prefix stored: serve it
            case.server = serve.start_server(lm, case.bank)
        try:
            shared = _shared_prefix(case, s)
            turn = _next_turn(case, s)
        finally:
            if case.server is not None:
                case.server.stop()  # its engine closed, the bank flushed (not closed)
    finally:
        case.bank.close()
    restart = _after_restart(case, s)
    mem1 = median(memcpy_samples(case.nbytes, 7))
    mem2 = median(memcpy_samples(case.nbytes, 7, threads=2))
    hot, on_path = shared["bank"]["restore_s"], shared["restore_on_path_s"]
    load = restart["mlx_lm_file"]["load_s"]
    return {
        "layout": layout,
        "model": lm.name,
        "tokens": length,
        "kv_bytes": case.nbytes,
        "answer_tokens": s.answer_tokens,
        "new_tokens": s.new_tokens,
        "shared_prefix": shared,
        "next_turn": turn,
        "after_restart": restart,
        # A restore with room in the same process: as the defaults run it (a lease
        # restored again is copied ahead, off the path) and with its copy on the path.
        "hot_restore": {
            "restore_s": hot,
            "on_path_s": on_path,
            "gbps": case.nbytes / hot / 1e9,
            "on_path_gbps": case.nbytes / on_path / 1e9,
            "memcpy_s": mem1,
            "memcpy_2_threads_s": mem2,
            "on_path_of_memcpy": mem1 / on_path,
            "on_path_of_memcpy_2_threads": mem2 / on_path,
            "file_load_s": load,
            "file_load_over_restore": load / hot,
            "file_load_over_on_path": load / on_path,
        },
    }


def check(c: dict[str, Any], atol: float) -> list[str]:
    """Problems of a case: a way that restored less than the prefix it was given, or
    logits other than the forward-only limit's."""
    where = f"{c['layout']} {c['tokens']} tokens"
    problems = []
    for situation in ("shared_prefix", "next_turn", "after_restart"):
        for way, fig in c[situation].items():
            d = fig.get("logits_max_diff") if isinstance(fig, dict) else None
            if d is not None and not d <= atol:
                problems.append(f"{where}: {situation} {way} logits differ by {d:.2e}")
    for situation, way in (
        ("shared_prefix", "bank"),
        ("after_restart", "bank_reopened"),
        ("shared_prefix", "serve"),
        ("after_restart", "serve_restarted"),
    ):
        if way in c[situation] and c[situation][way]["restored"] < c["tokens"]:
            problems.append(
                f"{where}: {situation} {way} restored {c[situation][way]['restored']:.0f} "
                f"of {c['tokens']} tokens"
            )
    turn = c["next_turn"].get("serve")
    talk = c["tokens"] + 1 + c["answer_tokens"] - 1  # turn 1's prompt, its answer but the last
    if turn is not None and turn["restored"] < talk:
        problems.append(
            f"{where}: next_turn serve restored {turn['restored']:.0f} of {talk} tokens"
        )
    return problems


def run(workdir: Path, s: FirstTokenSettings) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    models: dict[str, LoadedModel] = {}
    cases, problems = [], []
    for layout in s.layouts:
        name, _, length_s = layout.partition(":")
        if name not in models:
            models[name] = layout_model(name)
        t0 = time.perf_counter()
        c = measure(models[name], layout, int(length_s), s, workdir)
        print(f"  first token {layout}: {time.perf_counter() - t0:.1f} s", flush=True)
        problems += check(c, s.logits_atol)
        cases.append(c)
    layouts = []
    for name, lm in models.items():
        t0 = time.perf_counter()
        mine = [c for c in cases if c["model"] == lm.name]
        layouts.append(prefill_or_restore.measure(lm, s.prefill_lengths, mine, workdir / name))
        print(f"  prefill or restore {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    for c in cases:  # mlx-lm's LRU after a restart: a cold prefill, at least this long
        lay = next(x for x in layouts if x["model"] == c["model"])
        c["after_restart"]["cold_prefill_at_least_s"] = prefill_or_restore.prefill_estimate(
            lay, c["tokens"] + 1
        )
    return {
        "settings": asdict(s),
        "cases": cases,
        "prefill_or_restore": layouts,
        "published_prefill": [dict(p) for p in prefill_or_restore.PUBLISHED_PREFILL],
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the first-token benchmark alone and print its figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_token", description=main.__doc__)
    p.add_argument("--layouts", help="comma-separated name:tokens (default: the medium ones)")
    p.add_argument("--large", action="store_true", help="with the medium models at 16k tokens")
    p.add_argument("--rounds", type=int, help="rounds of (a) and (c)")
    p.add_argument("--turn-rounds", type=int, help="rounds of (b)")
    p.add_argument("--serve-rounds", type=int, help="rounds of (a) and (c) with the server")
    p.add_argument("--serve-turn-rounds", type=int, help="rounds of (b) with the server")
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    p.add_argument("--server-settings", action="store_true", help="as `make bench` runs")
    args = p.parse_args(argv)
    s = tiny_settings() if args.tiny else large_settings() if args.large else FirstTokenSettings()
    if args.layouts:
        s = replace(s, layouts=tuple(x.strip() for x in args.layouts.split(",") if x.strip()))
    if args.rounds:
        s = replace(s, rounds=args.rounds)
    if args.turn_rounds:
        s = replace(s, turn_rounds=args.turn_rounds)
    if args.serve_rounds is not None:
        s = replace(s, serve_rounds=args.serve_rounds)
    if args.serve_turn_rounds is not None:
        s = replace(s, serve_turn_rounds=args.serve_turn_rounds)
    if args.server_settings:
        from cas_bank.runtime.process import server_settings

        server_settings()
    with tempfile.TemporaryDirectory(prefix="cas_bank_first_token_") as tmp:
        res = run(Path(tmp), s)
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
