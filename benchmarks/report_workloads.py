"""RESULTS.md's sections on workloads beyond one restore: stores off the server's request
path, the fleet of agents, admission policies, branching agents (partial blocks), and
the bank at scale. Pure functions of the results dict, as `benchmarks.report`."""

from __future__ import annotations

from typing import Any

from benchmarks.targets import mb as _mb
from benchmarks.targets import ms as _ms
from benchmarks.targets import table as _table


def admission_section(r: dict[str, Any]) -> list[str]:
    a = r.get("admission")
    if not a:
        return []
    s = a["settings"]
    L = [
        "## Writing less: admission policies",
        "",
        f"The fleet again ({s['agents']} agents on {s['model']}, a {s['system_tokens']}-token "
        f"system prompt, {s['distinct_tokens']} new tokens per agent per turn, {s['turns']} "
        "turns) under each `BankConfig.admit`: bytes written to the bank against hit rate.",
        "",
    ]
    rows = [
        [
            name,
            _mb(p["bytes_written"]),
            str(p["blocks_deferred"]),
            f"{p['hit_rate']:.1%}",
            _mb(p["bank_dir_bytes"]),
            _ms(p["ttft_p50_s"]),
            str(p["misses"]),
        ]
        for name, p in a["policies"].items()
    ]
    L += _table(
        [
            "admit",
            "MB written",
            "blocks deferred",
            "hit rate",
            "MB on disk",
            "TTFT p50 ms",
            "requests that restored nothing",
        ],
        rows,
    )
    return L


def server_store_section(r: dict[str, Any]) -> list[str]:
    o = r.get("server_store")
    if not o:
        return []
    s = o["settings"]
    L = [
        "## Stores off the request path, in the server",
        "",
        f"`benchmarks/server_store.py`: three `cas-bank serve` apps of {s['model']} in one "
        f"process, a new {s['tokens']}-token prompt per request (nothing to restore), "
        f"{s['max_tokens']} tokens streamed, {s['rounds']} request(s) per mode (medians), the "
        "modes interleaved in a rotated order each round, the writer drained between requests "
        "(`writer s`). `store on path` is "
        "the prefill's store as the request paid it (inline: the write; background: the "
        "snapshot and queueing).",
        "",
    ]
    rows = []
    for mode in ("background", "inline", "off"):
        m = o["modes"][mode]
        rows.append(
            [
                mode,
                f"{m['ttft_s']:.3f}",
                f"{m['total_s']:.3f}",
                f"{m['ttft_over_off']:.3f}x" if "ttft_over_off" in m else "1x",
                f"{m['store_on_path_s'] * 1e3:.1f}",
                f"{m['writer_s'] * 1e3:.1f}",
                _mb(m["bytes_written"]),
            ]
        )
    L += _table(
        [
            "stores",
            "TTFT s",
            "total s",
            "TTFT / not storing",
            "store on path ms",
            "writer ms",
            "MB written",
        ],
        rows,
    )
    return L


def fleet_section(r: dict[str, Any]) -> list[str]:
    f = r.get("fleet")
    if not f:
        return []
    s, b, t = f["settings"], f["bytes"], f["ttft"]
    L = [
        "## Fleet",
        "",
        f"{s['agents']} agents on {s['model']}, a {s['system_tokens']}-token shared system prompt, "
        f"{s['distinct_tokens']} distinct tokens per agent per turn, {s['turns']} turns: "
        f"{f['requests']} requests in {f['serve_s']:.0f} s.",
        "",
    ]
    L += _table(
        ["figure", "value"],
        [
            ["cas_bank directory (every file)", f"{_mb(b['cas_bank_dir'])} MB"],
            ["  of which tables and blob files", f"{_mb(b['cas_bank_tables_and_blobs'])} MB"],
            ["lower bound (distinct KV once + kept states)", f"{_mb(b['lower_bound'])} MB"],
            [
                "  distinct KV / states kept",
                f"{_mb(b['lower_bound_kv'])} MB / {b['states_kept']} states "
                f"({b.get('end_states_kept', 0)} of them in end records), "
                f"{_mb(b['lower_bound_states'])} MB",
            ],
            ["ratio to the lower bound", f"{b['ratio_to_lower_bound']:.3f}"],
            [
                "mlx-lm session files, latest per agent",
                f"{_mb(b['session_files_latest'])} MB ({b['session_over_cas_bank']:.1f}x cas_bank)",
            ],
            ["mlx-lm session files, every turn kept", f"{_mb(b['session_files_all_turns'])} MB"],
            ["hit rate (tokens restored / tokens asked)", f"{f['hit_rate']:.1%}"],
            [
                "TTFT p50 / p99 / max",
                f"{_ms(t['p50_s'])} / {_ms(t['p99_s'])} / {_ms(t['max_s'])} ms",
            ],
            [
                "TTFT p50 / p99 of requests that hit",
                f"{_ms(t['warm_p50_s'])} / {_ms(t['warm_p99_s'])} ms",
            ],
            ["requests that restored nothing", str(t["misses"])],
            [
                "p50 split: restore / forward / store",
                " / ".join(_ms(x) + " ms" for x in f["split_p50_s"].values()),
            ],
        ],
    )
    return L


