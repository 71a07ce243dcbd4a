"""Keys and entries of the shared (Valkey) tier: what a host writes, and how another
host checks it before believing a byte of it.

Keys, one record each, all under the block's chain hash:

    cb1:<root 8 bytes hex>:{<chain hash hex>}:h   header (Header.encode, state fields empty)
    cb1:<root 8 bytes hex>:{<chain hash hex>}:p   block payload (codec format)
    cb1:<root 8 bytes hex>:{<chain hash hex>}:s   recurrent state at the block's end

The `{...}` hash tag puts a block's header, payload and state in one cluster slot
(so on one master), and different blocks on slots spread over the masters. The
chain hash derives from the namespace root (model identity, block size and, when a
runtime sets one, the tenant's salt), so every key a host writes is per model and per
tenant; the root's prefix is spelled out as well, so an operator can find (SCAN) a
namespace's keys.

Entries: magic `CBR1` | MAC (32 bytes) | body. The MAC is keyed blake3 under the
fleet secret, over the key and (header) the header bytes or (payload, state) the
payload's own blake3 digest, which `codec.decode` then checks against the body: a
forged or damaged entry fails one or the other and is a rejected miss. A payload whose
own check is XXH3-128 (format version 4: a local check against damage, not against a
forger who could make another payload with the same XXH3) is covered by a blake3
digest of all its bytes instead (`_covered`): what crosses to another host is always
bound by blake3. Nothing read
from the cluster is interpreted otherwise than by `Header.decode` and `codec.decode`
(fixed binary layouts): no pickle, no code.
"""

from __future__ import annotations

import hmac
from typing import Literal

import blake3

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import check_of, digest
from cas_bank.errors import CorruptDataError

KEY_VERSION = b"cb1"
MAGIC = b"CBR1"
MAC_SIZE = 32
MAC_CONTEXT = "cas_bank 2026-11-30 remote tier mac key v1"

Kind = Literal["h", "p", "s", "c"]  # "c": a parent's children (`remote.children`)


def mac_key(secret: bytes) -> bytes:
    """The 32-byte MAC key of a fleet secret (any length)."""
    return blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()


def key(root: bytes, chain_hash: bytes, kind: Kind) -> bytes:
    return b"%s:%s:{%s}:%s" % (
        KEY_VERSION,
        root[:8].hex().encode(),
        chain_hash.hex().encode(),
        kind.encode(),
    )


def namespace_pattern(root: bytes) -> bytes:
    """A SCAN pattern matching every key of the namespace `root`."""
    return b"%s:%s:*" % (KEY_VERSION, root[:8].hex().encode())


def _mac(mkey: bytes, k: bytes, covered: bytes) -> bytes:
    h = blake3.blake3(key=mkey)
    h.update(len(k).to_bytes(4, "little"))
    h.update(k)
    h.update(covered)
    return h.digest()


def seal_header(mkey: bytes, k: bytes, header: bytes) -> bytes:
    return MAGIC + _mac(mkey, k, header) + header


def _covered(payload: bytes) -> bytes:
    """What a payload entry's MAC covers: its own digest when that is blake3 (it covers
    every byte), else a blake3 digest of every byte."""
    claimed = codec.embedded_digest(payload)
    return claimed if check_of(claimed) == "blake3" else digest(payload)


def seal_payload(mkey: bytes, k: bytes, payload: bytes) -> bytes:
    """A payload entry; the MAC covers a blake3 digest of every byte of it."""
    return MAGIC + _mac(mkey, k, _covered(payload)) + payload


def _end_covered(header: bytes, payload: bytes) -> bytes:
    """What an end record entry's MAC covers: its end header (which names the payload's
    blake3 digest), and for an XXH3-128 payload a blake3 digest of every payload byte."""
    claimed = codec.embedded_digest(payload)
    return header if check_of(claimed) == "blake3" else header + digest(payload)


def seal_end(mkey: bytes, k: bytes, header: bytes, payload: bytes) -> bytes:
    """An end record entry: `CBR1 | MAC | end header | payload`."""
    return MAGIC + _mac(mkey, k, _end_covered(header, payload)) + header + payload


def open_end(mkey: bytes, k: bytes, entry: bytes, header_len: int) -> bytes:
    """The record value of an end entry whose MAC holds (its end header is the first
    `header_len` bytes of the value); `CorruptDataError` otherwise."""
    mac, body = _split(entry)
    value = bytes(body)
    covered = _end_covered(value[:header_len], value[header_len:])
    if not hmac.compare_digest(mac, _mac(mkey, k, covered)):
        raise CorruptDataError("remote end record MAC mismatch")
    return value


def _split(entry: bytes) -> tuple[bytes, memoryview]:
    if len(entry) < len(MAGIC) + MAC_SIZE or entry[: len(MAGIC)] != MAGIC:
        raise CorruptDataError("not a cas_bank remote entry (bad magic or truncated)")
    view = memoryview(entry)
    return bytes(view[len(MAGIC) : len(MAGIC) + MAC_SIZE]), view[len(MAGIC) + MAC_SIZE :]


def open_header(mkey: bytes, k: bytes, entry: bytes) -> bytes:
    """The header bytes of a header entry whose MAC holds; `CorruptDataError` otherwise."""
    mac, body = _split(entry)
    header = bytes(body)
    if not hmac.compare_digest(mac, _mac(mkey, k, header)):
        raise CorruptDataError("remote header MAC mismatch")
    return header


def open_payload(mkey: bytes, k: bytes, entry: bytes) -> bytes:
    """The payload of an entry whose MAC holds over its claimed (blake3) digest.

    The digest itself is checked against the bytes by `codec.decode` when the payload
    is read, as for a local payload; `CorruptDataError` here if the MAC fails.
    """
    mac, body = _split(entry)
    payload = bytes(body)
    if not hmac.compare_digest(mac, _mac(mkey, k, _covered(payload))):
        raise CorruptDataError("remote payload MAC mismatch")
    return payload
