"""`RemoteClient`: pipelines to a Valkey cluster or a single server, with time-outs,
a circuit breaker and counters, never an exception to its caller.

Connecting is lazy (the first call) and detects cluster mode (`INFO cluster` on the
node of the URL): a cluster gets a `valkey.ValkeyCluster`, a plain server a
`valkey.Valkey`. Every call is one pipeline: `run` sends all its commands, reads
every answer, and returns them in order, with None for any command that failed
(and the whole call None when the tier could not be reached). Cluster pipelines
write to every master involved before reading any, so one call is one round trip
whatever the number of masters; redirections are not chased command by command (a
topology change costs one failed call, then the slot map is read again).

Failures are counted (`remote_errors`, `remote_timeouts`) and feed the breaker: after
two in a row the tier is not asked for `remote_retry_after` seconds
(`remote_skipped` counts the calls it answered None without asking).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cas_bank.remote.breaker import Breaker

log = logging.getLogger("cas_bank.remote")

Command = tuple[Any, ...]
Count = Callable[..., None]


class RemoteClient:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        timeout: float,
        retry_after: float,
        count: Count,
    ) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.breaker = Breaker(failures=2, retry_after=retry_after)
        self.count = count
        self.cluster: bool | None = None  # known after the first connection
        self._client: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        valkey: Any = importlib.import_module("valkey")  # its stubs are partial: used untyped

        with self._lock:
            if self._client is not None:
                return self._client
            opts: dict[str, Any] = dict(
                socket_timeout=self.timeout, socket_connect_timeout=self.connect_timeout
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
                    **opts,
                )
            else:
                self._client = probe
            self.cluster = enabled
            return self._client

    def run(self, commands: Sequence[Command]) -> list[Any] | None:
        """Answers to `commands` in order (None for each that failed), or None when the
        tier was not asked (breaker open) or could not be reached. Never raises."""
        if not commands:
            return []
        if not self.breaker.allow():
            self.count(remote_skipped=1)
            return None
        valkey: Any = importlib.import_module("valkey")
        try:
            client = self._connect()
            pipe = client.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            if self.cluster:
                answers = pipe.send_cluster_commands(
                    pipe.command_stack, raise_on_error=False, allow_redirections=False
                )
                pipe.reset()
            else:
                answers = pipe.execute(raise_on_error=False)
        except valkey.TimeoutError as e:
            self._failed("timeouts", e)
            return None
        except Exception as e:  # a dead node, a wrong password, a broken cluster
            self._failed("errors", e)
            return None
        failures = [a for a in answers if isinstance(a, Exception)]
        if failures:  # some node failed (the call counts once, as a time-out or an error)
            timed_out = any(isinstance(a, valkey.TimeoutError) for a in failures)
            self.count(**{"remote_timeouts" if timed_out else "remote_errors": 1})
            self.breaker.failure()
            log.warning("cas_bank remote tier: %d commands failed: %s", len(failures), failures[0])
        else:
            self.breaker.success()
        return [None if isinstance(a, Exception) else a for a in answers]

    def _failed(self, kind: str, error: Exception) -> None:
        self.count(**{f"remote_{kind}": 1})
        self.breaker.failure()
        log.warning("cas_bank remote tier unavailable (%s): %s", kind, error)
        with self._lock:  # connect again next time (a new slot map, a node back)
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
