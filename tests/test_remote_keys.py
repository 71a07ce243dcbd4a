"""The shared tier's keys and entries: placement, namespacing, and that no entry a
host did not seal under the fleet secret is believed (no server needed)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHECKS
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cas_bank.arrays import DTYPES
from cas_bank.blocks import codec
from cas_bank.blocks.hashing import Check
from cas_bank.config import BankConfig
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.remote import keys
from cas_bank.remote.tier import fleet_key, redact

MKEY = keys.mac_key(b"fleet secret")
ROOT = bytes(range(32))
CHAIN = bytes(range(32, 64))


def _slot_tag(k: bytes) -> bytes:
    return k[k.index(b"{") + 1 : k.index(b"}")]


def _payload(check: Check = "xxh3") -> bytes:
    return codec.encode([np.arange(64, dtype=np.float16)], [DTYPES["float16"]], check=check)


def test_a_blocks_records_share_one_hash_slot_and_blocks_spread() -> None:
    kinds = [keys.key(ROOT, CHAIN, k) for k in ("h", "p", "s")]
    assert len(set(kinds)) == 3
    assert {_slot_tag(k) for k in kinds} == {CHAIN.hex().encode()}
    other = keys.key(ROOT, bytes(32), "h")
    assert _slot_tag(other) != _slot_tag(kinds[0])


def test_keys_carry_the_namespace_root() -> None:
    a, b = keys.key(ROOT, CHAIN, "p"), keys.key(bytes(32), CHAIN, "p")
    assert a != b
    assert a.startswith(keys.namespace_pattern(ROOT)[:-1])


def test_sealed_entries_open_with_the_fleet_key_only() -> None:
    k = keys.key(ROOT, CHAIN, "p")
    payload = _payload()
    entry = keys.seal_payload(MKEY, k, payload)
    assert keys.open_payload(MKEY, k, entry) == payload
    with pytest.raises(CorruptDataError):
        keys.open_payload(keys.mac_key(b"another fleet"), k, entry)
    with pytest.raises(CorruptDataError):  # the same entry under another block's key
        keys.open_payload(MKEY, keys.key(ROOT, bytes(32), "p"), entry)
    hk = keys.key(ROOT, CHAIN, "h")
    assert keys.open_header(MKEY, hk, keys.seal_header(MKEY, hk, b"header")) == b"header"


@settings(max_examples=200, deadline=None)
@given(data=st.data(), check=st.sampled_from(CHECKS))
def test_any_changed_byte_of_an_entry_is_rejected(data: st.DataObject, check: Check) -> None:
    """A flipped byte anywhere fails the MAC (header, digest) or the codec's digest."""
    k = keys.key(ROOT, CHAIN, "p")
    payload = _payload(check)
    entry = bytearray(keys.seal_payload(MKEY, k, payload))
    at = data.draw(st.integers(0, len(entry) - 1))
    entry[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptDataError):
        opened = keys.open_payload(MKEY, k, bytes(entry))
        codec.decode(opened, codec.embedded_digest(payload))


def test_an_xxh3_payloads_mac_covers_every_byte_not_only_its_check() -> None:
    """XXH3-128 is a check against damage, not against a forger: an entry whose body
    was changed under the same digest field fails the MAC itself (blake3 over every
    byte); a blake3 payload's MAC stays over its own digest, as entries were before."""
    k = keys.key(ROOT, CHAIN, "p")
    for check in CHECKS:
        payload = _payload(check)
        entry = keys.seal_payload(MKEY, k, payload)
        forged = bytearray(entry)
        forged[-1] ^= 1  # the body; the digest field and the MAC left as they were
        if check == "xxh3":
            with pytest.raises(CorruptDataError, match="MAC"):
                keys.open_payload(MKEY, k, bytes(forged))
        else:  # the MAC holds over the claimed blake3 digest; the codec refuses the body
            opened = keys.open_payload(MKEY, k, bytes(forged))
            assert not codec.verify(opened)
    old_style = keys.MAGIC + keys._mac(MKEY, k, codec.embedded_digest(_payload("blake3")))
    assert keys.seal_payload(MKEY, k, _payload("blake3")) == old_style + _payload("blake3")


