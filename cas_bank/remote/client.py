"""`RemoteClient`: pipelines to a Valkey cluster or a single server, with time-outs,
a circuit breaker per node and counters, never an exception to its caller.

Connecting is lazy (the first call) and detects cluster mode (`INFO cluster` on the
node of the URL): a cluster gets a `valkey.ValkeyCluster` (for its slot map and its
per-node connections), a plain server a `valkey.Valkey`. A call groups its commands
by the node that owns each key's slot and sends one pipeline per node, the nodes in
parallel: one round trip whatever the number of masters. It returns the answers in
order, None for every command that failed or was not sent.

Each node has its own breaker: a node that fails (time-out, connection refused or
lost) is not asked for `remote_retry_after` seconds, then one call tries it again; the other
nodes go on being asked. Failures are counted once per node and call
(`remote_errors`, `remote_timeouts`); commands not sent because a breaker is open
count `remote_skipped` (once per call). An error answer (a full node refusing a
write) is counted, and the node counts as alive. A MOVED or ASK answer (the
cluster's slots moved) and a node that is gone (connection refused or lost: its slots
may have moved to a replica or another master) read the slot map again on the next
call; a node that times out does not (the map would be asked of it again). While a
node that is gone is skipped, the map is read again at most once per `MAP_REFRESH_S`:
a failover gives its slots to a replica, and the next call after the map says so
reaches it. (A hung node's slots are read from its replica meanwhile, and written
again once something else makes the map be read.)

Replicas: the reads (GET, EXISTS) of a master that failed in this call or is skipped
go, in one more round trip, to a replica of their slots, as the slot map names them
(connections are READONLY). During a failover window the hits go on from the replica
(replication is asynchronous: the newest entries may be missing there, a miss; keys
name their content, so nothing read there is wrong); writes to those slots fail,
counted, until the map names the promoted replica. `round_trips` and `replica_reads`
count what was sent.

TLS: a `valkeys://` (or `rediss://`) URL connects with TLS, to the node of the URL and
to every node the slot map names; `tls_options` gives the CA file and the client
certificate (mutual TLS) from `BankConfig`. Servers are always verified. A handshake
that fails (an unknown CA, a missing client certificate, a plain-text server) is a
connection error like any other: counted, the breaker opened, never raised.

Purging (`purge`, a revocation's): every master SCANs for the keys matching the given
patterns and UNLINKs them in pipelines of at most `batch`, the masters in parallel on
threads of its own (not the pool the restoring path's pipelines use), each command
under the same time-outs and breakers; it never raises either, and says which masters
it could not purge to the end.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cas_bank.config import BankConfig
from cas_bank.errors import InvalidInputError
from cas_bank.remote.breaker import Breaker

log = logging.getLogger("cas_bank.remote")

Command = tuple[Any, ...]
Count = Callable[..., None]
_SINGLE = "server"  # the node name of a plain (non-cluster) server
_READS = ("GET", "EXISTS")  # what a replica may answer
MAP_REFRESH_S = 0.5  # while a node that is gone is skipped, the slot map is read again this often


@dataclass(frozen=True, slots=True)
class Purge:
    """What `RemoteClient.purge` removed."""

    keys: int  # keys removed (UNLINK answered 1; a key SCAN returned twice counts once)
    nodes: int  # masters scanned to the end
    failed: tuple[str, ...]  # masters (or the server) not purged to the end: down, a
    # time-out, an open breaker, an error answer; their keys may remain
    seconds: float

    @property
    def complete(self) -> bool:
        return not self.failed


def tls_options(config: BankConfig) -> dict[str, Any]:
    """The `valkey` client's TLS options for `config` (empty for a plain URL); raises
    `InvalidInputError` naming a TLS file that is missing or unreadable."""
    files = {
        "ssl_ca_certs": ("remote_tls_ca", config.remote_tls_ca),
        "ssl_certfile": ("remote_tls_cert", config.remote_tls_cert),
        "ssl_keyfile": ("remote_tls_key", config.remote_tls_key),
    }
    opts: dict[str, Any] = {}
    for option, (name, path) in files.items():
        if path is None:
            continue
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise InvalidInputError(f"{name}: no readable file at {path}")
        opts[option] = path
    if opts:
        opts["ssl_cert_reqs"] = "required"
    return opts


class RemoteClient:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        timeout: float,
        retry_after: float,
        count: Count,
        tls: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.tls = dict(tls or {})  # `tls_options`: the scheme itself turns TLS on
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.retry_after = retry_after
        self.count = count
        self.cluster: bool | None = None  # known after the first connection
        self._client: Any = None
        self._lock = threading.Lock()
        self._breakers: dict[str, Breaker] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cas-bank-remote")
        self._stale = False  # a MOVED answer: read the slot map again
        self._refreshed = 0.0  # when a skipped node last asked for the map again
        self._gone: set[str] = set()  # nodes whose last failure was a lost connection
        self.round_trips = 0  # pipelined round trips sent (a replica retry is one more)
        self.replica_reads = 0  # reads a replica answered for a master down or skipped

    def breaker(self, node: str) -> Breaker:
        with self._lock:
            b = self._breakers.get(node)
            if b is None:
                b = self._breakers[node] = Breaker(failures=1, retry_after=self.retry_after)
            return b

    def open_breakers(self) -> int:
        """Nodes not asked now: their circuit breakers are open (`/metrics`)."""
        with self._lock:
            breakers = list(self._breakers.values())
        return sum(1 for b in breakers if b.is_open)

    def _connect(self) -> Any:
        valkey: Any = importlib.import_module("valkey")  # its stubs are partial: used untyped
        with self._lock:
            if self._client is not None:
                if self._stale and self.cluster:
                    self._stale = False
                    self._client.nodes_manager.initialize()
                return self._client
            opts: dict[str, Any] = dict(
                socket_timeout=self.timeout,
                socket_connect_timeout=self.connect_timeout,
                **self.tls,
            )
            probe = valkey.Valkey.from_url(self.url, **opts)
            try:
                enabled = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
            except BaseException:
                probe.close()
                raise
            if enabled:
                probe.close()
                self._client = valkey.ValkeyCluster.from_url(
                    self.url,
                    cluster_error_retry_attempts=1,
                    require_full_coverage=False,
                    read_from_replicas=True,  # connections READONLY; routing is ours
                    **opts,
                )
            else:
                self._client = probe
            self.cluster = enabled
            return self._client

    def run(self, commands: Sequence[Command]) -> list[Any] | None:
        """Answers to `commands` in order (None for each that failed or was not sent),
        or None when no node could be asked. Never raises."""
        if not commands:
            return []
        valkey: Any = importlib.import_module("valkey")
        connecting = self._client is None
        if connecting and not self.breaker(_SINGLE).allow():
            self.count(remote_skipped=1)
            return None
        try:
            client = self._connect()
        except Exception as e:  # nothing listening, a wrong password, a hung node
            self._failed(_SINGLE, e, valkey)
            return None
        if connecting:  # it answered: the trial a reconnect took (if any) succeeded
            self.breaker(_SINGLE).success()
        try:
            groups = self._group(client, commands)
        except Exception as e:  # a slot no master serves
            self._failed(_SINGLE, e, valkey)
            return None
        answers: list[Any] = [None] * len(commands)
        asked = {name: g for name, g in groups.items() if self.breaker(name).allow()}
        lost = [i for name, (_, idx) in groups.items() if name not in asked for i in idx]
        if lost:
            self.count(remote_skipped=1)
            self._refresh_soon([n for n in groups if n not in asked])
        lost += self._ask(asked, commands, answers, valkey)
        self.round_trips += 1
        replicas = self._replica_groups(client, commands, lost) if self.cluster else {}
        if replicas:  # a master down or skipped: its replicas answer the reads
            self.replica_reads += sum(len(idx) for _, idx in replicas.values())
            self._ask(replicas, commands, answers, valkey)
            self.round_trips += 1
        if not asked and not replicas:
            return None
        return answers

    def purge(self, patterns: Sequence[bytes], *, batch: int = 1000) -> Purge:
        """UNLINK every key matching one of `patterns` (SCAN MATCH globs) on every master
        (the server), `batch` keys a pipeline; the masters in parallel. Never raises:
        a master that cannot be asked or fails midway is named in `Purge.failed` (what
        it removed before is counted), counted as `run` counts it, its breaker told."""
        start = time.monotonic()
        if not patterns:
            return Purge(0, 0, (), 0.0)
        valkey: Any = importlib.import_module("valkey")
        connecting = self._client is None
        if connecting and not self.breaker(_SINGLE).allow():
            self.count(remote_skipped=1)
            return Purge(0, 0, (_SINGLE,), time.monotonic() - start)
        try:
            client = self._connect()
            if connecting:
                self.breaker(_SINGLE).success()
            if self.cluster:
                nodes = {n.name: client.get_valkey_connection(n) for n in client.get_primaries()}
            else:
                nodes = {_SINGLE: client}
        except Exception as e:  # nothing listening, a wrong password, a hung node
            self._failed(_SINGLE, e, valkey)
            return Purge(0, 0, (_SINGLE,), time.monotonic() - start)
        asked = {name: conn for name, conn in nodes.items() if self.breaker(name).allow()}
        failed = [name for name in nodes if name not in asked]
        if failed:
            self.count(remote_skipped=1)
        removed = [0] * len(asked)
        done = 0
        if asked:
            with ThreadPoolExecutor(
                max_workers=min(8, len(asked)), thread_name_prefix="cas-bank-purge"
            ) as pool:
                jobs = {
                    name: pool.submit(_purge_node, conn, patterns, batch, removed, i)
                    for i, (name, conn) in enumerate(asked.items())
                }
                for name, job in jobs.items():
                    try:
                        job.result()
                    except Exception as e:
                        self._failed(name, e, valkey)
                        failed.append(name)
                        continue
                    self.breaker(name).success()
                    done += 1
        return Purge(sum(removed), done, tuple(sorted(failed)), time.monotonic() - start)

    def _ask(
        self,
        groups: dict[str, tuple[Any, list[int]]],
        commands: Sequence[Command],
        answers: list[Any],
        valkey: Any,
    ) -> list[int]:
        """Send each node its group (in parallel) and put the answers in `answers`; the
        positions whose node failed."""
        jobs = {
            name: self._pool.submit(self._send, conn, [commands[i] for i in idx])
            for name, (conn, idx) in groups.items()
        }
        lost: list[int] = []
        for name, job in jobs.items():
            _, idx = groups[name]
            try:
                got = job.result()
            except Exception as e:
                self._failed(name, e, valkey)
                lost += idx
                continue
            errors = [a for a in got if isinstance(a, Exception)]
            if errors:
                self._failed(name, errors[0], valkey, whole=False)
            else:
                self.breaker(name).success()
            for i, a in zip(idx, got, strict=True):
                answers[i] = None if isinstance(a, Exception) else a
        return lost

    def _replica_groups(
        self, client: Any, commands: Sequence[Command], lost: list[int]
    ) -> dict[str, tuple[Any, list[int]]]:
        """The reads among `lost` grouped by a replica of their slot that may be asked
        (connections are READONLY). Replication is asynchronous: a replica may lack the
        newest entries (a miss), never hold wrong ones (keys name their content)."""
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i in lost:
            c = commands[i]
            if c[0] not in _READS:
                continue
            serving = client.nodes_manager.slots_cache.get(client.keyslot(c[1])) or []
            for node in serving[1:]:
                if node.name in groups or self.breaker(node.name).allow():
                    if node.name not in groups:
                        groups[node.name] = (client.get_valkey_connection(node), [])
                    groups[node.name][1].append(i)
                    break
        return groups

    def _refresh_soon(self, skipped: list[str]) -> None:
        """Nodes are skipped (their breakers are open): if one of them is gone (not hung:
        reading the map asks every node it knows), read the slot map again, at most once
        per `MAP_REFRESH_S`; a failover may have given its slots to a replica."""
        now = time.monotonic()
        gone = any(n in self._gone for n in skipped)
        if self.cluster and gone and now - self._refreshed >= MAP_REFRESH_S:
            self._refreshed = now
            self._stale = True

    def _group(self, client: Any, commands: Sequence[Command]) -> dict[str, tuple[Any, list[int]]]:
        """Commands by node: (that node's client, command positions)."""
        if not self.cluster:
            return {_SINGLE: (client, list(range(len(commands))))}
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, c in enumerate(commands):
            node = client.nodes_manager.get_node_from_slot(client.keyslot(c[1]))
            if node.name not in groups:
                groups[node.name] = (client.get_valkey_connection(node), [])
            groups[node.name][1].append(i)
        return groups

    @staticmethod
    def _send(conn: Any, commands: list[Command]) -> list[Any]:
        pipe = conn.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        return list(pipe.execute(raise_on_error=False))

    def _failed(self, node: str, error: Exception, valkey: Any, whole: bool = True) -> None:
        timed_out = isinstance(error, valkey.TimeoutError)
        self.count(**{"remote_timeouts" if timed_out else "remote_errors": 1})
        moved = (valkey.exceptions.MovedError, valkey.exceptions.AskError)
        if isinstance(error, moved) or "MOVED" in str(error) or "ASK" in str(error):
            self._stale = True  # not the node's fault: the slot map is old
            self.breaker(node).success()  # alive (it answered): ends a trial
            return
        if not isinstance(error, (valkey.ConnectionError, valkey.TimeoutError)):
            # The node answered (out of memory, a command refused): it is alive.
            self.breaker(node).success()  # ends a trial, which would block it for good
            log.warning("cas_bank remote tier: node %s refused: %s", node, error)
            return
        self.breaker(node).failure()
        if timed_out:
            self._gone.discard(node)
        else:
            self._gone.add(node)
        if self.cluster and node != _SINGLE and not timed_out:
            # Gone (not hung: reading the map asks every node it knows, a hung one
            # would cost its time-out again): its slots may be served elsewhere now.
            self._stale = True
        log.warning("cas_bank remote tier: node %s failed: %s", node, error)
        if whole and node == _SINGLE:  # connect again next time
            with self._lock:
                client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _purge_node(
    conn: Any, patterns: Sequence[bytes], batch: int, removed: list[int], i: int
) -> None:
    """SCAN one node for each pattern and UNLINK what it finds, `batch` keys a pipeline
    (one key a command: a cluster refuses a multi-key command across slots). Adds what
    it removed to `removed[i]` as it goes (a failure midway keeps the count so far);
    an error answer raises."""
    for pattern in patterns:
        cursor = 0
        while True:
            cursor, found = conn.scan(cursor=cursor, match=pattern, count=batch)
            for lo in range(0, len(found), batch):
                pipe = conn.pipeline(transaction=False)
                for k in found[lo : lo + batch]:
                    pipe.execute_command("UNLINK", k)
                removed[i] += sum(int(a) for a in pipe.execute(raise_on_error=True))
            if int(cursor) == 0:
                break
