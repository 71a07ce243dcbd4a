"""`TierProbe`: whether the shared tier serves, for the servers' `/health` and `/metrics`.

The tier's own calls never raise (`RemoteClient`): a dead cluster only shows as
misses and counted errors. A probe asks it directly, at most once per `ttl` seconds
(a `/health` poll every second costs one probe per `ttl`), with the tier's own
time-outs, on a connection of its own:

- a node answers `CLUSTER INFO` with `cluster_state:ok` and every one of the 16384
  slots served: `ok`;
- it says `cluster_state:fail` (Valkey's answer when a master is down and the
  cluster requires full coverage), or some slots are unserved (a master down without
  a replica, under `cluster-require-full-coverage no`): `degraded`, with that reason;
- no node answers (the URL's node, then the other nodes the last good answer named,
  `CLUSTER NODES`): `degraded`, with the last error.

A plain (non-cluster) server is `ok` when it answers `PING`. Nothing it reads enters
the bank; the probe holds no connection between checks.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from cas_bank.remote.tier import RemoteTier

SLOTS = 16384
DEFAULT_TTL = 2.0  # seconds a probe's answer is reused
MAX_NODES_TRIED = 4  # a hung node costs a time-out: /health stays within seconds


@dataclass(frozen=True, slots=True)
class TierHealth:
    status: Literal["ok", "degraded"]
    reason: str | None  # why it is degraded
    url: str  # the tier's URL, password hidden
    node: str | None  # the node that answered (host:port)

    @property
    def up(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "url": self.url, "node": self.node}


class TierProbe:
    """Asks `tier`'s cluster whether it serves (see the module docstring)."""

    def __init__(self, tier: RemoteTier, *, ttl: float = DEFAULT_TTL) -> None:
        self.tier = tier
        self.ttl = ttl
        self.probes = 0  # probes made
        self.failed = 0  # probes that found the tier degraded
        self._lock = threading.Lock()
        self._last: TierHealth | None = None
        self._at = 0.0
        self._nodes: list[str] = []  # host:port of every node the last good answer named

    def check(self) -> TierHealth:
        """The tier's health, asked at most once per `ttl` seconds (thread-safe)."""
        with self._lock:
            if self._last is not None and time.monotonic() - self._at < self.ttl:
                return self._last
            self._last = self._probe()
            self._at = time.monotonic()
            self.probes += 1
            self.failed += 0 if self._last.up else 1
            return self._last

    def skipped_nodes(self) -> int:
        """Nodes the tier's client is not asking now (their circuit breakers are open)."""
        return self.tier.client.open_breakers()

    # -- one probe ---------------------------------------------------------------------
    def _probe(self) -> TierHealth:
        client = self.tier.client
        home = _address(client.url)
        candidates = [home, *(n for n in self._nodes if n != home)][:MAX_NODES_TRIED]
        error = "no node to ask"
        for node in candidates:
            try:
                return self._ask(node)
            except Exception as e:  # refused, timed out, a wrong password: the next node
                error = f"{type(e).__name__}: {e}"
        tried = ", ".join(candidates)
        return self._health(
            "degraded", f"no node of the shared tier answers ({tried}; last: {error})", None
        )

    def _ask(self, node: str) -> TierHealth:
        client = self.tier.client
        valkey: Any = importlib.import_module("valkey")
        conn = valkey.Valkey.from_url(
            _with_address(client.url, node),
            socket_timeout=client.timeout,
            socket_connect_timeout=client.connect_timeout,
            **client.tls,
        )
        try:
            if int(conn.info("cluster").get("cluster_enabled", 0)) != 1:
                conn.ping()
                return self._health("ok", None, node)
            info = _fields(conn.execute_command("CLUSTER", "INFO"))
            with contextlib.suppress(Exception):
                self._nodes = _node_addresses(conn.execute_command("CLUSTER", "NODES"))
        finally:
            conn.close()
        state = info.get("cluster_state", "?")
        served = int(info.get("cluster_slots_ok", 0))
        if state != "ok":
            why = f"the cluster says cluster_state:{state} (asked {node}): it serves no slot"
            return self._health("degraded", why, node)
        if served < SLOTS:
            why = (
                f"{SLOTS - served} of {SLOTS} slots are not served (asked {node}): a master "
                "is down without a replica to take over; their blocks are misses"
            )
            return self._health("degraded", why, node)
        return self._health("ok", None, node)

    def _health(
        self, status: Literal["ok", "degraded"], reason: str | None, node: str | None
    ) -> TierHealth:
        return TierHealth(status, reason, self.tier.url, node)


def degraded_reason(bank: str | None, tier: TierHealth | None) -> str | None:
    """Why a server is degraded: the bank's reason (`Bank.degraded`), the shared
    tier's, or both; None when neither is."""
    reasons = [bank] if bank else []
    if tier is not None and not tier.up:
        reasons.append(f"shared tier: {tier.reason}")
    return "; ".join(reasons) or None


def _address(url: str) -> str:
    parts = urlsplit(url)
    return _join(parts.hostname or "", parts.port or 0)


def _join(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _with_address(url: str, node: str) -> str:
    """`url` (its scheme, credentials, query) pointed at the node `host:port`."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{node}" if userinfo else node
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _text(raw: Any) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _fields(raw: Any) -> dict[str, str]:
    """`CLUSTER INFO`'s `key:value` lines."""
    if isinstance(raw, dict):
        return {str(k): _text(v) for k, v in raw.items()}
    pairs = (line.partition(":") for line in _text(raw).splitlines())
    return {k.strip(): v.strip() for k, _, v in pairs if k.strip()}


def _node_addresses(raw: Any) -> list[str]:
    """host:port of each node in a `CLUSTER NODES` answer (`id ip:port@bus flags ...`)."""
    out = []
    for line in _text(raw).splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        host, _, port = fields[1].split("@")[0].split(",")[0].rpartition(":")
        if host and port.isdigit() and port != "0":
            out.append(_join(host.strip("[]"), port))
    return out
