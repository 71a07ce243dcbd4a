"""The report's sections of issue 43: the first token against mlx-lm's in-memory cache
(`benchmarks.first_token`), and where prefilling beats restoring
(`benchmarks.prefill_or_restore`)."""

from __future__ import annotations

from typing import Any

from benchmarks.targets import mb as _mb
from benchmarks.targets import ms as _ms
from benchmarks.targets import seconds as _seconds
from benchmarks.targets import table as _table

_SITUATIONS = (
    ("shared_prefix", "(a) another agent, stored prefix + 1", "mlx_lm_lru", "LRU", "bank"),
    ("next_turn", "(b) the next turn", "mlx_lm_lru", "LRU", "bank"),
    ("after_restart", "(c) after a restart", "mlx_lm_file", "file", "bank_reopened"),
)

_FIRST_TOKEN_INTRO = (
    "## The first token against mlx-lm's in-memory cache",
    "",
    "mlx-lm's server keeps conversations in memory (`LRUPromptCache`: `insert_cache` "
    "after the answer, `fetch_nearest_cache` on the next request, which deep-copies the "
    "nearest cache and returns the tokens left to prefill). The bank is used as a library "
    "caller uses it, every default: `Bank.open(path)`, `PrefixCache(bank, model)`, "
    "`restore`, then `prefill` of the rest (which stores what is new through the "
    "background writer). (a) another agent's request on a prefix stored by an earlier "
    "request of the process, plus one new token; (b) the next turn of the same "
    "conversation: turn 1's prompt and its answer (16 tokens) went through the model, "
    "the conversation was stored after the answer (`insert_cache`, `PrefixCache.store`, "
    "untimed), and the request adds 64 new tokens; (c) after a restart: mlx-lm's LRU is "
    "empty (it prefills the whole prompt: at least this machine's prefill rate times "
    "the prompt, below), mlx-lm's prompt-cache file of the prefix is loaded, and the "
    "bank is opened again before each request (page cache warm for both). The "
    "forward-only limit: the cache already in memory, with room, and only the tokens "
    "left through the model (in (b): turn 1's live cache and the 64 new tokens). The "
    "bank's `own` time is its request's but for its forward pass (the restore, the "
    "store's snapshot, the bookkeeping): on a busy host the forward passes' speed "
    "varies more than that. Prefixes "
    "are random KV of each layout's shapes; every way's logits are compared with the "
    "limit's on the same request. One of each way per round, their order rotated each "
    "round; ratios are medians of each round's ratio. mlx-lm's ways prefill what is "
    "left in one pass, as the limit does (its `generate_step` passes the last token "
    "alone), which favours them. Targets: (a) >= 1.4x mlx-lm's LRU; (b) <= 1.05x the "
    "limit and >= 1.0x mlx-lm's LRU; (c) >= 1.5x mlx-lm's file; the same in `cas-bank "
    "serve` (the second table).",
    "",
)

_SERVE_SITUATIONS = (
    ("shared_prefix", "(a) another agent, stored prefix + 1", "mlx_lm_lru", "LRU", "bank", "serve"),
    ("next_turn", "(b) the next turn", "mlx_lm_lru", "LRU", "bank", "serve"),
    (
        "after_restart",
        "(c) after a restart (a fresh server)",
        "mlx_lm_file",
        "file",
        "bank_reopened",
        "serve_restarted",
    ),
)

_SERVE_INTRO = (
    "The same situations in `cas-bank serve`: the server's app in this process "
    "(`BackgroundServer` around an `Engine` of the same model, every default: "
    "background stores, end records), on the bank the prefix was stored into; each "
    "request a token-id prompt streamed through `/v1/completions`, greedy, from a "
    "client made beforehand on a connection of its own, timed to the first chunk. (a) "
    "the prefix + 1 new token; (b) turn 1 (the prefix + 1 token) answered by the "
    "server itself (16 tokens, greedy, untimed; the engine stores prompt + answer with "
    "its end record after the request), then that conversation + 64 new tokens: it "
    "restores all that went through the model and prefills the answer's last token "
    "(sampled, never through the model) and the 64, against the limit's 64; (c) a "
    "fresh server (a new engine on the same bank directory, its start untimed) per "
    "request. The server's requests run beside the other ways in the first rounds "
    "only (its column `rounds`), so its ratios are per-round ones against the other "
    "ways of those rounds, and the other ways' TTFTs in its table are their medians "
    "in those rounds. Its time in parts: the engine's (queue wait and time to the "
    "first token; in brackets its restore, the forward pass, and the rest: the store's "
    "snapshot, the end-record lookup, the sampler, the thread hops) and HTTP's (the "
    "rest: the request and the first chunk through uvicorn and the event loop). The "
    "server gives no logits: its check is the tokens restored.",
    "",
)

_SERVE_COLUMNS = (
    "layout",
    "MB",
    "situation",
    "TTFT ms: limit / mlx-lm / library / serve",
    "mlx-lm / serve",
    "serve / limit",
    "serve / library",
    "serve's tokens: restored / prefilled",
    "serve ms: engine (restore / forward / the rest) / HTTP",
    "rounds",
)

