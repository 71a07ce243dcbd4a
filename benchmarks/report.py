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
from benchmarks.targets import WAY_LABELS
from benchmarks.targets import mb as _mb
from benchmarks.targets import ms as _ms


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return [*out, ""]


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
    L += _ttft_section(r)
    L += _restore_section(r)
    L += _overhead_section(r)
    L += _fleet_section(r)
    L += _admission_section(r)
    L += _remote_section(r)
    L += _scale_section(r)
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


def _ttft_section(r: dict[str, Any]) -> list[str]:
    t = r.get("ttft")
    if not t:
        return []
    L = ["## Time to first token", "", "![TTFT against prompt length](ttft.png)", ""]
    rows = []
    for c in t["cases"]:
        for way, label in WAY_LABELS.items():
            rows.append(
                [
                    c["model"],
                    str(c["tokens"]),
                    label,
                    _ms(c["ttft_s"][way]),
                    _ms(c["restore_s"].get(way)),
                    str(c["restored"][way]),
                    _mb(c["bytes_on_disk"].get(way)),
                    "–" if way == "cold" else f"{c['logits_max_diff'][way]:.1e}",
                ]
            )
    L += _table(
        [
            "model",
            "prompt",
            "way",
            "TTFT ms",
            "restore/load ms",
            "tokens reused",
            "MB on disk",
            "logits vs cold",
        ],
        rows,
    )
    rows = []
    for c in t["cases"]:
        f, ce = c["fractions"], c["ceilings"]
        rows.append(
            [
                c["model"],
                str(c["tokens"]),
                _mb(c["kv_bytes"]),
                f"{_ms(c['restore_s']['cas_bank_rocksdb'])} / "
                f"{_ms(ce['raw_read_plus_memcpy_s'])} = {f['rocksdb_restore_of_ceiling']:.2f}",
                f"{_ms(c['restore_s']['cas_bank_hot'])} / {_ms(ce['memcpy_s'])} = "
                f"{f['hot_restore_of_memcpy']:.2f}",
                f"{f['file_load_over_rocksdb_restore']:.2f}",
                f"{c['hot_hits_per_request']:.0f}",
                f"{c['store']['store_s'] * 1e3:.1f} ms ({f['store_share_of_prefill']:.1%})",
            ]
        )
    L += [
        "Against the ceilings, on the same bytes "
        "(restore ms / ceiling ms = fraction of the ceiling's speed):",
        "",
    ]
    L += _table(
        [
            "model",
            "prompt",
            "KV MB",
            "RocksDB restore vs raw read + memcpy",
            "hot restore vs memcpy",
            "file load / RocksDB restore",
            "hot hits per request",
            "store (share of its prefill)",
        ],
        rows,
    )
    if t.get("problems"):
        L += ["**Problems found:**", ""] + [f"- {p}" for p in t["problems"]] + [""]
    return L


def _restore_section(r: dict[str, Any]) -> list[str]:
    rs = r.get("restore")
    if not rs:
        return []
    L = [
        "## Restore alone at the medium models' sizes",
        "",
        "The medium models' real cache layouts filled with random KV (no prefill needed): "
        "time to a ready, evaluated cache. GB/s are of the cache's bytes.",
        "",
    ]
    rows = []
    for c in rs["cases"]:
        g, f = c["gbps"], c["fractions"]
        rows.append(
            [
                c["model"],
                str(c["tokens"]),
                _mb(c["kv_bytes"]),
                f"{_ms(c['file_load_s'])} ({g['file_load']:.2f})",
                f"{_ms(c['rocksdb_restore_s'])} ({g['rocksdb_restore']:.2f})",
                f"{_ms(c['file_copy_s'])} / {_ms(c['verified_floor_s'])} "
                f"({f['rocksdb_restore_of_ceiling']:.2f})",
                f"{_ms(c['hot_restore_s'])} ({g['hot_restore']:.2f})",
                f"{_ms(c['memcpy_s'])} ({f['hot_restore_of_memcpy']:.2f})",
                f"{_mb(c['bytes_on_disk']['mlx_lm_file'])} / {_mb(c['bytes_on_disk']['cas_bank'])}",
            ]
        )
    L += _table(
        [
            "model",
            "tokens",
            "MB",
            "mlx-lm file load ms (GB/s)",
            "RocksDB restore ms (GB/s)",
            "files: plain copy / verified floor ms (fraction of the floor)",
            "hot restore ms (GB/s)",
            "memcpy ms (fraction)",
            "MB on disk: file / bank",
        ],
        rows,
    )
    L += _against_file(rs)
    return L


