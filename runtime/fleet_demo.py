"""`cas-bank demo --hosts N`: a fleet of N inference hosts sharing one Valkey cluster.

`run_fleet_demo` starts a local 3-master Valkey cluster (real `valkey-server`
processes, `cas_bank.remote.local_cluster`), then N servers (`BackgroundServer`, the
embedded tiny hybrid model), each with a bank directory of its own and the cluster as
its shared tier. Agents share the demo's system prompt; at every turn each agent's
request goes to another host (agent a, turn t -> host (a + t) mod N), as a load
balancer without session affinity would send it. Each host restores what it holds
locally and continues the chain from the cluster, so a turn restores its whole
conversation so far even on a host that never saw the agent.

What it reports: per request the host, the prompt, the tokens restored (cached) and
of those the tokens that came from the cluster; per host its shared-tier counters;
the bytes the cluster holds.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from cas_bank.remote.local_cluster import LocalCluster

from .demo import _chat, system_prompt, user_message
from .engine import Engine
from .models import DEFAULT_MODEL
from .server import BackgroundServer

FLEET_SECRET = "cas-bank demo fleet secret"


@dataclass(frozen=True, slots=True)
class FleetRow:
    agent: int
    turn: int
    host: int
    prompt_tokens: int
    cached_tokens: int  # restored in all (local bank + cluster)
    remote_tokens: int  # of those, fetched from the cluster
    ttft_s: float


@dataclass
class FleetReport:
    hosts: int
    agents: int
    turns: int
    block_size: int
    rows: list[FleetRow] = field(default_factory=list)
    host_stats: list[dict[str, int]] = field(default_factory=list)
    cluster_bytes: int = 0  # MEMORY USAGE over every key of the cluster
    cluster_keys: int = 0

    @property
    def moved_hit_rate(self) -> float:
        """Restored tokens / prompt tokens over the requests after the first turn (every
        one of them on a host the agent was not on the turn before)."""
        later = [r for r in self.rows if r.turn > 1]
        prompt = sum(r.prompt_tokens for r in later)
        return sum(r.cached_tokens for r in later) / prompt if prompt else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["moved_hit_rate"] = self.moved_hit_rate
        return out


def run_fleet_demo(
    hosts: int,
    agents: int,
    turns: int,
    *,
    max_tokens: int,
    block_size: int,
    seed: int = 0,
    model: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> FleetReport:
    if hosts < 2:
        raise ValueError(f"a fleet demo needs at least 2 hosts, got {hosts}")
    step = progress or (lambda _msg: None)
    report = FleetReport(hosts=hosts, agents=agents, turns=turns, block_size=block_size)
    tmp = Path(tempfile.mkdtemp(prefix="cas_bank_fleet_demo_"))
    servers: list[BackgroundServer] = []
    try:
        with LocalCluster(3) as cluster:
            _start_hosts(servers, cluster, tmp, hosts, block_size, seed, model)
            step("started the cluster and the hosts")
            _move_agents(servers, report, agents, turns, max_tokens, step)
            _count_shared_tier(servers, cluster, report)
            for server in servers:
                server.stop()
            servers.clear()
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _start_hosts(
    servers: list[BackgroundServer],
    cluster: LocalCluster,
    tmp: Path,
    hosts: int,
    block_size: int,
    seed: int,
    model: str | Path | None,
) -> None:
    """Start `hosts` servers into `servers` (the caller stops those started if one
    fails), each with a bank of its own under `tmp` and the cluster as shared tier."""
    for h in range(hosts):
        engine = Engine.open(
            tmp / f"host{h}",
            model or DEFAULT_MODEL,
            block_size=block_size,
            seed=seed,
            remote=cluster.url(h % len(cluster.nodes)),
            remote_secret=FLEET_SECRET,
        )
        try:
            servers.append(BackgroundServer(engine).start())
        except BaseException:
            engine.close()
            raise


def _move_agents(
    servers: list[BackgroundServer],
    report: FleetReport,
    agents: int,
    turns: int,
    max_tokens: int,
    step: Callable[[str], None],
) -> None:
    """Play `turns` turns of every agent, agent a's turn t on host (a + t) mod N; a row
    per request, with the tokens its host fetched from the cluster."""
    conversations = [[{"role": "system", "content": system_prompt()}] for _ in range(agents)]
    for turn in range(turns):
        for agent, messages in enumerate(conversations):
            host = (agent + turn) % len(servers)
            bank = servers[host].engine.bank
            before = bank.stats().remote_hit_tokens
            messages.append({"role": "user", "content": user_message(agent, turn)})
            engine = servers[host].engine
            reply, row = _chat(
                servers[host].url, messages, max_tokens, f"host {host}", agent, turn,
                engine.loaded.tokenizer, engine.model_id,
            )  # fmt: skip
            messages.append({"role": "assistant", "content": reply})
            remote = bank.stats().remote_hit_tokens - before
            report.rows.append(
                FleetRow(
                    agent, turn + 1, host, row.prompt_tokens, row.cached_tokens, remote,
                    row.ttft_s,
                )
            )  # fmt: skip
            step(f"agent {agent} turn {turn + 1} on host {host}")


def _count_shared_tier(
    servers: list[BackgroundServer], cluster: LocalCluster, report: FleetReport
) -> None:
    """Each host's shared-tier counters (once its stores are written), and what the
    cluster holds."""
    for server in servers:
        server.engine.bank.flush()
        s = server.engine.bank.stats().model_dump()
        report.host_stats.append(
            {k: v for k, v in s.items() if k.startswith("remote_") and k != "remote"}
        )
    report.cluster_keys = len(cluster.all_keys())
    report.cluster_bytes = cluster.memory_usage()


def fleet_tables(report: FleetReport) -> list[Table]:
    turns = Table(
        title=f"{report.agents} agents x {report.turns} turns on {report.hosts} hosts sharing "
        f"one Valkey cluster (block size {report.block_size})",
        title_justify="left",
        caption="Each turn an agent lands on another host. cached: prompt tokens restored; "
        "from cluster: the part fetched from the shared tier (verified, then kept locally).",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("agent", "turn", "host", "prompt", "cached", "from cluster", "TTFT ms"):
        turns.add_column(name, justify="right", no_wrap=True)
    for r in report.rows:
        turns.add_row(
            str(r.agent), str(r.turn), str(r.host), str(r.prompt_tokens), str(r.cached_tokens),
            str(r.remote_tokens), f"{r.ttft_s * 1000:.0f}",
        )  # fmt: skip
    hosts = Table(title="Shared tier, per host", title_justify="left", box=box.SIMPLE_HEAD)
    names = [
        ("publishes", "remote_publishes"),
        ("hit tokens", "remote_hit_tokens"),
        ("fetched B", "remote_bytes_fetched"),
        ("rejected", "remote_rejected"),
        ("errors", "remote_errors"),
        ("time-outs", "remote_timeouts"),
        ("dropped", "remote_dropped"),
    ]
    hosts.add_column("host", justify="right")
    for label, _ in names:
        hosts.add_column(label, justify="right")
    for h, s in enumerate(report.host_stats):
        hosts.add_row(str(h), *(str(s[k]) for _, k in names))
    summary = Table(title="Fleet", title_justify="left", show_header=False, box=box.SIMPLE)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("hit rate after moving hosts", f"{report.moved_hit_rate:.1%}")
    summary.add_row("cluster keys", str(report.cluster_keys))
    summary.add_row("cluster bytes (MEMORY USAGE)", f"{report.cluster_bytes / 2**20:.2f} MiB")
    return [turns, hosts, summary]