_FIRST_TOKEN_COLUMNS = (
    "layout",
    "MB",
    "situation",
    "TTFT ms: limit / mlx-lm / bank",
    "mlx-lm / bank",
    "bank / limit",
    "tokens restored: mlx-lm / bank",
    "bank ms: restore / prefill (forward) / own",
    "mlx-lm ms: copy or load / forward",
    "logits vs limit: mlx-lm / bank",
)


def first_token_section(r: dict[str, Any]) -> list[str]:
    ft = r.get("first_token")
    if not ft:
        return []
    rows = [_situation_row(c, *sit) for c in ft["cases"] for sit in _SITUATIONS if sit[0] in c]
    L = [*_FIRST_TOKEN_INTRO, *_table(list(_FIRST_TOKEN_COLUMNS), rows)]
    serve_rows = [
        _serve_row(c, *sit)
        for c in ft["cases"]
        for sit in _SERVE_SITUATIONS
        if sit[0] in c and sit[-1] in c[sit[0]]
    ]
    if serve_rows:
        L += [*_SERVE_INTRO, *_table(list(_SERVE_COLUMNS), serve_rows)]
    L += [
        "A restore with room in the same process (the bank's restore in (a), alone, "
        "evaluated): as the defaults run it (a lease restored again is copied ahead by "
        "the spares' thread, off the restore's path) and with its copy on its path "
        "(copies ahead off), against a memcpy of the same bytes into memory touched "
        "beforehand (one core, two) and mlx-lm's file load; target >= 2x the file, "
        "with the copy on the path.",
        "",
    ]
    L += _table(
        [
            "layout",
            "MB",
            "restore ms: copied ahead / on path (GB/s on path)",
            "memcpy ms: 1 / 2 cores",
            "on path, of memcpy's speed: 1 / 2 cores",
            "file load ms",
            "file / restore: copied ahead / on path",
        ],
        [_hot_row(c) for c in ft["cases"]],
    )
    if ft.get("problems"):
        L += ["**Problems found:**", ""] + [f"- {p}" for p in ft["problems"]] + [""]
    return L


def _situation_row(
    c: dict[str, Any], key: str, label: str, other: str, name: str, bank: str
) -> list[str]:
    s = c[key]
    lim, o, k = s["limit"], s[other], s[bank]
    cold = s.get("cold_prefill_at_least_s")
    return [
        c["layout"],
        _mb(c["kv_bytes"]),
        label + (f" (LRU empty: a cold prefill, >= {_seconds(cold)})" if cold else ""),
        f"{_ms(lim['ttft_s'])} / {_ms(o['ttft_s'])} ({name}) / {_ms(k['ttft_s'])}",
        f"{s['ratios'][f'{other}_over_{bank}']:.2f}x",
        f"{s['ratios'][f'{bank}_over_limit']:.2f}x",
        f"{o['restored']:.0f} / {k['restored']:.0f}",
        f"{_ms(k['restore_s'])} / {_ms(k['prefill_s'])} ({_ms(k['forward_s'])}) / "
        f"{_ms(k.get('own_s'))}",
        f"{_ms(o.get('fetch_s', o.get('load_s')))} / {_ms(o['forward_s'])}",
        f"{o['logits_max_diff']:.1e} / {k['logits_max_diff']:.1e}",
    ]


def _serve_row(
    c: dict[str, Any], key: str, label: str, other: str, name: str, lib: str, way: str
) -> list[str]:
    s = c[key]
    v = s[way]
    r = s["ratios"]
    beside = v.get("beside_ttft_s") or {w: s[w]["ttft_s"] for w in ("limit", other, lib)}
    return [
        c["layout"],
        _mb(c["kv_bytes"]),
        label,
        f"{_ms(beside['limit'])} / {_ms(beside[other])} ({name}) / {_ms(beside[lib])} / "
        f"{_ms(v['ttft_s'])}",
        f"{r[f'{other}_over_{way}']:.2f}x",
        f"{r[f'{way}_over_limit']:.2f}x",
        f"{r[f'{way}_over_{lib}']:.2f}x",
        f"{v['restored']:.0f} / {v['prefilled']:.0f}",
        f"{_ms(v['engine_s'])} ({_ms(v.get('restore_s'))} / {_ms(v['forward_s'])} / "
        f"{_ms(v.get('engine_rest_s'))}) / {_ms(v['http_s'])}",
        f"{v.get('rounds', s['rounds']):.0f} of {s['rounds']}",
    ]


def _hot_row(c: dict[str, Any]) -> list[str]:
    h = c["hot_restore"]
    return [
        c["layout"],
        _mb(c["kv_bytes"]),
        f"{_ms(h['restore_s'])} / {_ms(h['on_path_s'])} ({h['on_path_gbps']:.2f})",
        f"{_ms(h['memcpy_s'])} / {_ms(h['memcpy_2_threads_s'])}",
        f"{h['on_path_of_memcpy']:.2f} / {h['on_path_of_memcpy_2_threads']:.2f}",
        _ms(h["file_load_s"]),
        f"{h['file_load_over_restore']:.2f}x / {h['file_load_over_on_path']:.2f}x",
    ]


