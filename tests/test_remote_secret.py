"""The shared tier's own secret: nothing of the cluster's URL or credentials keys the
MAC, so someone who can log into the cluster (its password) but lacks the fleet secret
cannot write an entry a host believes; and no host starts without a secret.

Real Valkey servers (`LocalCluster`, the session's cluster of `conftest`)."""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    FLEET_SECRET,
    attention_spec,
    prefix_layers,
    remote_config,
    tokens_of,
)
from tool_banks import CLI

from cas_bank import Bank
from cas_bank.config import url_credentials
from cas_bank.remote import keys


def password_keys(url: str) -> dict[str, bytes]:
    """MAC keys whoever holds the cluster's URL and password can derive: the one
    cas_bank derived when no secret was set, and the password itself as a secret."""
    user, password = url_credentials(url)
    return {
        "url credentials (the old fallback)": keys.mac_key(
            b"cas_bank url credentials:" + f"{user}:{password}".encode()
        ),
        "the password": keys.mac_key(password.encode()),
        "user:password": keys.mac_key(f"{user}:{password}".encode()),
    }


def reseal_everything(cluster: Any, mkey: bytes) -> int:
    """Logged in with the cluster's password, rewrite every entry with its own bytes
    sealed under `mkey`: a chain as consistent as the honest one but for the key."""
    valkey: Any = importlib.import_module("valkey")
    n = 0
    with valkey.ValkeyCluster.from_url(cluster.url(), **cluster.client_tls()) as c:
        for k in cluster.all_keys():
            if k.endswith(b":c"):
                continue  # a children set: advice, not sealed (remote.children)
            entry = c.get(k)
            body = entry[len(keys.MAGIC) + keys.MAC_SIZE :]
            seal = keys.seal_header if k.endswith(b":h") else keys.seal_payload
            c.set(k, seal(mkey, k, body))
            n += 1
    return n


def test_entries_sealed_with_only_the_clusters_password_are_rejected(
    cluster: Any, tmp_path: Path
) -> None:
    spec = attention_spec()
    toks = tokens_of(np.random.default_rng(26), 4 * BLOCK_SIZE)
    with Bank.open(tmp_path / "a", remote_config(cluster.url())) as a:
        a.namespace(spec).store(toks, prefix_layers(spec, toks))
        a.flush()
    for i, (how, mkey) in enumerate(password_keys(cluster.url()).items()):
        assert reseal_everything(cluster, mkey) >= 8  # 4 headers, 4 payloads
        with Bank.open(tmp_path / f"b{i}", remote_config(cluster.url())) as b:
            assert b.namespace(spec).restore(toks) is None, how
            assert b.stats().remote_rejected == 1, how  # the first header: the chain stops
    # The same rewrite under the fleet secret (which only a host holds) is believed:
    # what the hosts above refused was the key, nothing else.
    reseal_everything(cluster, keys.mac_key(FLEET_SECRET.encode()))
    with Bank.open(tmp_path / "c", remote_config(cluster.url())) as c:
        hit = c.namespace(spec).restore(toks)
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE
        assert c.stats().remote_rejected == 0


def test_serve_with_remote_and_no_secret_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CAS_BANK_REMOTE_SECRET"}
    for secret in (None, ""):
        if secret is not None:
            env["CAS_BANK_REMOTE_SECRET"] = secret
        bank = tmp_path / "nested" / "bank"
        proc = subprocess.run(
            [*CLI, "serve", "--bank", str(bank), "--remote", "valkey://cas:pw@127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cas-bank: error: "), proc.stderr
        assert "$CAS_BANK_REMOTE_SECRET" in lines[0] and "forge" in lines[0]
        assert "pw@" not in proc.stderr
        assert not (tmp_path / "nested").exists()  # refused before anything was made


@pytest.mark.parametrize("secret", [None, ""])
def test_bank_open_with_a_remote_and_no_secret_is_refused(
    secret: str | None, tmp_path: Path
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="remote needs remote_secret"):
        Bank.open(tmp_path / "a", remote_config("valkey://127.0.0.1:1", remote_secret=secret))
    assert not (tmp_path / "a").exists()
