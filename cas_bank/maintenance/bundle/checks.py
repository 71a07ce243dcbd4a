"""A bundle's records under another payload check (docs/design.md, "Payload codec").

What crosses to another machine is bound by blake3: `export` writes every payload,
state and end record of a bundle with a blake3 digest (a bank's XXH3-128 records are
verified, then re-digested), so the bundle format is unchanged and an older cas_bank
imports it; `import` verifies the blake3 digests, then writes each record under the
check the importing bank writes (`Bank.payload_check`). Only the digest field of a
payload changes, and the header digest that names it.
"""

from __future__ import annotations

from dataclasses import replace

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import Check
from cas_bank.index import ends
from cas_bank.index.chain import Header
from cas_bank.maintenance.bundle.format import Bundle, BundleEntry


def header_as(h: Header, payload: bytes, state: bytes | None) -> Header:
    """`h` naming `payload` (and `state`, when it announces one) by their digests."""
    out = h._replace(payload_digest=codec.embedded_digest(payload))
    if state is not None and h.state_digest is not None:
        out = out.with_state(codec.embedded_digest(state), len(state))
    return out


def block_as(
    h: Header, payload: bytes, state: bytes | None, check: Check
) -> tuple[Header, bytes, bytes | None]:
    """A block's header, payload and state with `check` digests (payloads that fail
    their own raise `CorruptDataError`)."""
    payload = codec.with_check(payload, check)
    state = codec.with_check(state, check) if state is not None else None
    return header_as(h, payload, state), payload, state


def end_as(key: bytes, value: bytes, check: Check) -> bytes:
    """An end record's value with a `check` digest (its header names the new one)."""
    return ends.with_check(key, value, check)


def bundle_as(bundle: Bundle, check: Check) -> Bundle:
    """`bundle` (checked) with every record under `check`."""
    entries = [BundleEntry(*block_as(e.header, e.payload, e.state, check)) for e in bundle.entries]
    ends = [(k, end_as(k, v, check)) for k, v in bundle.ends]
    return replace(bundle, entries=entries, ends=ends)
