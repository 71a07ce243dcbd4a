"""`make bench`: every side-by-side benchmark in one process, and the report.

    python -m benchmarks.run            # the default sizes: < 10 min on 2 cores
    python -m benchmarks.run --large    # + 16k prompts, the medium models, 1k-token overhead
                                        # (and the first-token anchor at 16k)
    python -m benchmarks.run --quick --out /tmp/x   # the smoke test's tiny sizes

Writes `RESULTS.md` (tables, the machine, the date), `results.json` (every figure)
and `ttft.png` (time to first token against prompt length, four ways, per model)
into `--out` (default: this directory). Each target is printed with where it
stands, met or missed; a missed one comes with a profile of where the time goes.

Default sizes and why (measured on the 2-core machine this was written on, while
other work shared it): TTFT on the tiny models at 1k and 4k tokens (a cold prefill
of 4k tokens takes ~7-9 s there, and each size needs ~5 of them); the store
overhead on the medium model at 256 tokens, 2 interleaved pairs (one 1k-token
prefill of it takes ~60-90 s, so 1k is behind --large); the first token against
mlx-lm's in-memory cache at 1k and 4k tokens of the medium layouts and fp32-100mb
(16k behind --large: its next turns pass 64 tokens through the model, seconds each,
three ways a round, and the same through `cas-bank serve` in fewer rounds: ~6 min);
the fleet at 100 agents x 2 turns; the scale bank at 1M blocks (~1 min to write);
the eviction orders at 2000 requests and two budgets (~2 min); the vision agents at 4
agents x 2 rounds (a restart between) x 4 ways on mlx-vlm's server (~1 min).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from cas_bank.runtime.process import server_settings

from benchmarks import (
    eviction_policy,
    first_token,
    fleet,
    remote_load,
    remote_prefetch,
    remote_rtt,
    remote_tier,
    restore,
    scale,
    server_store,
    ttft,
    vlm_agents,
)
from benchmarks.ceilings import MiB, machine_ceilings
from benchmarks.plot import write_plot
from benchmarks.report import write_markdown
from benchmarks.targets import evaluate_targets

HERE = Path(__file__).resolve().parent


def describe_machine() -> dict[str, Any]:
    """CPU, cores, memory, OS and the versions that matter, as plain strings and ints."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    os_name = platform.platform()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = f"{line.split('=', 1)[1].strip(chr(34))} ({platform.platform()})"
    except OSError:
        pass

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem_gib,
        "os": os_name,
        "python": platform.python_version(),
        "versions": {
            p: version(p) for p in ("mlx", "mlx-lm", "rocksdict", "numpy", "blake3", "cas_bank")
        },
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_avg_at_start": list(os.getloadavg()),
    }


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of every part for this command line."""
    return _quick_plan() if args.quick else _full_plan(args)


def _quick_plan() -> dict[str, Any]:
    """Tiny sizes for every part (the smoke test)."""
    return {
        "ttft": ttft.tiny_settings(),
        "restore": restore.tiny_settings(),
        "first_token": first_token.tiny_settings(),
        "overhead": {"model": "tiny-qwen3", "tokens": 128, "repeats": 1},
        "fleet": fleet.tiny_settings(),
        "admission": fleet.tiny_settings(),
        "branching": fleet.tiny_branch_settings(),
        "remote": remote_tier.tiny_settings(),
        "remote_rtt": remote_rtt.tiny_settings(),
        "remote_load": remote_load.tiny_settings(),
        "remote_prefetch": remote_prefetch.tiny_settings(),
        "scale": scale.tiny_settings(),
        "server_store": server_store.tiny_settings(),
        "eviction_policy": eviction_policy.tiny_settings(),
        "vlm_agents": vlm_agents.tiny_settings(),
        "ceilings": {"memcpy_bytes": 2 * MiB, "rocks_mib": 2},
    }


def _full_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The default sizes, or `--large`'s, with the command line's choices."""
    t = ttft.TTFTSettings()
    if args.large:
        t = replace(
            t, models=(*t.models, "medium-qwen3", "medium-hybrid"), lengths=(1024, 4096, 16384)
        )
    if args.models:
        t = replace(t, models=tuple(m.strip() for m in args.models.split(",") if m.strip()))
    if args.lengths:
        t = replace(t, lengths=tuple(int(x) for x in args.lengths.split(",")))
    r = restore.RestoreSettings()
    if args.large:
        r = replace(r, lengths=(1024, 4096, 16384))
    ft = first_token.large_settings() if args.large else first_token.FirstTokenSettings()
    overhead: dict[str, Any] | None = (
        {"model": "medium-qwen3", "tokens": 1024, "repeats": 3}
        if args.large
        else {"model": "medium-qwen3", "tokens": 256, "repeats": 2}
    )
    if args.skip_overhead:
        overhead = None
    f = fleet.FleetSettings(agents=args.agents, turns=args.turns)
    s = scale.ScaleSettings(blocks=args.blocks)
    return {
        "ttft": t,
        "restore": r,
        "first_token": ft,
        "overhead": overhead,
        "fleet": f,
        "admission": fleet.admission_settings(),
        "branching": fleet.BranchSettings(),
        "remote": remote_tier.RemoteSettings(),
        "remote_rtt": remote_rtt.RttSettings(),
        "remote_load": remote_load.short_settings(),
        "remote_prefetch": remote_prefetch.PrefetchSettings(),
        "scale": s,
        "server_store": server_store.ServerStoreSettings(),
        # 2000 requests at the tightest and the loosest budget (~2 min); --large: 4000 at 3.
        "eviction_policy": eviction_policy.Settings()
        if args.large
        else eviction_policy.Settings(requests=2000, budgets_tokens=(16_384, 65_536)),
        # 4 ways x 2 server starts x 4 agents on mlx-vlm's server (~1 min)
        "vlm_agents": vlm_agents.VlmSettings(),
        "ceilings": {"memcpy_bytes": 256 * MiB if args.large else 64 * MiB, "rocks_mib": 64},
    }


