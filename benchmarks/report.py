"""RESULTS.md of `benchmarks.run`: the machine, the targets, every table, the method.

A pure function of the results dict (as `results.json` holds it), so a report can be
re-rendered from a saved JSON: `python -m benchmarks.report benchmarks/results.json`.
Every target row says met or missed; nothing is left out because it looks bad.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.plot import write_plot
from benchmarks.report_cuda import cuda_section
from benchmarks.report_remote import remote_fleet_sections
from benchmarks.report_restore import restore_section, ttft_section
from benchmarks.targets import mb as _mb
from benchmarks.targets import ms as _ms
from benchmarks.targets import table as _table


def write_markdown(r: dict[str, Any], path: Path) -> None:
    path.write_text("\n".join(render(r)) + "\n")


def render(r: dict[str, Any]) -> list[str]:
    m = r["machine"]
    v = m["versions"]
    L = [
        "# cas_bank benchmarks: side by side",
        "",
        f"Written by `{r['command']}` ({r['mode']} sizes) on {m['date']}, commit {m['commit']}, "
        f"in {r['total_s']:.0f} s. Every figure below comes from this one run; ratios compare "
        "figures measured minutes apart on the same machine.",
        "",
        *_parts_line(r),
        "## Machine",
        "",
    ]
    L += _table(
        ["what", "value"],
        [
            ["CPU", m["cpu"]],
            ["cores (usable)", f"{m['cores']} ({m['cores_usable']})"],
            ["memory", f"{m['memory_gib']} GiB"],
            ["OS", m["os"]],
            ["python", m["python"]],
            ["mlx / mlx-lm", f"{v['mlx']} / {v['mlx-lm']}"],
            ["rocksdict / numpy / blake3", f"{v['rocksdict']} / {v['numpy']} / {v['blake3']}"],
            [
                "load average (1, 5, 15 min) at start / end",
                f"{', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])} / "
                f"{', '.join(f'{x:.1f}' for x in m['load_avg_at_end'])}",
            ],
            [
                "freed memory reused (`keep_freed_memory`, as `cas-bank serve` runs)",
                "yes" if m.get("keep_freed_memory") else "no",
            ],
            [
                "spare restore destinations (`keep_spare_destinations`, as the servers run)",
                "yes" if m.get("spare_destinations") else "no",
            ],
        ],
    )
    L += ["## Targets", ""]
    L += _table(
        ["target", "where", "measured", "status"],
        [
            [t["target"], t["where"], t["measured"], "met" if t["met"] else "**missed**"]
            for t in r["targets"]
        ],
    )
    missed = [t for t in r["targets"] if not t["met"] and t.get("why")]
    if missed:
        L += ["Where the time goes in a missed target (cProfile, own time, top functions):", ""]
        L += [f"- {t['target']} ({t['where']}): {t['why']}" for t in missed] + [""]

    c = r["ceilings"]
    L += ["## Ceilings of this machine", ""]
    rows = [
        [
            "memcpy (`np.copyto` into an allocated array)",
            f"{c['memcpy_gbps']:.2f} GB/s",
            f"{_mb(c['memcpy_bytes'])} MB",
        ],
        ["blake3, one thread, derive-key mode", f"{c['blake3_gbps']:.2f} GB/s", "1 MiB inputs"],
        [
            "XXH3-128, one thread (format 4's payload check)",
            f"{c['xxh3_gbps']:.2f} GB/s" if "xxh3_gbps" in c else "–",
            "1 MiB inputs",
        ],
    ]
    for rk in c["rocks"]:
        size = f"{rk['values']} x {rk['value_bytes'] // 1024} KiB"
        rows += [
            ["raw rocksdict put (bank options, WAL)", f"{rk['put_gbps']:.2f} GB/s", size],
            [
                "raw rocksdict get after reopen (no checksum)",
                f"{rk['read_after_reopen_gbps']:.2f} GB/s",
                size,
            ],
            ["raw rocksdict get, warm", f"{rk['warm_read_gbps']:.2f} GB/s", size],
        ]
    L += _table(["ceiling", "figure", "size"], rows)
    L += ttft_section(r)
    L += restore_section(r)
    L += _overhead_section(r)
    L += _server_store_section(r)
    L += _fleet_section(r)
    L += _admission_section(r)
    L += _branching_section(r)
    L += _remote_section(r)
    L += remote_fleet_sections(r)
    L += _scale_section(r)
    L += cuda_section()
    L += _notes(r)
    return L


def _remote_section(r: dict[str, Any]) -> list[str]:
    rt = r.get("remote")
    if not rt:
        return []
    s, f = rt["settings"], rt["fleet"]
    alone, shared = f["hosts_alone"], f["hosts_sharing_cluster"]
    L = [
        "## Shared tier (a real 3-master Valkey cluster on loopback)",
        "",
        f"{s['hosts']} hosts (one bank each), {s['agents']} agents sharing a "
        f"{s['system_tokens']}-token system prompt, {s['turns']} turns of "
        f"{s['distinct_tokens']} own tokens, {s['model']}; every turn each agent lands on "
        "another host.",
        "",
    ]
    L += _table(
        ["fleet", "hit rate", "restored / queried tokens", "from the cluster", "rejected"],
        [
            ["hosts alone", f"{alone['hit_rate']:.1%}",
             f"{alone['restored_tokens']} / {alone['queried_tokens']}", "–", "–"],
            ["hosts sharing the cluster", f"{shared['hit_rate']:.1%}",
             f"{shared['restored_tokens']} / {shared['queried_tokens']}",
             str(shared["remote_hit_tokens"]), str(shared["rejected"])],
        ],
    )  # fmt: skip
    rs, b, d = rt["restore"], rt["cluster_bytes"], rt["cluster_down"]
    L += [f"The same {rs['tokens']}-token prefix, medians of {s['repeats']}:", ""]
    L += _table(
        ["way", "ms"],
        [
            ["local bank (RocksDB, hot tier off)", _ms(rs["local_s"])],
            ["cluster, into an empty bank (verified)", _ms(rs["cluster_s"])],
            ["cold prefill", _ms(rs["cold_prefill_s"])],
        ],
    )
    L += _table(
        ["cluster bytes", "value"],
        [
            ["MEMORY USAGE of every key", _mb(b["memory_usage"]) + " MB"],
            ["values alone", _mb(b["value_bytes"]) + " MB"],
            ["lower bound (distinct tokens' KV once)", _mb(b["lower_bound"]) + " MB"],
            ["ratio", f"{b['ratio_to_lower_bound']:.3f}"],
        ],
    )
    L += _table(
        ["cluster down (every master paused)", "first request", "later (median)"],
        [
            ["no shared tier", _ms(d["no_remote"]["first_s"]),
             _ms(d["no_remote"]["later_median_s"])],
            ["shared tier down", _ms(d["down"]["first_s"]), _ms(d["down"]["later_median_s"])],
            ["added", _ms(d["added_first_s"]), _ms(d["added_later_s"])],
        ],
    )  # fmt: skip
    return L


def _admission_section(r: dict[str, Any]) -> list[str]:
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


def _overhead_section(r: dict[str, Any]) -> list[str]:
    o = r.get("store_overhead")
    if not o:
        return []
    L = ["## What storing adds to a cold prefill", ""]
    L += _table(
        [
            "model",
            "tokens",
            "pairs",
            "without bank s",
            "with bank s",
            "added",
            "store alone s",
            "store / forward",
        ],
        [
            [
                o["model"],
                str(o["tokens"]),
                str(o["repeats"]),
                f"{o['without_bank_s']:.2f}",
                f"{o['with_bank_s']:.2f}",
                f"{o['added']:+.1%}",
                f"{o['store_s']:.4f}",
                f"{o['store_share']:.2%}",
            ]
        ],
    )
    return L


def _server_store_section(r: dict[str, Any]) -> list[str]:
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


def _fleet_section(r: dict[str, Any]) -> list[str]:
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
                f"{_mb(b['lower_bound_kv'])} MB / {b['states_kept']} states, "
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


def _branching_section(r: dict[str, Any]) -> list[str]:
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
    rows = []
    for run in b["runs"].values():
        p50 = run["restore_p50_s"]
        rows.append(
            [
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
        )
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
        rows,
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


def _scale_section(r: dict[str, Any]) -> list[str]:
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


def _parts_line(r: dict[str, Any]) -> list[str]:
    """Which parts this run measured, when not all of them (`--parts`)."""
    from benchmarks.run import PARTS

    ran = r.get("parts", list(PARTS))
    left = [p for p in PARTS if p not in ran]
    if not left:
        return []
    return [
        f"Parts run: {', '.join(ran)}; not run this time (no section below): {', '.join(left)}.",
        "",
    ]


def _notes(r: dict[str, Any]) -> list[str]:
    wall = ", ".join(f"{k} {v:.0f} s" for k, v in r["wall_s"].items())
    return [
        "## How these were measured",
        "",
        "- Medians of a few repeats; `results.json` keeps the settings and the raw figures. "
        f"Wall time per part: {wall}.",
        "- Prompts are L+1 tokens: the file and the bank reuse the same L tokens and both "
        "prefill one. The models are the embedded ones with seeded random weights, float32, "
        "on MLX's CPU build.",
        "- 'RocksDB after reopen' closes and reopens the bank before each request; the OS "
        "page cache stays warm, as it does for the mlx-lm file it is compared with. The hot "
        "tier is the same request again in the same process (its hits are counted, and checked).",
        "- At the medium models' sizes the ways are interleaved (one of each per round, "
        "their order rotated each round; TTFT ratios are medians of each round's ratio) and "
        "the spare destinations a restore asked for are made before the next is timed: "
        "after its forward pass, as `PrefixCache.prefill` releases them in a runtime "
        "(`cas_bank.spares`). The process's objects are frozen out of Python's garbage "
        "collector before the rounds, as the servers freeze theirs at startup "
        "(`cas_bank.runtime.process`).",
        "- Each cas_bank request is `PrefixCache.restore` then `PrefixCache.prefill` of the "
        "rest (which also looks up what to store). Logits of every way are compared with the "
        "cold prefill's.",
        "- The machine has 2 cores and other work ran beside this run (see the load averages): "
        "compare figures within this run, not across runs.",
    ]


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[1]).parent
    write_markdown(data, out / "RESULTS.md")
    write_plot(data, out / "ttft.png")