def _against_file(rs: dict[str, Any]) -> list[str]:
    """Issue 11's table: each way against mlx-lm's own file, at >= 64 MB and below."""
    L = [
        "",
        "### Restore against mlx-lm's file",
        "",
        "Ratios are file time / cas_bank time (>= 1.0: cas_bank is as fast or faster). "
        "Reopened: the bank closed and opened again before each request, page cache warm "
        "as for the file; every payload verified. Hot: the process that stored the prefix "
        "(its lease). TTFT: the restore (or load) and the first prefill token through the "
        "model, evaluated; targets >= 1.0x reopened, >= 1.3x hot; restore alone: >= 1.0x "
        "reopened, >= 2x hot.",
        "",
        "Floors, measured in the same run on the same bytes. A reopened restore verifies "
        "every payload: each byte is copied out of the page cache once (all the file "
        "load does, on both cores: MLX reads a file on several threads) and hashed once "
        "(blake3, ~3.3 GB/s a core with its AVX2 code). The verified floor is the bank's "
        "own payload files read that way by the native reader on both cores, with no "
        "index, allocation or Python between: `best` = file load / verified floor is the "
        "most a verified restore can reach against the file on this machine, so the "
        "reopened target of 1.0x is out of reach wherever `best` < 1.0; the target then "
        "is the floor itself (`of floor`: the restore's speed as a fraction of it). `alloc` "
        "is one part of what lies between: allocating the restore's destination arrays "
        "(fresh, unfilled above 1 MiB an array), which the floor does not pay. TTFT's "
        "floor is the first token's forward pass on a cache already in memory: `TTFT "
        "best` = file TTFT / that forward is the most any restore can reach, so the hot "
        "TTFT target of 1.3x is out of reach where it is below 1.3 (the medium models' "
        "forward pass on this CPU's reference BLAS dwarfs every load).",
        "",
    ]
    rows = []
    for c in rs["cases"]:
        f, t = c["fractions"], c.get("ttft_s")
        if t is None:
            continue
        rows.append(
            [
                c["model"],
                str(c["tokens"]),
                _mb(c["kv_bytes"]),
                f"{_ms(c['file_load_s'])} / {_ms(c['rocksdb_restore_s'])} / "
                f"{_ms(c['hot_restore_s'])}",
                f"{f['file_load_over_rocksdb_restore']:.2f}x",
                f"{f['file_load_over_floor']:.2f}x",
                f"{f['rocksdb_restore_of_ceiling']:.2f}",
                _ms(c["alloc_s"]) if "alloc_s" in c else "-",
                f"{f['file_load_over_hot_restore']:.2f}x",
                f"{_ms(t['file'])} / {_ms(t['reopened'])} / {_ms(t['hot'])}",
                f"{f['file_ttft_over_reopened_ttft']:.2f}x",
                f"{f['file_ttft_over_hot_ttft']:.2f}x",
                f"{f['file_ttft_over_forward']:.2f}x",
            ]
        )
    L += _table(
        [
            "model",
            "tokens",
            "MB",
            "restore ms: file / reopened / hot",
            "reopened",
            "best",
            "of floor",
            "alloc ms",
            "hot",
            "TTFT ms: file / reopened / hot",
            "TTFT reopened",
            "TTFT hot",
            "TTFT best",
        ],
        rows,
    )
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