PARTS = (
    "ceilings",
    "ttft",
    "restore",
    "first_token",
    "store_overhead",
    "server_store",
    "fleet",
    "admission",
    "branching",
    "remote",
    "remote_rtt",
    "remote_load",
    "remote_prefetch",
    "scale",
    "eviction_policy",
    "vlm_agents",
)


def run_all(p: dict[str, Any], workdir: Path, parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """Every part (of `parts`), in one process, with its wall time."""
    out: dict[str, Any] = {"wall_s": {}, "parts": list(parts)}

    def part(name: str, fn: Any) -> None:
        if name not in parts:
            return
        print(f"[bench] {name} ...", flush=True)
        t0 = time.perf_counter()
        out[name] = fn()
        out["wall_s"][name] = time.perf_counter() - t0
        print(f"[bench] {name}: {out['wall_s'][name]:.1f} s", flush=True)

    part("ceilings", lambda: machine_ceilings(workdir / "ceilings", **p["ceilings"]))
    part("ttft", lambda: ttft.run(workdir / "ttft", p["ttft"]))
    part("restore", lambda: restore.run(workdir / "restore", p["restore"]))
    part("first_token", lambda: first_token.run(workdir / "first_token", p["first_token"]))
    if p["overhead"] is not None:
        o = p["overhead"]
        part(
            "store_overhead",
            lambda: ttft.store_overhead(
                o["model"], o["tokens"], o["repeats"], workdir / "overhead"
            ),
        )
    part("server_store", lambda: server_store.run(workdir / "server_store", p["server_store"]))
    part("fleet", lambda: fleet.run(workdir / "fleet", p["fleet"]))
    part("admission", lambda: fleet.admission(workdir / "admission", p["admission"]))
    part("branching", lambda: fleet.branching(workdir / "branching", p["branching"]))
    part("remote", lambda: remote_tier.run(workdir / "remote", p["remote"]))
    part("remote_rtt", lambda: remote_rtt.run(workdir / "remote_rtt", p["remote_rtt"]))
    part("remote_load", lambda: remote_load.run(workdir / "remote_load", p["remote_load"]))
    part(
        "remote_prefetch",
        lambda: remote_prefetch.run(workdir / "remote_prefetch", p["remote_prefetch"]),
    )
    part("scale", lambda: scale.run(workdir / "scale", p["scale"]))
    part(
        "eviction_policy",
        lambda: eviction_policy.run(p["eviction_policy"], workdir),
    )
    part("vlm_agents", lambda: vlm_agents.run(workdir / "vlm_agents", p["vlm_agents"]))
    return out


def _parser() -> argparse.ArgumentParser:
    """`benchmarks.run`'s command line."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=main.__doc__)
    ap.add_argument(
        "--large", action="store_true", help="16k prompts, medium models, 1k-token overhead"
    )
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes (the smoke test); not for figures"
    )
    ap.add_argument("--models", help="comma-separated models for the TTFT part")
    ap.add_argument("--lengths", help="comma-separated restored-prefix lengths (multiples of 64)")
    ap.add_argument("--agents", type=int, default=fleet.FleetSettings.agents)
    ap.add_argument("--turns", type=int, default=fleet.FleetSettings.turns)
    ap.add_argument(
        "--blocks", type=int, default=scale.ScaleSettings.blocks, help="scale bank size"
    )
    ap.add_argument(
        "--skip-overhead", action="store_true", help="skip the medium-model store overhead"
    )
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated parts to run (all by default): " + ", ".join(PARTS),
    )
    ap.add_argument("--out", type=Path, default=HERE, help="where the report goes")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the banks are built (a temp dir)"
    )
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every benchmark and write RESULTS.md, results.json and ttft.png."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.agents < 1 or args.turns < 1 or args.blocks < 1:
        ap.error("--agents, --turns and --blocks must be >= 1")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        named = ", ".join(unknown) or "(none given)"
        ap.error(f"--parts: unknown {named}; known: {', '.join(PARTS)}")
    settings = plan(args)
    machine = describe_machine()
    # As a serving process runs (cas-bank serve does this): every way measured in this
    # process, mlx-lm's file load included, reuses freed memory.
    machine["keep_freed_memory"] = server_settings() if not args.quick else False
    machine["spare_destinations"] = True  # each bank's own, on by default (spare_bytes)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cas_bank_bench_", dir=args.workdir) as tmp:
        results = run_all(settings, Path(tmp), parts)
    results["total_s"] = time.perf_counter() - t0
    machine["load_avg_at_end"] = list(os.getloadavg())
    results["machine"] = machine
    results["command"] = " ".join(
        ["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]
    )
    results["mode"] = "quick" if args.quick else "large" if args.large else "default"
    results["targets"] = evaluate_targets(results)
    _write(results, args.out)
    return results


def _write(results: dict[str, Any], out: Path) -> None:
    """results.json, ttft.png and RESULTS.md in `out`; each target's verdict printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    write_plot(results, out / "ttft.png")
    write_markdown(results, out / "RESULTS.md")
    for t in results["targets"]:
        print(
            f"[target] {'met   ' if t['met'] else 'MISSED'} {t['target']}: "
            f"{t['measured']} ({t['where']})"
        )
    print(f"[bench] total {results['total_s']:.0f} s; report in {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
