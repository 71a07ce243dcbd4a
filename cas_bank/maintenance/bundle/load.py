"""Reading a bundle file, checking every record of it, and importing it into a bank
in one batch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
from pydantic import ValidationError

from cas_bank.blocks import codec
from cas_bank.blocks.hashing import HASH_FORMAT_VERSION, hash_block, namespace_root
from cas_bank.blocks.store import BlockStore, Family
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.index.chain import Header, read_headers
from cas_bank.index.ends import split_record
from cas_bank.index.records import block_rewrite, state_write_delta
from cas_bank.maintenance.bundle.checks import bundle_as
from cas_bank.maintenance.bundle.format import (
    _LEAD,
    _TRAILER,
    BUNDLE_CONTEXT,
    BUNDLE_VERSION,
    MAGIC,
    Bundle,
    BundleEntry,
    ImportReport,
)
from cas_bank.spec import ModelSpec

if TYPE_CHECKING:
    from cas_bank.bank import Bank
    from cas_bank.write.txn import Transaction


def _damaged(why: str) -> CorruptDataError:
    return CorruptDataError(f"damaged bundle: {why}")


def read_bundle(path: str | Path) -> Bundle:
    """Parse and check a bundle completely; `CorruptDataError` ("damaged bundle: ...")
    on any inconsistency. Reads the whole file into memory."""
    data = Path(path).read_bytes()
    if len(data) < _LEAD.size + _TRAILER or data[:8] != MAGIC:
        raise _damaged("not a cas_bank bundle (bad magic or truncated)")
    body, trailer = memoryview(data)[:-_TRAILER], data[-_TRAILER:]
    if blake3.blake3(body, derive_key_context=BUNDLE_CONTEXT).digest() != trailer:
        raise _damaged("file digest mismatch (truncated or altered)")
    _magic, version, manifest_len = _LEAD.unpack_from(data)
    if version not in (1, BUNDLE_VERSION):
        raise _damaged(f"bundle format {version}; this build reads {BUNDLE_VERSION}")
    pos = _LEAD.size + manifest_len
    try:
        manifest = json.loads(bytes(body[_LEAD.size : pos]))
        block_size = int(manifest["block_size"])
        root = bytes.fromhex(manifest["root"])
        spec = ModelSpec.model_validate(manifest["spec"])
        records = [
            (bytes.fromhex(b["hash"]), int(b["header"]), int(b["payload"]), int(b["state"]))
            for b in manifest["blocks"]
        ]
        hash_format = int(manifest["hash_format"])
        end_records = [
            (bytes.fromhex(e["key"]), int(e["length"])) for e in manifest.get("ends", [])
        ]
    except (ValueError, KeyError, TypeError, ValidationError) as e:
        raise _damaged(f"manifest does not parse ({type(e).__name__})") from None
    if hash_format != HASH_FORMAT_VERSION:
        raise _damaged(f"hash format {hash_format}; this build uses {HASH_FORMAT_VERSION}")
    if namespace_root(spec.fingerprint, block_size) != root:
        raise _damaged("namespace root does not match its model spec and block size")
    entries: list[BundleEntry] = []
    parent = root
    for i, (key, n_header, n_payload, n_state) in enumerate(records):
        if min(n_header, n_payload, n_state) < 0 or pos + n_header + n_payload + n_state > len(
            body
        ):
            raise _damaged(f"block {i} runs past the end of the file")
        raw_header = bytes(body[pos : pos + n_header])
        payload = bytes(body[pos + n_header : pos + n_header + n_payload])
        state = bytes(body[pos + n_header + n_payload : pos + n_header + n_payload + n_state])
        pos += n_header + n_payload + n_state
        h = _check_entry(i, key, raw_header, payload, state, parent, root, block_size)
        entries.append(BundleEntry(h, payload, state or None))
        parent = key
    ends: list[tuple[bytes, bytes]] = []
    by_hash: dict[bytes, Header] = {e.header.chain_hash: e.header for e in entries}
    for key, length in end_records:
        if length < 0 or pos + length > len(body):
            raise _damaged(f"end record {key.hex()[64:80]} runs past the end of the file")
        value = bytes(body[pos : pos + length])
        pos += length
        _check_end(key, value, root, block_size, by_hash)
        ends.append((key, value))
    if pos != len(body):
        raise _damaged(f"{len(body) - pos} unexplained bytes after the last record")
    if not entries:
        raise _damaged("it holds no blocks")
    return Bundle(block_size, root, spec, entries, ends)


def _check_end(
    key: bytes, value: bytes, root: bytes, block_size: int, blocks: dict[bytes, Header]
) -> None:
    """An end record of the bundle: its name, its parent in the bundle, its digest."""
    try:
        end, payload = split_record(key, value)
    except CorruptDataError as e:
        raise _damaged(str(e)) from None
    where = f"end record {key.hex()[64:80]}"
    base = end.n_tokens - end.tail_len
    parent = blocks.get(end.parent)
    if end.root != root or end.tail_len >= block_size:
        raise _damaged(f"{where}: not of this namespace")
    if not (base == 0 and end.parent == root) and (parent is None or parent.end != base):
        raise _damaged(f"{where}: its parent is not a block of the bundle ending at {base}")
    if not codec.verify(payload, end.payload_digest):
        raise _damaged(f"{where}: payload fails its digest")


def _check_entry(
    i: int,
    key: bytes,
    raw_header: bytes,
    payload: bytes,
    state: bytes,
    parent: bytes,
    root: bytes,
    block_size: int,
) -> Header:
    where = f"block {i} ({key.hex()[:16]})"
    try:
        h = Header.decode(key, raw_header)
    except CorruptDataError as e:
        raise _damaged(f"{where}: {e}") from None
    if h.root != root or h.index != i or h.parent != parent:
        raise _damaged(f"{where}: header does not continue the chain")
    if len(h.tokens) != 4 * block_size:
        raise _damaged(f"{where}: holds {len(h.tokens) // 4} tokens, not {block_size}")
    if hash_block(parent, h.tokens) != key:
        raise _damaged(f"{where}: chain hash does not recompute from its parent and tokens")
    if len(payload) != h.payload_size or not codec.verify(payload, h.payload_digest):
        raise _damaged(f"{where}: payload fails its digest")
    if h.state_digest is None:
        if state:
            raise _damaged(f"{where}: carries a state its header does not announce")
    elif len(state) != h.state_size or not codec.verify(state, h.state_digest):
        raise _damaged(f"{where}: state fails its digest")
    return h


# -- import --------------------------------------------------------------------------
@dataclass(slots=True)
class _Imported:
    """What an import wrote, gathered as its transaction is built."""

    blocks_in: list[bytes] = field(default_factory=list)  # payloads written (new or repaired)
    states_in: list[bytes] = field(default_factory=list)
    bytes_written: int = 0
    added: int = 0  # blocks the bank did not hold (a repaired one was counted before)
    ends_in: int = 0


def import_bundle(bank: Bank, bundle: Bundle | str | Path) -> ImportReport:
    """Check the bundle (a path, or one `read_bundle` checked) completely, then add
    what `bank` lacks in one batch.

    Blocks already stored intact are kept as they are; a stored block without a state
    gets the bundle's state; a stored payload or state that is missing or fails its
    digest is replaced by the bundle's (an import repairs what it covers). Counters
    count what it added (`logical_tokens` too): importing it again changes none. Raises
    `CorruptDataError` for a damaged bundle and `InvalidInputError` for one made with
    another block size; nothing is written then.
    """
    bundle = _bundle_for(bank, bundle)
    hashes = [e.header.chain_hash for e in bundle.entries]
    done = _Imported()
    with bank.transaction() as tx:
        _import_blocks(bank, tx, bundle, done)
        _import_ends(tx, bundle, done)
        # An import is a copy, not a request: it counts the tokens it added, never the
        # blocks it found (a repeated import changes no counter but last uses).
        tx.add(
            ends_written=done.ends_in,
            logical_tokens=done.added * bundle.block_size,
            blocks_written=len(done.blocks_in),
            states_written=len(done.states_in),
        )
        # Imported blocks count as used now, as a store's do: eviction keeps them longest.
        tx.touch(hashes, [e.header.chain_hash for e in bundle.entries if e.state])
        tx.clear_suspect(blocks=done.blocks_in, states=done.states_in)
    written = len(done.blocks_in)
    return ImportReport(
        namespace=bundle.spec.name,
        blocks=len(hashes),
        blocks_written=written,
        blocks_existing=len(hashes) - written,
        states_written=len(done.states_in),
        bytes_written=done.bytes_written,
        leaf=hashes[-1],
        ends_written=done.ends_in,
    )


def _bundle_for(bank: Bank, bundle: Bundle | str | Path) -> Bundle:
    """The bundle read and checked, refused for a read-only bank or another block
    size, its records digested as `bank` writes them."""
    if bank.read_only:
        raise RuntimeError(f"import needs the bank at {bank.path} opened read-write")
    if not isinstance(bundle, Bundle):
        bundle = read_bundle(bundle)
    if bundle.block_size != bank.config.block_size:
        raise InvalidInputError(
            f"bundle has block_size={bundle.block_size}, the bank at {bank.path} "
            f"block_size={bank.config.block_size}"
        )
    return bundle_as(bundle, bank.payload_check)  # checked by blake3; kept as the bank writes


def _import_blocks(bank: Bank, tx: Transaction, bundle: Bundle, done: _Imported) -> None:
    """Record the namespace if new, and each block's payload and state the bank lacks
    or holds damaged."""
    damaged: set[int] = set()
    current = read_headers(tx.store, [e.header.chain_hash for e in bundle.entries], damaged)
    if tx.store.get(Family.NAMESPACES, bundle.root) is None:
        tx.put(Family.NAMESPACES, bundle.root, bundle.spec.model_dump_json().encode())
    bad_blocks, bad_states = _damaged_records(tx.store, bundle.entries, current)
    for i, (entry, old) in enumerate(zip(bundle.entries, current, strict=True)):
        key = entry.header.chain_hash
        # Absent, damaged, failing its digest now or on an earlier read: rewritten.
        rewrite = old is None or key in bad_blocks or bank.suspects.block(key)
        kept_state = (
            old is not None
            and old.has_state
            and key not in bad_states
            and not bank.suspects.state(key)
        )
        write_state = entry.state is not None and not kept_state
        _import_block(tx, entry, old, i in damaged, rewrite, write_state, done)


def _import_block(
    tx: Transaction,
    entry: BundleEntry,
    old: Header | None,
    damaged: bool,
    rewrite: bool,
    write_state: bool,
    done: _Imported,
) -> None:
    """Write one block's payload (`rewrite`) and state (`write_state`), and the header
    that names what it then holds."""
    h, key = entry.header, entry.header.chain_hash
    base = old
    if rewrite:  # the bundle's payload, under the state the block has (if any)
        deltas, extra = block_rewrite(tx.store, key, old, damaged, len(entry.payload))
        done.added += deltas.get("blocks", 0)
        tx.add(**deltas)
        tx.extend(extra)
        tx.put(Family.BLOCKS, key, entry.payload)
        done.blocks_in.append(key)
        done.bytes_written += len(entry.payload)
        base = h.with_state(old.state_digest, old.state_size) if old else h.with_state(None)
    if write_state and entry.state is not None:
        assert base is not None
        tx.put(Family.STATES, key, entry.state)
        tx.add(**state_write_delta(base, len(entry.state)))
        base = base.with_state(h.state_digest, h.state_size)
        done.states_in.append(key)
        done.bytes_written += len(entry.state)
    if rewrite or write_state:
        assert base is not None
        tx.put(Family.HEADERS, key, base.encode())


def _import_ends(tx: Transaction, bundle: Bundle, done: _Imported) -> None:
    """Write each end record of the bundle the bank does not hold as it is."""
    olds = tx.store.get_many(Family.ENDS, [k for k, _ in bundle.ends])
    for (end_key, value), held in zip(bundle.ends, olds, strict=True):
        if held == value:
            continue
        tx.put(Family.ENDS, end_key, value)
        tx.add(ends=0 if held is not None else 1, end_bytes=len(value) - len(held or b""))
        done.ends_in += 1
        done.bytes_written += len(value)


def _damaged_records(
    store: BlockStore, entries: list[BundleEntry], current: list[Header | None]
) -> tuple[set[bytes], set[bytes]]:
    """Chain hashes whose stored payload (or state) the bundle would keep but which is
    missing or fails its header's digest: the import rewrites them from the bundle."""
    bad_blocks: set[bytes] = set()
    bad_states: set[bytes] = set()
    for family, bad in ((Family.BLOCKS, bad_blocks), (Family.STATES, bad_states)):
        state = family is Family.STATES
        held = [
            (e.header.chain_hash, h)
            for e, h in zip(entries, current, strict=True)
            if h is not None and (h.has_state and e.state is not None if state else True)
        ]
        for (key, h), raw in zip(held, _read_all(store, family, [k for k, _ in held]), strict=True):
            digest = h.state_digest if state else h.payload_digest
            size = h.state_size if state else h.payload_size
            if raw is None or len(raw) != size or digest is None or not codec.verify(raw, digest):
                bad.add(key)
    return bad_blocks, bad_states


def _read_all(store: BlockStore, family: Family, keys: list[bytes]) -> list[bytes | None]:
    """Values of `keys`, None for one the store cannot read (its own checksum failed)."""
    try:
        return store.get_many(family, keys)
    except CorruptDataError:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(store.get(family, key))
            except CorruptDataError:
                out.append(None)
        return out
