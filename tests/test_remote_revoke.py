"""A revoke removes the tenant's entries from the shared tier too: on a real 3-master
cluster, a fresh host then restores nothing of the revoked tenant and all of another's;
a master that does not answer leaves the purge incomplete (said, not raised, no hang),
and revoking again (`cas-bank revoke --remote`) finishes it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cas_bank.tools import cli
from conftest import (
    BLOCK_SIZE,
    FLEET_SECRET,
    attention_spec,
    bits,
    kv_prefix_bits,
    layers_bits,
    prefix_layers,
    remote_config,
    tokens_of,
)

from cas_bank import Bank
from cas_bank.remote import keys

ATT = attention_spec()
SALT_A, SALT_B = "tenant-a-secret", "tenant-b-secret"


def _under(cluster: Any, root: bytes) -> int:
    prefix = keys.namespace_pattern(root)[:-1]
    return sum(1 for k in cluster.all_keys() if k.startswith(prefix))


def test_a_revoke_purges_the_tenant_from_the_cluster_and_nothing_else(
    cluster: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = remote_config(cluster.url(0), remote_retry_after=0.1)
    rng = np.random.default_rng(44)
    toks = {s: tokens_of(rng, 8 * BLOCK_SIZE + 3) for s in (SALT_A, SALT_B)}
    layers = {s: prefix_layers(ATT, t) for s, t in toks.items()}
    logits = mx.array(rng.standard_normal(50).astype(np.float32))
    a = Bank.open(tmp_path / "a", config)
    try:
        for salt in (SALT_A, SALT_B):
            ns = a.namespace(ATT, salt=salt)
            ns.store(toks[salt], layers[salt])
            ns.store_end(toks[salt], layers[salt], logits=logits)
        a.flush()  # published: headers, payloads, children and the end record
        root_a, root_b = a.namespace(ATT, salt=SALT_A).root, a.namespace(ATT, salt=SALT_B).root
        held_a, held_b = _under(cluster, root_a), _under(cluster, root_b)
        assert held_a >= 8 * 3 + 1 and held_b == held_a

        cluster.pause(2)  # a hung master: its keys stay, the others' go
        try:
            t0 = time.monotonic()
            first = a.revoke(SALT_A)
            took = time.monotonic() - t0
        finally:
            cluster.resume(2)
        assert first.remote_purged is False and len(first.remote_failed) == 1
        assert 0 < first.remote_keys < held_a and took < 5.0
        assert first.blocks == 8 and first.ends == 1  # the local revoke went on
        assert _under(cluster, root_b) == held_b
    finally:
        a.close()

    bank = str(tmp_path / "a")
    capsys.readouterr()
    assert cli.main(["revoke", bank, SALT_A, "--json"]) == 0  # no --remote: said
    assert "--remote" in capsys.readouterr().err
    monkeypatch.setenv("CAS_BANK_REMOTE_SECRET", FLEET_SECRET)
    assert cli.main(["revoke", bank, SALT_A, "--remote", cluster.url(1), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["remote_purged"] is True and second["remote_failed"] == []
    assert first.remote_keys + second["remote_keys"] == held_a and second["blocks"] == 0
    assert _under(cluster, root_a) == 0 and _under(cluster, root_b) == held_b

    fresh = Bank.open(tmp_path / "fresh", config)
    try:
        assert fresh.namespace(ATT, salt=SALT_A).restore(toks[SALT_A]) is None
        hit = fresh.namespace(ATT, salt=SALT_B).restore(toks[SALT_B])
        assert hit is not None and hit.exact and hit.tokens == len(toks[SALT_B])
        assert hit.logits is not None and bits(hit.logits) == bits(logits)
        assert layers_bits(hit.layers, ATT) == kv_prefix_bits(layers[SALT_B], ATT, hit.tokens)
    finally:
        fresh.close()
