"""Prometheus metrics for the server, in the text exposition format (version 0.0.4).

Written by hand rather than with `prometheus_client`: the server exposes a fixed,
small set of values that already live elsewhere (the bank's persisted counters, the
engine's counters), so a registry would only copy them. `render` turns a list of
`Metric`s into the text that `/metrics` returns.

The bank's counters are read from `Bank.stats()`: they persist in the bank, so after a
restart they continue from where the last server left them (Prometheus treats a
counter that only grows as a counter, whatever process reported it).
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from cas_bank import native
from cas_bank.evict.tenants import TenantStats, short_id
from cas_bank.stats import BankStats, RestoreTotals
from cas_bank.write.writer import WriterStats

if TYPE_CHECKING:
    from cas_bank.remote.health import TierHealth, TierProbe

    from .generation import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "cas_bank_"

MetricType = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric family: a name, help text, a type and its samples (labels -> value)."""

    name: str
    help: str
    type: MetricType
    samples: Mapping[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    @classmethod
    def single(cls, name: str, help: str, type: MetricType, value: float) -> Metric:
        return cls(name, help, type, {(): value})


def render(metrics: Iterable[Metric]) -> str:
    """The Prometheus text exposition of `metrics` (names get the `cas_bank_` prefix)."""
    lines: list[str] = []
    for m in metrics:
        name = PREFIX + m.name
        lines.append(f"# HELP {name} {_escape_help(m.help)}")
        lines.append(f"# TYPE {name} {m.type}")
        for labels, value in sorted(m.samples.items()):
            lines.append(f"{name}{_labels(labels)} {_number(value)}")
    return "\n".join(lines) + "\n"


# (metric name, help, the `BankStats` field it reports): the bank's counters, then its
# sizes. Names are a contract (dashboards read them); add, never rename.
_BANK_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "prefix_queried_tokens_total",
        "Prompt tokens looked up in the prefix cache.",
        "queried_tokens",
    ),
    ("prefix_hit_tokens_total", "Prompt tokens restored from the prefix cache.", "hit_tokens"),
    ("prefix_restores_total", "Prefix-cache lookups.", "restores"),
    ("prefix_hits_total", "Lookups that restored at least one block.", "hits"),
    ("prefix_misses_total", "Lookups that restored nothing.", "misses"),
    ("blocks_written_total", "KV blocks written to the bank.", "blocks_written"),
    (
        "bytes_written_total",
        "Payload and state bytes written to the bank (the SSD's share of the work).",
        "bytes_written",
    ),
    (
        "blocks_deduplicated_total",
        "KV blocks offered that were already stored.",
        "blocks_deduplicated",
    ),
    ("states_written_total", "Recurrent (GDN) states written to the bank.", "states_written"),
    (
        "corrupt_reads_total",
        "Payloads that failed verification and were served as misses.",
        "corrupt_reads",
    ),
    (
        "hot_hits_total",
        "Payloads served from the in-process hot tier (no RocksDB read).",
        "hot_hits",
    ),
    ("blocks_evicted_total", "KV blocks evicted to keep the budget.", "blocks_evicted"),
    (
        "states_evicted_total",
        "Recurrent states evicted (on their own or with their block).",
        "states_evicted",
    ),
    ("bytes_evicted_total", "Payload, state and end-record bytes evicted.", "bytes_evicted"),
    ("ends_written_total", "End records (a prompt's exact end) written.", "ends_written"),
    ("ends_evicted_total", "End records evicted.", "ends_evicted"),
    (
        "prefix_exact_hits_total",
        "Restores of a whole prompt from its end record (no prefill).",
        "exact_hits",
    ),
    (
        "prefix_end_hits_total",
        "Restores that resumed from an end record short of the prompt's end.",
        "end_hits",
    ),
    (
        "prefix_partial_hits_total",
        "Restores that took the first tokens of a stored block (a partial block).",
        "partial_hits",
    ),
    (
        "prefix_partial_tokens_total",
        "Tokens restored from partial blocks (counted in the hit tokens too).",
        "partial_tokens",
    ),
    (
        "prefix_live_hits_total",
        "Restores that took a conversation's live cache back without a copy.",
        "live_hits",
    ),
    ("remote_hits_total", "Restores that took blocks from the shared tier.", "remote_hits"),
    ("remote_hit_blocks_total", "KV blocks restored from the shared tier.", "remote_hit_blocks"),
    (
        "remote_hit_tokens_total",
        "Prompt tokens restored from the shared tier.",
        "remote_hit_tokens",
    ),
    ("remote_fetched_bytes_total", "Bytes read from the shared tier.", "remote_bytes_fetched"),
    (
        "remote_publishes_total",
        "Blocks and states written to the shared tier.",
        "remote_publishes",
    ),
    (
        "remote_published_bytes_total",
        "Bytes written to the shared tier.",
        "remote_published_bytes",
    ),
    (
        "remote_dropped_total",
        "Publishes dropped because the publish queue was full.",
        "remote_dropped",
    ),
    ("remote_errors_total", "Failed calls to a shared-tier node.", "remote_errors"),
    ("remote_timeouts_total", "Calls to a shared-tier node that timed out.", "remote_timeouts"),
    (
        "remote_skipped_total",
        "Calls not made while a node's circuit breaker was open.",
        "remote_skipped",
    ),
    (
        "remote_rejected_total",
        "Shared-tier entries whose MAC, digest or chain link failed (served as misses).",
        "remote_rejected",
    ),
)
_BANK_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("blocks", "KV blocks stored.", "blocks"),
    ("states", "Recurrent states stored.", "states"),
    ("payload_bytes", "Bytes of stored KV block payloads.", "payload_bytes"),
    ("state_bytes", "Bytes of stored recurrent states.", "state_bytes"),
    ("ends", "End records stored.", "ends"),
    ("end_bytes", "Bytes of stored end records.", "end_bytes"),
    (
        "stored_bytes",
        "Bytes of stored payloads, states and end records together.",
        "stored_bytes",
    ),
    ("block_size_tokens", "Tokens per block.", "block_size"),
    (
        "hot_tier_bytes",
        "Bytes the in-process hot tier holds (raw and decoded payloads, headers).",
        "hot_tier_bytes",
    ),
    (
        "leased_bytes",
        "Bytes of MLX arrays leased in memory (chains stored or restored here).",
        "leased_bytes",
    ),
    (
        "live_bytes",
        "Of the leased bytes, conversations' live caches (whole buffers, room included).",
        "live_bytes",
    ),
    (
        "hot_budget_bytes",
        "The bound the hot tier and the leases share (BankConfig.hot_bytes).",
        "hot_bytes",
    ),
    (
        "prefix_hit_ratio",
        "Restored tokens per queried token since the bank was created.",
        "hit_rate",
    ),
)


