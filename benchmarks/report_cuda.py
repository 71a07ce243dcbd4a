"""RESULTS.md's section on MLX's CUDA build: figures measured on a GPU machine lent to
one session (`cuda_h200.json` beside this file), apart from the run the rest of the
report comes from, and kept in every report rendered after it.

The same benchmarks (`benchmarks.restore`, `benchmarks.ttft`) ran there twice: `before`,
restores filling numpy staging buffers that `mx.array` copied into MLX; `after`, filling
MLX's arrays in place (`cas_bank.arrays.fill_stream`). A later session ran them again
with and without moving the filled arrays to the GPU (`prefetch`: `cas_bank.restore.resources`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.targets import mb, ms, table, x

RECORD = Path(__file__).with_name("cuda_h200.json")


def cuda_section(path: Path = RECORD) -> list[str]:
    """The section, or nothing where no record is kept."""
    if not path.exists():
        return []
    rec = json.loads(path.read_text())
    m, before, after = rec["machine"], rec["before"], rec["after"]
    L = [
        "## MLX's CUDA build (a GPU machine, measured apart from this run)",
        "",
        f"Measured on {m['date']} on {m['gpu']}; host {m['host']}; Python {m['python']}, "
        f"mlx {m['versions']['mlx']}, mlx-lm {m['versions']['mlx-lm']}; native helpers "
        f"{m['native_helpers']}. Commands: "
        + "; ".join(f"`{c}`" for c in rec["commands"])
        + f". `before` is commit {before['commit']} ({before['fill']}); `after` is "
        f"{after['commit']} ({after['fill']}). Machine-readable: `benchmarks/{RECORD.name}`.",
        "",
    ]
    L += _restore_table(before["restore"], after["restore"])
    L += _ttft_table(before["ttft"], after["ttft"])
    if "prefetch" in rec:
        L += _prefetch_tables(rec["prefetch"])
    L += ["What this record shows (written with it):", ""]
    L += [f"- {note}" for note in rec["notes"]]
    return [*L, ""]


def _reopened(case: dict[str, Any]) -> str:
    """The reopened restore's time and its ratio to the file's load."""
    ratio = case["fractions"]["file_load_over_rocksdb_restore"]
    return f"{ms(case['rocksdb_restore_s'])} ({x(ratio)})"


def _by_case(r: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(c["model"], c["tokens"]): c for c in r["cases"]}


def _restore_table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    old = _by_case(before)
    rows = []
    for key, c in _by_case(after).items():
        b = old.get(key)
        f = c["fractions"]
        rows.append(
            [
                f"{key[0]} {key[1]}",
                mb(c["kv_bytes"]),
                ms(c["file_load_s"]),
                "–" if b is None else _reopened(b),
                _reopened(c),
                ms(c["verified_floor_s"]),
                f"{ms(c['hot_restore_s'])} ({x(f['file_load_over_hot_restore'])})",
                "–" if b is None else f"{x(b['fractions']['file_ttft_over_reopened_ttft'])}",
                x(f["file_ttft_over_reopened_ttft"]),
                x(f["file_ttft_over_hot_ttft"]),
            ]
        )
    head = [
        "model, tokens",
        "KV MB",
        "file load ms",
        "reopened, before ms (x file)",
        "reopened, after ms (x file)",
        "verified floor ms",
        "hot ms (x file)",
        "TTFT reopened before, x file",
        "TTFT reopened after, x file",
        "TTFT hot after, x file",
    ]
    return [
        "Restore at size (`benchmarks.restore`, spares kept as the servers run; medians of "
        "interleaved rounds, TTFT ratios the median of each round's ratio):",
        "",
        *table(head, rows),
    ]


_TTFT_CAPTION = (
    "Time to first token (`benchmarks.ttft`: run on its own, no spares kept, so each "
    "reopened restore fills arrays the GPU read last):"
)


def _ttft_table(
    before: dict[str, Any],
    after: dict[str, Any],
    labels: tuple[str, str] = ("before", "after"),
    caption: str = _TTFT_CAPTION,
) -> list[str]:
    """`benchmarks.ttft`'s cases of two runs, each row labelled with its run."""
    rows = []
    for label, r in zip(labels, (before, after), strict=True):
        for c in r["cases"]:
            t, d = c["ttft_s"], c["logits_max_diff"]
            rows.append(
                [
                    label,
                    f"{c['model']} {c['tokens']}",
                    ms(t["cold"]),
                    ms(t["mlx_lm_file"]),
                    ms(t["cas_bank_rocksdb"]),
                    f"{ms(t['cas_bank_hot'])} ({c['hot_hits_per_request']:g})",
                    ", ".join(f"{v:g}" for v in d.values()),
                ]
            )
    head = [
        "fill",
        "model, tokens",
        "cold prefill ms",
        "mlx-lm file ms",
        "cas_bank reopened ms",
        "cas_bank hot ms (hot hits a request)",
        "logits max diff vs cold (file, reopened, hot)",
    ]
    return [caption, "", *table(head, rows)]


def _prefetch_tables(p: dict[str, Any]) -> list[str]:
    """The restore and TTFT with the filled arrays moved to the GPU, against the same
    commit with that off, in one session."""
    old = _by_case(p["restore_off"])
    rows = []
    for key, c in _by_case(p["restore_on"]).items():
        b, f = old[key], c["fractions"]
        rows.append(
            [
                f"{key[0]} {key[1]}",
                ms(c["file_load_s"]),
                _reopened(b),
                _reopened(c),
                x(b["fractions"]["file_ttft_over_reopened_ttft"]),
                x(f["file_ttft_over_reopened_ttft"]),
                x(b["fractions"]["file_ttft_over_hot_ttft"]),
                x(f["file_ttft_over_hot_ttft"]),
            ]
        )
    head = [
        "model, tokens",
        "file load ms",
        "reopened, kept on the host ms (x file)",
        "reopened, moved ms (x file)",
        "TTFT reopened, kept, x file",
        "TTFT reopened, moved, x file",
        "TTFT hot, kept, x file",
        "TTFT hot, moved, x file",
    ]
    ttft = _ttft_table(
        p["ttft_off"],
        p["ttft_on"],
        labels=("kept", "moved"),
        caption=_TTFT_CAPTION.replace("Time to first token", "Its time to first token"),
    )
    return [
        f"Moving the filled arrays to the GPU (commit {p['commit']}, {p['date']}: "
        f"{p['what']}). Commands: " + "; ".join(f"`{c}`" for c in p["commands"]) + ".",
        "",
        *table(head, rows),
        "",
        *ttft,
    ]
