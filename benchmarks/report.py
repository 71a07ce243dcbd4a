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
from benchmarks.report_first_token import first_token_section, prefill_or_restore_section
from benchmarks.report_remote import remote_fleet_sections
from benchmarks.report_restore import restore_section, ttft_section
from benchmarks.report_workloads import (
    admission_section,
    branching_section,
    fleet_section,
    scale_section,
    server_store_section,
)
from benchmarks.targets import mb as _mb
from benchmarks.targets import ms as _ms
from benchmarks.targets import table as _table
from benchmarks.vlm_agents import markdown as vlm_agents_section


def write_markdown(r: dict[str, Any], path: Path) -> None:
    path.write_text("\n".join(render(r)) + "\n")


def render(r: dict[str, Any]) -> list[str]:
    """Every section of RESULTS.md, in order."""
    return [
        *_header(r),
        *_machine_section(r),
        *_targets_section(r),
        *_ceilings_section(r),
        *ttft_section(r),
        *restore_section(r),
        *first_token_section(r),
        *prefill_or_restore_section(r),
        *_overhead_section(r),
        *server_store_section(r),
        *fleet_section(r),
        *admission_section(r),
        *branching_section(r),
        *_remote_section(r),
        *remote_fleet_sections(r),
        *scale_section(r),
        *_eviction_section(r),
        *vlm_agents_section(r),
        *cuda_section(),
        *_notes(r),
    ]


def _header(r: dict[str, Any]) -> list[str]:
    m = r["machine"]
    return [
        "# cas_bank benchmarks: side by side",
        "",
        f"Written by `{r['command']}` ({r['mode']} sizes) on {m['date']}, commit {m['commit']}, "
        f"in {r['total_s']:.0f} s. Every figure below comes from this one run; ratios compare "
        "figures measured minutes apart on the same machine.",
        "",
        *_parts_line(r),
    ]


def _machine_section(r: dict[str, Any]) -> list[str]:
    m = r["machine"]
    v = m["versions"]
    rows = [
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
            "spare restore destinations (each bank's, `BankConfig.spare_bytes`)",
            "yes" if m.get("spare_destinations") else "no",
        ],
    ]
    return ["## Machine", "", *_table(["what", "value"], rows)]


def _targets_section(r: dict[str, Any]) -> list[str]:
    """Every target, met or missed, and where the time goes in a missed one."""
    L = ["## Targets", ""]
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
    return L


def _ceilings_section(r: dict[str, Any]) -> list[str]:
    c = r.get("ceilings")
    if not c:  # a run of other parts (`--parts`)
        return []
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
    return ["## Ceilings of this machine", "", *_table(["ceiling", "figure", "size"], rows)]


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


def _eviction_section(r: dict[str, Any]) -> list[str]:
    ev = r.get("eviction_policy")
    if not ev:
        return []
    s = ev["settings"]
    L = [
        "## Eviction order on a mixed workload",
        "",
        f"`benchmarks/eviction_policy.py`: {s['requests']} requests (agents on a few shared "
        "system prompts that change halfway, one-off long prompts, multi-turn "
        "conversations) on a real bank under a disk budget, each order "
        "(`BankConfig.eviction_policy`) on the same requests. Hit rate: restored / prompt "
        "tokens; prefilled: prompt tokens not restored.",
        "",
    ]
    rows = []
    for res in ev["results"]:
        k = res["by_kind"]
        rows.append(
            [
                str(res["budget_tokens"]),
                res["policy"],
                f"{res['token_hit_rate']:.3f}",
                f"{res['request_hit_rate']:.3f}",
                str(res["prefilled_tokens"]),
                f"{k['agent']['token_hit_rate']:.3f}",
                f"{k['one_off']['token_hit_rate']:.3f}",
                f"{k['conversation']['token_hit_rate']:.3f}",
            ]
        )
    L += _table(
        [
            "budget tokens",
            "order",
            "hit rate",
            "requests hit",
            "prefilled",
            "agents",
            "one-off",
            "conversations",
        ],
        rows,
    )
    return [*L, ""]


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
        "(`cas_bank.restore.spares`). The process's objects are frozen out of Python's garbage "
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