def bank_metrics(stats: BankStats) -> list[Metric]:
    """The prefix-cache counters and sizes of a bank."""
    out = [Metric.single(n, h, "counter", getattr(stats, f)) for n, h, f in _BANK_COUNTERS]
    out += [Metric.single(n, h, "gauge", getattr(stats, f)) for n, h, f in _BANK_GAUGES]
    if stats.disk_bytes is not None:
        out.append(
            Metric.single(
                "disk_bytes", "Bytes the bank directory takes on disk.", "gauge", stats.disk_bytes
            )
        )
    return [*out, native_metric(), frozen_metric()]


def tenant_metrics(tenants: Sequence[TenantStats]) -> list[Metric]:
    """Bytes, hits and quotas per tenant (`Bank.tenant_stats()`), labelled by the salt's
    digest (its first 12 hex characters, `cas_bank.evict.tenants.short_id`), never the
    salt; `unsalted="1"` marks the data stored without one."""

    def labels(t: TenantStats) -> tuple[tuple[str, str], ...]:
        return (("tenant", short_id(t.tenant)), ("unsalted", "1" if t.unsalted else "0"))

    return [
        Metric(
            "tenant_bytes",
            "Bytes of blocks, states and end records a tenant (cache_salt) holds.",
            "gauge",
            {labels(t): t.bytes for t in tenants},
        ),
        Metric(
            "tenant_hits_total",
            "Restores of a tenant that restored at least one token.",
            "counter",
            {labels(t): t.hits for t in tenants},
        ),
        Metric(
            "tenant_hit_tokens_total",
            "Tokens restored for a tenant.",
            "counter",
            {labels(t): t.hit_tokens for t in tenants},
        ),
        Metric(
            "tenant_quota_bytes",
            "A tenant's byte quota (tenants with one).",
            "gauge",
            {labels(t): t.quota for t in tenants if t.quota is not None},
        ),
    ]


def native_metric() -> Metric:
    """1 for each native helper this process loaded, 0 for one it runs without (the
    slower Python path: `cas_bank.native`); part of `bank_metrics`, so every server
    that shows the bank's shows it."""
    s = native.status()
    return Metric(
        "native_helper",
        "1 if the C helper is loaded, 0 if its work takes the slower Python path.",
        "gauge",
        {(("helper", name.lstrip("_")),): float(name in s.loaded) for name in native.HELPERS},
    )


def frozen_metric() -> Metric:
    """How many objects this process took out of the garbage collector's passes at
    startup (`cas_bank.runtime.process.freeze_startup_objects`; 0 where it did not)."""
    return Metric.single(
        "gc_frozen_objects",
        "Objects frozen out of the cyclic garbage collector at startup (gc.freeze).",
        "gauge",
        gc.get_freeze_count(),
    )