def branching_section(r: dict[str, Any]) -> list[str]:
    b = r.get("branching")
    if not b:
        return []
    s = b["settings"]
    L = [
        "## Partial blocks: agents branching at arbitrary points",
        "",
        f"{b['requests']} requests on {s['model']}: a {s['system_tokens']}-token system "
        f"prompt, each request the system prompt or an earlier request cut at a random "
        f"token past it, plus {s['own_tokens'][0]}-{s['own_tokens'][1]} new tokens "
        f"({b['queried_tokens']} tokens asked in all); each stored with its end record, as "
        "`cas-bank serve` stores. The same requests at every block size, restoring whole "
        'blocks only or with partial blocks (docs/design.md, "Partial blocks").',
        "",
    ]
    L += _table(
        [
            "block",
            "restore",
            "prefilled tokens",
            "hit rate",
            "from partial blocks",
            "blocks stored",
            "blocks per restore",
            "restore p50 ms",
            "TTFT p50 ms",
        ],
        [_branching_row(run) for run in b["runs"].values()],
    )
    runs = list(b["runs"].values())
    with_partial = [x for x in runs if x["partial"]]
    whole = [x for x in runs if not x["partial"]]
    if with_partial and whole:
        spread = [x["prefilled_tokens"] for x in with_partial]
        L += [
            "",
            f"With partial blocks every block size prefills {min(spread)}-{max(spread)} "
            f"tokens (whole blocks only: {min(x['prefilled_tokens'] for x in whole)}-"
            f"{max(x['prefilled_tokens'] for x in whole)}), so a larger block no longer costs "
            "attention-only models hit rate, and it stores and looks up fewer blocks. The "
            "default stays 64: a hybrid model takes no partial block (its state exists only "
            "at captured boundaries, which a larger block spaces further apart); 256 is the "
            'choice for attention-only models (README, "Choosing a block size").',
        ]
    return L


def _branching_row(run: dict[str, Any]) -> list[str]:
    """One block size, whole blocks only or with partial blocks."""
    p50 = run["restore_p50_s"]
    return [
        str(run["block_size"]),
        "partial" if run["partial"] else "whole blocks",
        str(run["prefilled_tokens"]),
        f"{run['hit_rate']:.1%}",
        str(run["partial_tokens"]),
        str(run["blocks_stored"]),
        f"{run['blocks_per_restore']:.1f}",
        "-" if p50 is None else _ms(p50),
        _ms(run["ttft_p50_s"]),
    ]


def scale_section(r: dict[str, Any]) -> list[str]:
    sc = r.get("scale")
    if not sc:
        return []
    st, ro, lk = sc["store"], sc["reopen"], sc["lookup"]
    L = [
        "## Scale",
        "",
        f"{sc['big_blocks']} blocks of {sc['settings']['block_size']} tokens (tiny payloads) "
        f"written in {sc['build_s']:.0f} s ({_mb(sc['big_dir_bytes'])} MB on disk), beside a "
        f"bank of {sc['small_blocks']}.",
        "",
    ]
    L += _table(
        ["figure", "cas_bank", "ceiling", "fraction of ceiling"],
        [
            [
                "store, blocks/s (all batches)",
                f"{st['blocks_per_s']:.0f}",
                f"{st['raw_put_blocks_per_s']:.0f} raw put",
                f"{st['fraction_of_raw']:.2f}",
            ],
            [
                "store, blocks/s first / last 8 batches",
                f"{st['first_batches_blocks_per_s']:.0f} / {st['last_batches_blocks_per_s']:.0f}",
                "",
                "",
            ],
            [
                "reopen 1M-block bank, ms",
                _ms(ro["big_s"]),
                _ms(ro["raw_big_s"]) + " raw open",
                f"{ro['fraction_of_raw']:.2f}",
            ],
            ["reopen small bank, ms", _ms(ro["small_s"]), _ms(ro["raw_small_s"]) + " raw open", ""],
            [
                f"lookup {lk['tokens']} tokens hit ({lk['blocks']} blocks) p50 / p99 ms",
                f"{_ms(lk['hit']['p50_s'])} / {_ms(lk['hit']['p99_s'])}",
                _ms(lk["ceiling_p50_s"]) + " blake3 chain + raw multi-get",
                f"{lk['fraction_of_ceiling']:.2f}",
            ],
            [
                f"lookup {lk['tokens']} tokens miss p50 / p99 ms",
                f"{_ms(lk['miss']['p50_s'])} / {_ms(lk['miss']['p99_s'])}",
                "",
                "",
            ],
            [
                f"lookup at block_size 64 ({lk['bs64']['blocks']} blocks) p50 / p99 ms",
                f"{_ms(lk['bs64']['hit']['p50_s'])} / {_ms(lk['bs64']['hit']['p99_s'])}",
                _ms(lk["bs64"]["ceiling_p50_s"]),
                f"{lk['bs64']['fraction_of_ceiling']:.2f}",
            ],
        ],
    )
    return L