def _tokens(n: float | None) -> str:
    if n is None:
        return "never"
    return "< 1" if n < 1 else f"{n:.0f}"


def prefill_or_restore_section(r: dict[str, Any]) -> list[str]:
    ft = r.get("first_token")
    if not ft or not ft.get("prefill_or_restore"):
        return []
    layouts = ft["prefill_or_restore"]
    pubs = ft.get("published_prefill", [])
    return [
        "## Where prefilling beats restoring",
        "",
        _PREFILL_OR_RESTORE_METHOD,
        "",
        *_measured_points(layouts),
        *_crossovers(layouts, pubs),
        _PREFILL_OR_RESTORE_READING + _published(pubs) + ".",
        "",
    ]


_PREFILL_OR_RESTORE_METHOD = (
    "Per layout, on this machine: a cold prefill of a prompt (the model alone, mlx-lm's "
    "chunks) against the restore of a stored prefix of as many tokens, library "
    "defaults, from a bank opened again before each restore (page cache warm) and "
    "again in the same process (hot); the longer lengths are the first-token cases' "
    "restores (a prefill of them is minutes here). Lines fitted by least squares, "
    "prefill(L) = a_p + b_p L and restore(L) = a_r + b_r L (reopened), cross at "
    "L* = (a_r - a_p) / (b_p - b_r)."
)
_PREFILL_OR_RESTORE_READING = (
    "The Apple silicon columns are estimates, not measurements: L* = a_r / (1/R - b_r), "
    "this machine's restore line against a published mlx-lm prefill rate R (Apple "
    "silicon's memory is faster than this machine's, so its restores should be no "
    "slower: the estimate leans towards prefilling). Below L* prefilling is faster; a "
    "model that prefilled faster than the 'prefill faster than any restore above' rate "
    "would never gain by restoring. The medium layouts' models (60-80M parameters) are "
    "smaller than any published one, so on a Mac they would prefill faster than the "
    "fastest rate here: read the first column as the nearest. The restore line is "
    "of a warm page cache; from a cold disk each token costs its bytes at the disk's "
    "speed too. Rates used: "
)


def _measured_points(layouts: list[dict[str, Any]]) -> list[str]:
    """Each measured length: the prefill against the restore, reopened and hot."""
    rows = [
        [
            lay["model"],
            str(p["tokens"]),
            _ms(p["prefill_s"]),
            _ms(p["reopened_s"]),
            _ms(p["hot_s"]),
            "–" if p["prefill_s"] is None else "yes" if p["reopened_s"] < p["prefill_s"] else "no",
        ]
        for lay in layouts
        for p in lay["points"]
    ]
    return _table(
        ["layout", "tokens", "prefill ms", "restore ms: reopened", "hot", "restore faster"],
        rows,
    )


def _crossovers(layouts: list[dict[str, Any]], pubs: list[dict[str, Any]]) -> list[str]:
    """Per layout: the shortest prefix worth restoring, measured and fitted, here and
    estimated for Apple silicon."""
    head = [
        "layout",
        "KV bytes / token",
        "shortest prefix measured whose restore beats its prefill",
        "crossover here (fitted)",
        "prefill ms / token here",
        "restore: ms + us / token",
        "prefill faster than any restore above",
        *[f"Apple silicon est.: {p['model']}, {p['chip']}" for p in pubs],
    ]
    return _table(head, [_crossover_row(lay) for lay in layouts])


def _crossover_row(lay: dict[str, Any]) -> list[str]:
    shortest = lay["shortest_measured_faster"]
    slower = lay["longest_measured_slower"]
    beaten = lay["restore_beaten_above_tokens_per_s"]
    return [
        lay["model"],
        f"{lay['kv_bytes_per_token']:.0f}",
        "none measured"
        if shortest is None
        else f"{shortest} tokens"
        + ("" if slower else " (the shortest measured: restore wins at every length)"),
        f"{_tokens(lay['crossover_here_tokens'])} tokens",
        f"{lay['prefill_line']['per_token_s'] * 1e3:.2f}",
        f"{lay['restore_line']['intercept_s'] * 1e3:.2f} + "
        f"{lay['restore_line']['per_token_s'] * 1e6:.2f}",
        "–" if beaten is None else f"{beaten:,.0f} tokens/s",
        *[f"{_tokens(a['crossover_tokens'])} tokens" for a in lay["apple_estimate"]],
    ]


def _published(pubs: list[dict[str, Any]]) -> str:
    """The published rates, grouped by their source."""
    by_source: dict[str, list[str]] = {}
    for p in pubs:
        by_source.setdefault(p["source"], []).append(
            f"{p['model']} {p['tokens_per_s']:,.0f} tokens/s on {p['chip']} "
            f"({p['prompt']:,}-token prompt)"
        )
    return "; ".join(f"{', '.join(v)}: {k}" for k, v in by_source.items())
