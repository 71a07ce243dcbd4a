"""A delaying TCP proxy on loopback: network latency between hosts, for tests and
benchmarks (this machine's kernel has no `netem` qdisc).

`python -m cas_bank.remote.delay RTT_MS LISTEN:TARGET ...` listens on each
127.0.0.1:LISTEN and forwards every connection to 127.0.0.1:TARGET, holding each chunk
RTT_MS / 2 in each direction (so a request and its answer cost RTT_MS more), bytes in
order. It prints `ready` once every port listens and runs until its stdin closes.
`LocalCluster(rtt=...)` runs one in front of its nodes and makes each node announce
its proxy's port (`cluster-announce-port`), so slot maps, MOVED answers and
replication go through it. Only 127.0.0.1 is ever bound or dialled.

One thread, one `select` loop (its time-out has microsecond resolution, unlike
epoll's milliseconds): each chunk read is stamped with the time it may leave and
written, non-blocking, once due. A process that sleeps wakes milliseconds late on a
loaded machine, so the proxy asks for real-time scheduling (SCHED_FIFO, where it is
allowed: root) and says on its ready line whether it got it; it sleeps whenever
nothing is due, so it takes little CPU. A delay adds latency, not a bandwidth cap: chunks
pipeline behind one another.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import sys
import time
from typing import Any

HOST = "127.0.0.1"
CHUNK = 1 << 18


class _Side:
    """One socket of a proxied connection and what waits to be written to it."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer: _Side | None = None
        self.due: collections.deque[tuple[float, bytes]] = collections.deque()  # not yet
        self.out = bytearray()  # due, not yet accepted by the kernel
        self.eof = False  # the peer closed: close this side once drained

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Proxy:
    def __init__(self, delay: float, pairs: list[tuple[int, int]]) -> None:
        self.delay = delay
        self.listeners = {socket.create_server((HOST, p)): target for p, target in pairs}
        for server in self.listeners:
            server.setblocking(False)
        self.sides: dict[socket.socket, _Side] = {}

    def _accept(self, server: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            client, _ = server.accept()
            try:
                upstream = socket.create_connection((HOST, self.listeners[server]), timeout=2)
            except OSError:
                client.close()  # the node is down: as it would be without the proxy
                return
            a, b = _Side(client), _Side(upstream)
            a.peer, b.peer = b, a
            self.sides[client], self.sides[upstream] = a, b

    def _drop(self, side: _Side) -> None:
        for s in (side, side.peer):
            if s is not None and s.sock in self.sides:
                del self.sides[s.sock]
                s.close()

    def _read(self, side: _Side) -> None:
        try:
            data = side.sock.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        peer = side.peer
        assert peer is not None
        if not data:  # closed: the peer gets what is queued, then is closed too
            del self.sides[side.sock]
            side.close()
            peer.eof = True
            return
        peer.due.append((time.monotonic() + self.delay, data))

    def _write(self, side: _Side, now: float) -> None:
        while side.due and side.due[0][0] <= now:
            side.out += side.due.popleft()[1]
        if side.out:
            try:
                n = side.sock.send(side.out)
                del side.out[:n]
            except BlockingIOError:
                pass
            except OSError:
                self._drop(side)
                return
        if side.eof and not side.out and not side.due:
            self._drop(side)

    def serve(self, stop: Any = None) -> None:
        """Forward until `stop` (anything with a `fileno`) turns readable."""
        while True:
            now = time.monotonic()
            for side in list(self.sides.values()):
                if side.sock in self.sides:
                    self._write(side, now)
            dues = [s.due[0][0] for s in self.sides.values() if s.due]
            timeout = max(0.0, min(dues) - time.monotonic()) if dues else 1.0
            readers = [*self.listeners, *self.sides]
            if stop is not None:
                readers.append(stop)
            writers = [s.sock for s in self.sides.values() if s.out]
            ready, _, _ = select.select(readers, writers, [], timeout)
            for sock in ready:
                if sock is stop:
                    return
                if sock in self.listeners:
                    self._accept(sock)
                elif sock in self.sides:
                    self._read(self.sides[sock])


def main(argv: list[str]) -> None:
    rtt_ms, pairs = float(argv[0]), argv[1:]
    parsed = [(int(a), int(b)) for a, b in (p.split(":") for p in pairs)]
    proxy = Proxy(rtt_ms / 2000.0, parsed)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        realtime = "realtime"
    except (OSError, AttributeError):
        realtime = "not realtime"
    print("ready", realtime, flush=True)
    proxy.serve(sys.stdin)  # readable when the parent writes or closes it: stop


if __name__ == "__main__":
    main(sys.argv[1:])