@given(st.binary(max_size=200))
def test_garbage_is_never_an_entry(junk: bytes) -> None:
    with pytest.raises(CorruptDataError):
        keys.open_header(MKEY, keys.key(ROOT, CHAIN, "h"), junk)


def test_the_mac_key_comes_from_the_secret_alone() -> None:
    url = "valkey://cas:pw@127.0.0.1:7000"
    assert fleet_key("s") == keys.mac_key(b"s")
    for none in (None, ""):
        with pytest.raises(InvalidInputError, match="remote_secret"):
            fleet_key(none)
    assert redact(url) == "valkey://cas:***@127.0.0.1:7000"
    # The valkey client also reads a password from the query: so does redact.
    query = "valkey://127.0.0.1:7000/0?password=pw&protocol=3"
    assert redact(query) == "valkey://127.0.0.1:7000/0?password=***&protocol=3"


@pytest.mark.parametrize("secret", [None, ""])
def test_a_shared_tier_without_a_secret_is_refused(secret: str | None) -> None:
    with pytest.raises(ValidationError, match=r"remote needs remote_secret .*could forge") as e:
        BankConfig(remote="valkey://cas:pw@127.0.0.1:7000", remote_secret=secret)
    assert "pw@" not in str(e.value)
    assert BankConfig(remote_secret=secret).remote is None  # no shared tier: nothing asked


@pytest.mark.parametrize(
    "url", ["valkey://cas:pw@127.0.0.1:7000", "valkey://127.0.0.1:7000/0?password=pw"]
)
def test_the_clusters_password_is_no_secret(url: str) -> None:
    with pytest.raises(ValidationError, match="remote_secret is the cluster's password"):
        BankConfig(remote=url, remote_secret="pw")
    # The refusal does not print its input: neither the secret nor the password.
    leaked = url.replace("pw", "Hunter2-sekrit")
    with pytest.raises(ValidationError) as e:
        BankConfig(remote=leaked, remote_secret="Hunter2-sekrit", block_size=8)
    assert "Hunter2" not in str(e.value) and "input_value" not in str(e.value)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:7000", "valkey://127.0.0.1", "valkey://:7000", "valkey://h:notaport"],
)
def test_a_bad_remote_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match="remote"):
        BankConfig(remote=url, remote_secret="s")


def test_remote_urls_accepted() -> None:
    for url in ("valkey://h:1", "valkeys://u:p@h:6380", "redis://:p@h:6379"):
        assert BankConfig(remote=url, remote_secret="s").remote == url
    assert BankConfig().remote is None
    assert "pw" not in repr(BankConfig(remote="valkey://u:pw@h:1", remote_secret="s3cr3t"))
    assert "s3cr3t" not in repr(BankConfig(remote="valkey://u:pw@h:1", remote_secret="s3cr3t"))


def test_an_end_records_mac_covers_an_xxh3_payload_too() -> None:
    """An end entry's MAC covers its end header (which names the payload's digest) and,
    for an XXH3-128 payload, a blake3 digest of the payload: changed payload bytes under
    the same header fail the MAC."""
    k = b"cb1:end-key"
    header = b"an end header"
    for check in CHECKS:
        payload = _payload(check)
        entry = keys.seal_end(MKEY, k, header, payload)
        assert keys.open_end(MKEY, k, entry, len(header)) == header + payload
        forged = bytearray(entry)
        forged[-1] ^= 1
        if check == "xxh3":
            with pytest.raises(CorruptDataError, match="MAC"):
                keys.open_end(MKEY, k, bytes(forged), len(header))
        else:  # the header's blake3 digest then refuses the payload (`decode_end`)
            value = keys.open_end(MKEY, k, bytes(forged), len(header))
            assert not codec.verify(value[len(header) :])
    blake3_entry = keys.seal_end(MKEY, k, header, _payload("blake3"))
    assert blake3_entry == keys.seal_header(MKEY, k, header) + _payload("blake3")  # as before