class RequestCounter:
    """HTTP requests by endpoint and status code (thread-safe; process-local)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, endpoint: str, status: int) -> None:
        key = (endpoint, str(status))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def metric(self) -> Metric:
        with self._lock:
            samples: dict[tuple[tuple[str, str], ...], float] = {
                (("endpoint", e), ("status", s)): float(n) for (e, s), n in self._counts.items()
            }
        return Metric(
            "http_requests_total", "HTTP requests by endpoint and status.", "counter", samples
        )


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return "{" + body + "}"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def writer_metrics(stats: WriterStats | None) -> list[Metric]:
    """The bank's background writer (zeros when the bank has none: stores are inline)."""
    queued, capacity, written, nbytes, failed = (
        (stats.queued, stats.capacity, stats.written, stats.bytes_written, stats.failed)
        if stats is not None
        else (0, 0, 0, 0, 0)
    )
    return [
        Metric.single(
            "writer_queue_depth",
            "Stores queued for the background writer (waiting or being written).",
            "gauge",
            queued,
        ),
        Metric.single(
            "writer_queue_capacity",
            "Stores the writer may hold queued before a store waits (write_behind).",
            "gauge",
            capacity,
        ),
        Metric.single(
            "writer_stores_total",
            "Stores the background writer wrote since the server started.",
            "counter",
            written,
        ),
        Metric.single(
            "writer_bytes_total",
            "Payload, state and end-record bytes the background writer wrote.",
            "counter",
            nbytes,
        ),
        Metric.single(
            "writer_failures_total",
            "Background stores that failed (logged; the request had already gone on).",
            "counter",
            failed,
        ),
    ]


def restore_metrics(totals: RestoreTotals) -> list[Metric]:
    """Where this process's restores spent their time (`Bank.restore_times`): seconds
    per part (`Hit.timings`) and how many restores they sum, for rates and means
    (`rate(..._seconds_total[5m]) / rate(cas_bank_restores_timed_total[5m])`)."""
    return [
        Metric.single(
            "restores_timed_total",
            "Restores (hits and misses) whose time is summed below, since this process "
            "opened the bank.",
            "counter",
            totals.restores,
        ),
        Metric.single(
            "restore_seconds_total", "Seconds spent in those restores.", "counter", totals.total_s
        ),
        Metric(
            "restore_part_seconds_total",
            "Seconds of those restores by part: lookup (hashes, index, leases), allocate "
            "(destination arrays), fill (payloads read, verified and copied in).",
            "counter",
            {
                (("part", "lookup"),): totals.lookup_s,
                (("part", "allocate"),): totals.allocate_s,
                (("part", "fill"),): totals.fill_s,
            },
        ),
    ]


def engine_metrics(stats: EngineStats) -> list[Metric]:
    """The serving engine's counters (process-local: they restart at zero)."""
    return [
        Metric.single("requests_total", "Generations completed.", "counter", stats.requests),
        Metric.single(
            "requests_failed_total", "Generations that failed inside.", "counter", stats.failed
        ),
        Metric.single(
            "prompt_tokens_total",
            "Prompt tokens of completed generations.",
            "counter",
            stats.prompt_tokens,
        ),
        Metric.single(
            "cached_prompt_tokens_total",
            "Prompt tokens restored from the bank instead of prefilled.",
            "counter",
            stats.cached_tokens,
        ),
        Metric.single(
            "completion_tokens_total", "Tokens generated.", "counter", stats.completion_tokens
        ),
        Metric.single("queue_depth", "Requests waiting for the model.", "gauge", stats.queue_depth),
        Metric.single("busy", "1 while a generation runs.", "gauge", 1 if stats.busy else 0),
        Metric.single(
            "prefetches_total",
            "Queued requests whose prefix was fetched from the shared tier ahead of them.",
            "counter",
            stats.prefetches,
        ),
        Metric.single(
            "prefetched_blocks_total",
            "Blocks those prefetches wrote into the local bank.",
            "counter",
            stats.prefetched_blocks,
        ),
        Metric.single(
            "prefetches_dropped_total",
            "Queued requests not prefetched: the prefetch queue was full.",
            "counter",
            stats.prefetches_dropped,
        ),
        Metric.single(
            "prefetches_failed_total",
            "Prefetches that failed (logged; the request's restore asks the tier itself).",
            "counter",
            stats.prefetches_failed,
        ),
    ]


def tier_metrics(health: TierHealth, probe: TierProbe) -> list[Metric]:
    """The shared tier's state (`TierProbe`): up or not at the last probe, probes that
    found it degraded, and the nodes its client skips now (circuit breakers open).
    Failed calls themselves are `remote_errors_total` and `remote_timeouts_total`."""
    return [
        Metric.single(
            "remote_up",
            "1 while the shared tier serves (a node answers, every slot served); 0 while "
            "no node answers or the cluster is failed (/health says why).",
            "gauge",
            1 if health.up else 0,
        ),
        Metric.single(
            "remote_probes_failed_total",
            "Health probes of the shared tier that found it degraded (this process).",
            "counter",
            probe.failed,
        ),
        Metric.single(
            "remote_nodes_skipped",
            "Shared-tier nodes not asked now: their circuit breakers are open.",
            "gauge",
            probe.skipped_nodes(),
        ),
    ]
