"""RESULTS.md sections of the shared tier under load and at a network's latency
(`benchmarks/remote_load.py`, `benchmarks/remote_rtt.py`)."""

from __future__ import annotations

from typing import Any

from benchmarks.targets import mb, ms, table


def remote_fleet_sections(r: dict[str, Any]) -> list[str]:
    return _rtt_section(r) + _prefetch_section(r) + _load_section(r)


def _prefetch_section(r: dict[str, Any]) -> list[str]:
    pf = r.get("remote_prefetch")
    if not pf:
        return []
    s = pf["settings"]
    L = [
        "## Prefetch in the server's queue",
        "",
        f"One engine worker ({s['model']}), {s['clients']} clients at once: a cold "
        f"{s['busy_tokens']}-token prompt keeps the worker busy while {s['clients'] - 1} "
        f"requests of {s['tokens']} tokens stored by another host wait (cluster at "
        f"{ms(s['rtt'])} ms added RTT). Medians of the cluster-sourced requests.",
        "",
    ]
    rows = []
    for name in ("prefetch_off", "prefetch_on"):
        x = pf[name]
        rows.append(
            [name.replace("_", " "), ms(x["ttft_s"]), ms(x["submit_to_first_token_s"]),
             str(x["remote_hit_blocks"]), str(x["prefetched_blocks"])]
        )  # fmt: skip
    L += table(
        ["mode", "worker TTFT ms", "submit to first token ms", "blocks restored from the cluster",
         "blocks prefetched"],
        rows,
    )  # fmt: skip
    return L


def _rtt_section(r: dict[str, Any]) -> list[str]:
    rt = r.get("remote_rtt")
    if not rt:
        return []
    s = rt["settings"]
    L = [
        "## Shared tier at a network's latency (a delaying proxy per node, loopback)",
        "",
        f"{s['model']} KV (synthetic), 3 masters; each node announces a proxy that holds "
        "every chunk half the added round trip in each direction. Medians of "
        f"{s['repeats']}; round trips counted by the client for one restore.",
        "",
    ]
    rows = []
    for row in rt["by_rtt"]:
        for n in s["tokens"]:
            x = row[str(n)]
            cold = ms(x["cold_prefill_s"]) if x["cold_prefill_s"] is not None else "–"
            rows.append(
                [ms(row["added_rtt_s"]), ms(row["measured_rtt_s"]), str(n), ms(x["local_s"]),
                 ms(x["cluster_s"]), str(x["round_trips"]), mb(x["fetched_bytes"]), cold]
            )  # fmt: skip
    L += table(
        ["added RTT ms", "measured GET ms", "tokens", "local ms", "cluster ms", "round trips",
         "fetched MB", "cold prefill ms"],
        rows,
    )  # fmt: skip
    L += table(
        ["added RTT ms", "first request after a node stops answering", "next request",
         "read time-out setting"],
        [[ms(row["added_rtt_s"]), ms(row["breaker"]["first_s"]), ms(row["breaker"]["next_s"]),
          ms(row["breaker"]["remote_timeout_setting_s"])] for row in rt["by_rtt"]],
    )  # fmt: skip
    return L


def _load_section(r: dict[str, Any]) -> list[str]:
    ld = r.get("remote_load")
    if not ld:
        return []
    s = ld["settings"]
    L = [
        "## Shared tier under sustained load",
        "",
        f"{s['clients']} client processes against one 3-master cluster for {s['seconds']:.0f} s "
        f"(this machine's cores shared by clients and nodes): each restores random prompts "
        f"of {s['prompt_blocks']} blocks of {s['block_size']} tokens (8 KiB per token) from "
        f"{s['prompts']} in the cluster, into a read-only bank (every restore from the "
        f"cluster), checks each bit for bit, and stores a prompt of its own every "
        f"{s['publish_every']} restores.",
        "",
    ]
    L += table(
        ["figure", "value"],
        [
            ["restores", str(ld["restores"])],
            ["restores/s", f"{ld['restores_per_s']:.1f}"],
            ["p50 / p99 restore", f"{ms(ld['p50_s'])} / {ms(ld['p99_s'])} ms"],
            ["out of the cluster", f"{ld['gb_per_s_out']:.3f} GB/s"],
            ["stores / published entries / publishes dropped",
             f"{ld['stores']} / {ld['published']} / {ld['publishes_dropped']}"],
            ["wrong restores / short / rejected / errors",
             f"{ld['wrong']} / {ld['short']} / {ld['rejected']} / {ld['errors']}"],
            ["cluster used_memory (masters)", mb(ld["cluster_used_memory"]) + " MB"],
            ["cluster CPU (nodes, share of one core)", f"{ld['cluster_cpu_share']:.2f}"],
        ],
    )  # fmt: skip
    return L
