"""Choosing a chain of a bank and writing it, with its states, end records and
namespace, to a bundle file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from cas_bank.blocks import codec
from cas_bank.blocks.damage import full_error, is_no_space
from cas_bank.blocks.hashing import HASH_FORMAT_VERSION, chain_hashes, namespace_root
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.index.chain import Header, longest_chain, read_headers
from cas_bank.index.ends import split_record
from cas_bank.maintenance.bundle.checks import block_as, end_as
from cas_bank.maintenance.bundle.format import (
    _LEAD,
    _TRAILER,
    BUNDLE_CONTEXT,
    BUNDLE_VERSION,
    MAGIC,
    ExportReport,
)
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.bank import Bank


# -- choosing a chain ----------------------------------------------------------------
def chain_to_leaf(bank: Bank, leaf: bytes) -> list[Header]:
    """The stored chain from block 0 down to `leaf`, walking parent links up."""
    out: list[Header] = []
    key = leaf
    while True:
        header = read_headers(bank.store, [key])[0]
        if header is None:
            where = "the block" if key == leaf else f"its ancestor {key.hex()[:16]}"
            raise InvalidInputError(
                f"cannot export {leaf.hex()[:16]}: {where} is not stored or unreadable; "
                "run `cas-bank verify`"
            )
        # Indices must fall by one per step: this also ends the walk on a corrupt loop.
        if out and header.index != out[-1].index - 1:
            raise CorruptDataError(
                f"chain of {leaf.hex()[:16]} has a broken link at block {out[-1].index}; "
                "run `cas-bank verify`"
            )
        out.append(header)
        if header.index == 0:
            break
        key = header.parent
    if out[-1].parent != out[-1].root:
        raise CorruptDataError(f"chain of {leaf.hex()[:16]} does not start at its namespace root")
    out.reverse()
    return out


def chain_for_tokens(bank: Bank, root: bytes, tokens: Any) -> list[Header]:
    """Headers of the longest stored chain that prefixes `tokens` in namespace `root`."""
    return longest_chain(bank.store, root, chain_hashes(root, tokens, bank.config.block_size))


# -- export --------------------------------------------------------------------------
def export_chain(bank: Bank, chain: list[Header], path: str | Path) -> ExportReport:
    """Write `chain` (from block 0, in order) with its states and namespace to `path`.

    Every payload and state is checked against its header's digest first: a bank's
    damage is not copied into a bundle. The file appears whole or not at all.
    """
    if not chain:
        raise InvalidInputError("nothing to export: the chain has no stored blocks")
    root = chain[0].root
    spec = _exportable_spec(bank, root)
    records, states = _block_records(bank, chain)
    ends = _chain_ends(bank.store, root, chain)
    manifest = _manifest(bank, root, spec, chain, records, ends)
    path = Path(path)
    pieces = [p for record in records for p in record] + [v for _, v in ends]
    size = _write_bundle(path, manifest, pieces)
    return ExportReport(
        path=path,
        namespace=spec.name,
        blocks=len(chain),
        states=states,
        tokens=len(chain) * bank.config.block_size,
        file_bytes=size + _TRAILER,
        leaf=chain[-1].chain_hash,
        ends=len(ends),
    )


def _exportable_spec(bank: Bank, root: bytes) -> ModelSpec:
    """The recorded spec of namespace `root`, refused when the record is missing or
    damaged or the namespace is salted."""
    raw_spec = bank.store.get(Family.NAMESPACES, root)
    if raw_spec is None:
        raise CorruptDataError(f"namespace {root.hex()[:16]} of the chain is not recorded")
    try:
        spec = ModelSpec.model_validate(json.loads(raw_spec))
    except ValueError as e:  # a damaged record (pydantic's ValidationError is one too)
        raise CorruptDataError(
            f"namespace {root.hex()[:16]}: its record does not parse ({type(e).__name__}); "
            "run `cas-bank verify`"
        ) from None
    if namespace_root(spec.fingerprint, bank.config.block_size) != root:
        # A tenant's salt is part of the root and recorded nowhere (it would let anyone
        # holding the bundle time that tenant's prompts): an import could not check it.
        raise InvalidInputError(
            f"namespace {root.hex()[:16]} is salted (a tenant's cache_salt): a bundle "
            "carries a namespace by its model and block size only, so it cannot carry "
            "this one"
        )
    return spec


def _block_records(bank: Bank, chain: list[Header]) -> tuple[list[tuple[bytes, bytes, bytes]], int]:
    """(header, payload, state) bytes of each block as they cross, and how many carry
    a state. A payload failing its digest is refused; a state failing it is left out."""
    records: list[tuple[bytes, bytes, bytes]] = []
    states = 0
    for h in chain:
        payload = bank.store.get(Family.BLOCKS, h.chain_hash)
        if payload is None or not codec.verify(payload, h.payload_digest):
            raise CorruptDataError(
                f"block {h.chain_hash.hex()[:16]} (index {h.index}) fails its digest; "
                "run `cas-bank verify`"
            )
        state = b""
        if h.state_digest is not None:
            st = bank.store.get(Family.STATES, h.chain_hash)
            if st is not None and codec.verify(st, h.state_digest):
                state = st
                states += 1
        # What crosses is checked by blake3 (bundle.checks): an XXH3-128 record is
        # re-digested, the header names the new digests.
        h, payload, st = block_as(
            h if state else h.with_state(None), payload, state or None, "blake3"
        )
        records.append((h.encode(), payload, st or b""))
    return records, states


def _manifest(
    bank: Bank,
    root: bytes,
    spec: ModelSpec,
    chain: list[Header],
    records: list[tuple[bytes, bytes, bytes]],
    ends: list[tuple[bytes, bytes]],
) -> dict[str, Any]:
    """The bundle's manifest: its format, the namespace, and each record's lengths."""
    manifest: dict[str, Any] = {
        "format": BUNDLE_VERSION if ends else 1,
        "hash_format": HASH_FORMAT_VERSION,
        "block_size": bank.config.block_size,
        "root": root.hex(),
        "spec": spec.model_dump(mode="json"),
        "blocks": [
            {
                "hash": h.chain_hash.hex(),
                "header": len(r[0]),
                "payload": len(r[1]),
                "state": len(r[2]),
            }
            for h, r in zip(chain, records, strict=True)
        ],
    }
    if ends:
        manifest["ends"] = [{"key": k.hex(), "length": len(v)} for k, v in ends]
    return manifest


def _write_bundle(path: Path, manifest: dict[str, Any], pieces: list[bytes]) -> int:
    """Write the lead, `manifest`, `pieces` and the digest trailer to `path` through a
    temporary file, synced and renamed; the bytes before the trailer. A full disk
    leaves no half bundle and is a BankFullError."""
    body = json.dumps(manifest, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + ".partial")
    hasher = blake3.blake3(derive_key_context=BUNDLE_CONTEXT)
    size = 0
    try:
        with open(tmp, "wb") as f:
            for piece in [_LEAD.pack(MAGIC, manifest["format"], len(body)), body, *pieces]:
                f.write(piece)
                hasher.update(piece)
                size += len(piece)
            f.write(hasher.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # no half bundle left behind (a full disk)
        if isinstance(e, OSError) and is_no_space(e):
            raise full_error(path.parent, size + _TRAILER, e) from None
        raise
    return size


def _chain_ends(store: BlockStore, root: bytes, chain: list[Header]) -> list[tuple[bytes, bytes]]:
    """The intact end records under the chain's blocks and its root (one walk of the
    ends family)."""
    parents = {root} | {h.chain_hash for h in chain}
    out = []
    for key, value in store.iterate(Family.ENDS):
        if key[:32] not in parents:
            continue
        try:
            end, payload = split_record(key, value)
        except CorruptDataError:
            continue
        if end.root == root and codec.verify(payload, end.payload_digest):
            out.append((key, end_as(key, value, "blake3")))
    return out
