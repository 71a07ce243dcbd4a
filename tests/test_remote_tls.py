"""The shared tier over TLS (`valkeys://`), on real servers built with TLS: a 3-master
cluster that asks every client for a certificate (mutual TLS; the cluster bus speaks
TLS too) and a single server that does not. The wheel's valkey-server has no TLS, so
these run Debian's redis-server (same protocol, same cluster bus); `.ci/run` installs
it. Certificates are made here, by the `openssl` CLI, in a temporary directory.

A wrong CA, a plain-text client, a missing client certificate: each is a counted
error and a local result within the time-outs, never an exception into the caller.
A missing TLS file is refused at open, naming the file. The password is never shown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    FLEET_SECRET,
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    random_state,
    remote_config,
    state_bits,
    tokens_of,
)
from pydantic import ValidationError

from cas_bank import Bank, BankConfig
from cas_bank.errors import InvalidInputError
from cas_bank.remote.local_cluster import (
    NO_TLS_SERVER,
    LocalCluster,
    TLSFiles,
    make_tls_files,
    tls_server_binary,
)

TIMEOUT = 0.3  # remote_timeout of remote_config
BOUND = 2 * TIMEOUT + 0.5  # a request's worst extra time (as in test_remote_faults)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_binary() -> Path:
    binary = tls_server_binary()
    if binary is None:
        pytest.skip(NO_TLS_SERVER)
    return binary


@pytest.fixture(scope="module")
def tls_cluster_module(tls_binary: Path, tls_files: TLSFiles) -> Iterator[LocalCluster]:
    """3 masters, TLS only (clients, bus, replication), client certificates required."""
    with LocalCluster(3, binary=tls_binary, tls=tls_files, tls_auth_clients=True) as c:
        yield c


@pytest.fixture
def tls_cluster(tls_cluster_module: LocalCluster) -> LocalCluster:
    tls_cluster_module.flushall()
    return tls_cluster_module


def mtls(files: TLSFiles, **more: Any) -> dict[str, Any]:
    """The BankConfig TLS settings of a host of the mutual-TLS cluster."""
    settings: dict[str, Any] = dict(
        remote_tls_ca=str(files.ca),
        remote_tls_cert=str(files.client_cert),
        remote_tls_key=str(files.client_key),
    )
    settings.update(more)
    return settings


def _store(bank: Bank, toks: list[int]) -> list[Any]:
    layers = prefix_layers(attention_spec(), toks)
    bank.namespace(attention_spec()).store(toks, layers)
    return layers


def _timed_restore(bank: Bank, toks: list[int]) -> tuple[Any, float]:
    t = time.perf_counter()
    hit = bank.namespace(attention_spec()).restore(toks)
    return hit, time.perf_counter() - t


def test_an_empty_host_restores_through_a_tls_cluster(
    tls_cluster: LocalCluster, tls_files: TLSFiles, tmp_path: Path
) -> None:
    url = tls_cluster.url(1)
    assert url.startswith("valkeys://")
    a = Bank.open(tmp_path / "a", remote_config(url, **mtls(tls_files)))
    b = Bank.open(tmp_path / "b", remote_config(url, **mtls(tls_files)))
    try:
        rng = np.random.default_rng(40)
        spec = attention_spec()
        toks = tokens_of(rng, 10 * BLOCK_SIZE + 1)
        layers = _store(a, toks)
        hy = hybrid_spec()
        htoks = tokens_of(rng, 7 * BLOCK_SIZE)
        hlayers = prefix_layers(hy, htoks)
        state = random_state(hy, seed=41)
        a.namespace(hy).store(htoks, hlayers, {6 * BLOCK_SIZE: state})
        a.flush()
        assert a.stats().remote_publishes == 10 + 7 + 1
        assert a.remote is not None and a.remote.client.cluster is True  # detected over TLS
        assert len({k.split(b"}")[0] for k in tls_cluster.all_keys()}) >= 16
        hit = b.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 10 * BLOCK_SIZE
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, hit.tokens)
        hhit = b.namespace(hy).restore(htoks)
        assert hhit is not None and hhit.tokens == 6 * BLOCK_SIZE
        assert state_bits(hhit.layers, hy) == state_bits(state, hy)
        assert layers_bits(hhit.layers, hy) == kv_prefix_bits(hlayers, hy, hhit.tokens)
        s = b.stats()
        assert s.remote_hit_blocks == 16 and s.remote_rejected == 0
        assert s.remote_errors == 0 and s.remote_timeouts == 0
    finally:
        a.close()
        b.close()


def test_a_single_tls_server(tls_binary: Path, tls_files: TLSFiles, tmp_path: Path) -> None:
    """A plain (non-cluster) server over TLS, no client certificate asked: the CA only."""
    with LocalCluster(1, cluster=False, binary=tls_binary, tls=tls_files) as server:
        cfg = remote_config(server.url(), remote_tls_ca=str(tls_files.ca))
        with Bank.open(tmp_path / "a", cfg) as a, Bank.open(tmp_path / "b", cfg) as b:
            toks = tokens_of(np.random.default_rng(42), 5 * BLOCK_SIZE)
            layers = _store(a, toks)
            a.flush()
            assert a.remote is not None and a.remote.client.cluster is False
            hit = b.namespace(attention_spec()).restore(toks)
            assert hit is not None and hit.tokens == 5 * BLOCK_SIZE
            assert layers_bits(hit.layers, attention_spec()) == kv_prefix_bits(
                layers, attention_spec(), hit.tokens
            )
            assert len([k for k in server.all_keys() if not k.endswith(b":c")]) == 10


def _faulty_host_goes_on(bank: Bank, cluster: LocalCluster, seed: int) -> Any:
    """Store (published nowhere), restore locally in bounded time; the stats after."""
    toks = tokens_of(np.random.default_rng(seed), 4 * BLOCK_SIZE)
    layers = _store(bank, toks)
    t = time.perf_counter()
    bank.flush()
    assert time.perf_counter() - t < BOUND + 1.0
    for _ in range(3):
        hit, took = _timed_restore(bank, [*toks, *toks])  # longer than local: asks
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE and took < BOUND
        assert layers_bits(hit.layers, attention_spec()) == kv_prefix_bits(
            layers, attention_spec(), hit.tokens
        )
    s = bank.stats()
    assert s.remote_errors + s.remote_timeouts >= 1 and s.remote_publishes == 0
    assert cluster.all_keys() == []
    return s


def test_a_wrong_ca_is_counted_and_local_results_go_on(
    tls_cluster: LocalCluster, tls_files: TLSFiles, tmp_path: Path, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = remote_config(tls_cluster.url(), **mtls(tls_files, remote_tls_ca=str(tls_files.other_ca)))
    with Bank.open(tmp_path / "a", cfg) as bank:
        s = _faulty_host_goes_on(bank, tls_cluster, 43)
        assert "certificate verify failed" in caplog.text  # the cause is in the log
        shown = [caplog.text, repr(cfg), str(cfg), repr(s), str(s.model_dump()), repr(bank)]
        shown.append(bank.remote.url if bank.remote else "")
        assert all(tls_cluster.password not in text for text in shown)
        assert s.remote == tls_cluster.url().replace(tls_cluster.password, "***")


def test_a_plain_text_client_against_the_tls_port(
    tls_cluster: LocalCluster, tmp_path: Path
) -> None:
    url = tls_cluster.url().replace("valkeys://", "valkey://")
    with Bank.open(tmp_path / "a", remote_config(url)) as bank:
        _faulty_host_goes_on(bank, tls_cluster, 44)


def test_mutual_tls_without_a_client_certificate_is_refused(
    tls_cluster: LocalCluster, tls_files: TLSFiles, tmp_path: Path
) -> None:
    cfg = remote_config(tls_cluster.url(), remote_tls_ca=str(tls_files.ca))
    with Bank.open(tmp_path / "a", cfg) as bank:
        _faulty_host_goes_on(bank, tls_cluster, 45)


def test_tls_settings_are_checked(tls_files: TLSFiles, tmp_path: Path) -> None:
    url = "valkeys://cas:secret-pw@127.0.0.1:1"
    missing = tmp_path / "nowhere" / "ca.pem"
    with pytest.raises(InvalidInputError, match=r"remote_tls_ca: no readable file at .*ca\.pem"):
        Bank.open(
            tmp_path / "a",
            BankConfig(remote=url, remote_secret=FLEET_SECRET, remote_tls_ca=str(missing)),
        )
    with pytest.raises(InvalidInputError, match="remote_tls_key"):
        Bank.open(
            tmp_path / "a",
            BankConfig(
                remote=url,
                remote_secret=FLEET_SECRET,
                remote_tls_cert=str(tls_files.cert),
                remote_tls_key=str(missing),
            ),
        )
    assert not (tmp_path / "a").exists()  # refused before anything was created
    with pytest.raises(ValidationError, match="not a TLS URL"):
        BankConfig(
            remote="valkey://127.0.0.1:1",
            remote_secret=FLEET_SECRET,
            remote_tls_ca=str(tls_files.ca),
        )
    with pytest.raises(ValidationError, match="go together"):
        BankConfig(remote=url, remote_secret=FLEET_SECRET, remote_tls_cert=str(tls_files.cert))
    with pytest.raises(ValidationError, match="scheme 'https'") as e:
        BankConfig(remote="https://cas:secret-pw@127.0.0.1:1")
    assert "secret-pw" not in str(e.value)
    cfg = BankConfig(remote=url, remote_secret=FLEET_SECRET, remote_tls_ca=str(tls_files.ca))
    assert "secret-pw" not in repr(cfg) and FLEET_SECRET not in repr(cfg)


def test_serve_passes_the_tls_files_through(
    tls_cluster: LocalCluster,
    tls_files: TLSFiles,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cas_bank.runtime.engine import Engine
    from cas_bank.tools import cli

    monkeypatch.setenv("CAS_BANK_REMOTE_SECRET", FLEET_SECRET)
    # `serve`'s flags: a missing file is refused, named, and the password not shown.
    url = tls_cluster.url()
    missing = str(tmp_path / "no-ca.pem")
    argv = ["serve", "--bank", str(tmp_path / "s"), "--remote", url, "--remote-tls-ca", missing]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert "remote_tls_ca" in err and "no-ca.pem" in err and tls_cluster.password not in err
    argv = ["serve", "--bank", str(tmp_path / "s"), "--remote", url, "--remote-tls-cert", missing]
    assert cli.main(argv) != 0
    assert "go together" in capsys.readouterr().err
    # What `serve` opens with them reaches the mutual-TLS cluster.
    engine = Engine.open(
        tmp_path / "e",
        remote=url,
        remote_secret=FLEET_SECRET,
        remote_tls_ca=str(tls_files.ca),
        remote_tls_cert=str(tls_files.client_cert),
        remote_tls_key=str(tls_files.client_key),
    )
    try:
        remote = engine.bank.remote
        assert remote is not None
        assert remote.client.run([("EXISTS", b"cas_bank-tls-probe")]) == [0]
        assert remote.client.cluster is True
        assert engine.bank.stats().remote_errors == 0
    finally:
        engine.close()
