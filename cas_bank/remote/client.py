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
call; a node that times out does not (the map would be asked of it again).

TLS: a `valkeys://` (or `rediss://`) URL connects with TLS, to the node of the URL and
to every node the slot map names; `tls_options` gives the CA file and the client
certificate (mutual TLS) from `BankConfig`. Servers are always verified. A handshake
that fails (an unknown CA, a missing client certificate, a plain-text server) is a
connection error like any other: counted, the breaker opened, never raised.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cas_bank.config import BankConfig
from cas_bank.errors import InvalidInputError
from cas_bank.remote.breaker import Breaker

log = logging.getLogger("cas_bank.remote")

Command = tuple[Any, ...]
Count = Callable[..., None]
_SINGLE = "server"  # the node name of a plain (non-cluster) server


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

    def breaker(self, node: str) -> Breaker:
        with self._lock:
            b = self._breakers.get(node)
            if b is None:
                b = self._breakers[node] = Breaker(failures=1, retry_after=self.retry_after)
            return b

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
                    self.url, cluster_error_retry_attempts=1, require_full_coverage=False, **opts
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
        if len(asked) < len(groups):
            self.count(remote_skipped=1)
        if not asked:
            return None
        jobs = {
            name: self._pool.submit(self._send, conn, [commands[i] for i in idx])
            for name, (conn, idx) in asked.items()
        }
        for name, job in jobs.items():
            _, idx = asked[name]
            try:
                got = job.result()
            except Exception as e:
                self._failed(name, e, valkey)
                continue
            errors = [a for a in got if isinstance(a, Exception)]
            if errors:
                self._failed(name, errors[0], valkey, whole=False)
            else:
                self.breaker(name).success()
            for i, a in zip(idx, got, strict=True):
                answers[i] = None if isinstance(a, Exception) else a
        return answers

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
