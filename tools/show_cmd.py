"""`cas-bank show BANK HASH`: everything about one block.

Its header (namespace, depth, parent, children, chains through it), its payload
decoded into the namespace's layers (shapes and dtypes) with the digest checked, its
token ids and, where the namespace records a tokenizer this tool can build, their
text; and whether a recurrent state is stored at its end boundary.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from cas_bank import Bank
from cas_bank.blocks import codec
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.evict.access import last_use
from cas_bank.index.chain import Header
from cas_bank.index.tree import (
    HeaderIndex,
    UnknownHashError,
    load_namespaces,
    namespace_labels,
    resolve_prefix,
)
from cas_bank.maintenance.verify import read_record
from cas_bank.spec import ModelSpec

from .common import (
    CliError,
    add_bank_argument,
    add_command,
    emit,
    fields,
    human_bytes,
    print_json,
    read_bank,
    short,
    table,
    when,
)
from .show_end import end_info, show_end


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "show",
        cmd_show,
        "one block: header, layers, tokens, digests",
        "One block: header, parent, children, layers with shapes and dtypes, digest "
        "status, token ids (and text where the namespace records a known tokenizer), and "
        "whether a state is stored at its boundary. Exit status 1 if its payload or state "
        "fails its digest.",
    )
    add_bank_argument(p)
    p.add_argument(
        "hash",
        metavar="HASH",
        help="block hash or end-record hash (`ls --ends` lists them), or a unique hex prefix",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="decode the tokens with the tokenizer.json in DIR (default: the model "
        "directory the namespace records, when it is still there)",
    )


def decode_text(
    spec: ModelSpec | None, ids: list[int], tokenizer: Path | None = None
) -> str | None:
    """The text of `ids` through the namespace's tokenizer, where the tools can build it:
    the embedded models' `ByteTokenizer` (recorded as "bytes" or "byte:<vocab size>"),
    or a Hugging Face `tokenizer.json` in the model directory the namespace records
    (or in `tokenizer`, a directory given by the user). None otherwise."""
    name = spec.tokenizer if spec is not None else None
    if tokenizer is not None or (name is not None and Path(name).is_dir()):
        return _hf_decode(tokenizer or Path(str(name)), ids)
    if name is None or not (name == "bytes" or re.fullmatch(r"byte:\d+", name)):
        return None
    # Imported here: `show` is the only command that needs the runtime package.
    from cas_bank.runtime.tokenizer import (
        MIN_VOCAB_SIZE,
        ByteTokenizer,
    )

    recorded = int(name.split(":")[1]) if ":" in name else MIN_VOCAB_SIZE
    # Ids past the vocabulary (a damaged block) still show, as reserved names.
    vocab = max([MIN_VOCAB_SIZE, recorded, *(i + 1 for i in ids)])
    return str(ByteTokenizer(vocab_size=vocab).decode(ids))


def _hf_decode(directory: Path, ids: list[int]) -> str | None:
    """`ids` through the model's own tokenizer.json (the `tokenizers` library, which
    mlx-lm's transformers brings; no transformers import, nothing downloaded)."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise CliError(f"no tokenizer.json in {directory}")
    from tokenizers import Tokenizer  # type: ignore[import-untyped,unused-ignore]

    tok = Tokenizer.from_file(str(file))
    if any(i >= tok.get_vocab_size() for i in ids):
        return None  # not this model's tokenizer, or a damaged block
    return str(tok.decode(ids, skip_special_tokens=False))


def _payload(
    raw: bytes | None, expected: bytes, size: int, error: str | None
) -> tuple[str, codec.Decoded | None]:
    """Digest status of a stored payload and, if it is intact, its decoded arrays."""
    if error is not None:
        return f"corrupt ({error})", None
    if raw is None:
        return "missing", None
    if len(raw) != size:
        return f"corrupt ({len(raw)} bytes, header says {size})", None
    try:
        return "ok", codec.decode(raw, expected)
    except CorruptDataError as e:
        return f"corrupt ({e})", None


def _layers(
    spec: ModelSpec | None, block: codec.Decoded | None, state: codec.Decoded | None
) -> list[dict[str, Any]]:
    """One row per stored array: which layer it belongs to, its shape and dtype."""
    rows: list[dict[str, Any]] = []
    for source, decoded, kind in (("block", block, "attention"), ("state", state, "recurrent")):
        if decoded is None:
            continue
        layer_of: list[int | None] = []
        if spec is not None:
            layer_of = [i for i, ls in enumerate(spec.layers) if ls.kind == kind for _ in ls.arrays]
        if len(layer_of) != len(decoded.arrays):  # the spec does not describe it: list raw
            layer_of = [None] * len(decoded.arrays)
        within: dict[int | None, int] = {}
        for j, (a, d) in enumerate(zip(decoded.arrays, decoded.dtypes, strict=True)):
            layer = layer_of[j]
            # Arrays are numbered within their layer (keys 0, values 1; quantized 0-5).
            within[layer] = within.get(layer, -1) + 1
            rows.append(
                {
                    "source": source,
                    "layer": layer,
                    "kind": kind,
                    "array": within[layer] if layer is not None else j,
                    "shape": list(a.shape),
                    "dtype": d.name,
                    "bytes": int(a.size) * d.itemsize,
                }
            )
    return rows


@dataclass(frozen=True, slots=True)
class _Look:
    """What `show` reads of one block, in one view of the bank."""

    header: Header
    index: HeaderIndex
    specs: dict[bytes, ModelSpec]
    raw: bytes | None
    raw_error: str | None
    raw_state: bytes | None
    state_error: str | None
    last: float | None


def _look(bank: Bank, index: HeaderIndex, key: bytes) -> _Look:
    if key in index.unreadable:
        raise CliError(f"block {key.hex()}: {index.unreadable[key]}")
    h = index.headers[key]
    raw, raw_error = read_record(bank, Family.BLOCKS, key)
    raw_state, state_error = read_record(bank, Family.STATES, key) if h.has_state else (None, None)
    return _Look(
        h,
        index,
        load_namespaces(bank.store)[0],
        raw,
        raw_error,
        raw_state,
        state_error,
        last_use(bank.store, bank.access, [key])[0],
    )


def _look_any(bank: Bank, prefix: str) -> _Look | dict[str, Any]:
    """A block's look, or an end record's info, for the one block hash or end hash
    `prefix` starts (ambiguous when it starts several of either kind)."""
    index = HeaderIndex.load(bank.store)
    # End hash -> record key (a damaged ends table: the ones before the damage).
    ends = {k[32:]: k for k, _ in bank.store.readable(Family.ENDS, values=False)}
    key = resolve_prefix(prefix, [*index.keys(), *ends])
    if key not in ends:
        return _look(bank, index, key)
    value = bank.store.get(Family.ENDS, ends[key])
    if value is None:  # removed since the walk
        raise UnknownHashError(f"end record {key.hex()[:16]} is gone")
    return end_info(bank, ends[key], value)


def cmd_show(args: argparse.Namespace) -> int:
    found = read_bank(args.bank, lambda bank: _look_any(bank, args.hash), payloads=True)
    if isinstance(found, dict):
        return show_end(args, found)
    look = found
    h, index, specs, last = look.header, look.index, look.specs, look.last
    raw, raw_error, raw_state, state_error = (
        look.raw,
        look.raw_error,
        look.raw_state,
        look.state_error,
    )
    spec = specs.get(h.root)
    labels = namespace_labels(specs, len(h.tokens) // 4)  # a block's tokens: the block size
    status, block = _payload(raw, h.payload_digest, h.payload_size, raw_error)
    state_status, state = "none", None
    if h.state_digest is not None:
        state_status, state = _payload(raw_state, h.state_digest, h.state_size, state_error)
    ids = h.token_ids()
    info = _info(h, index, labels, spec, last)
    info.update(
        payload={"bytes": h.payload_size, "digest": h.payload_digest.hex(), "status": status},
        compressed=block.compressed if block is not None else None,
        state=None
        if h.state_digest is None
        else {"bytes": h.state_size, "digest": h.state_digest.hex(), "status": state_status},
        layers=_layers(spec, block, state),
        tokens=ids,
        text=decode_text(spec, ids, args.tokenizer),
    )
    if args.json:
        print_json(info)
        return 0 if status == "ok" and state_status in ("ok", "none") else 1
    _print_human(info)
    return 0 if status == "ok" and state_status in ("ok", "none") else 1


def _info(
    h: Header,
    index: HeaderIndex,
    labels: dict[bytes, str],
    spec: ModelSpec | None,
    last: float | None,
) -> dict[str, Any]:
    block_size = len(h.tokens) // 4
    parent_is_root = h.index == 0 and h.parent == h.root
    return {
        "hash": h.chain_hash.hex(),
        "namespace": labels.get(h.root, f"unknown namespace {short(h.root, 8)}"),
        "root": h.root.hex(),
        "model": spec.name if spec else None,
        "tokenizer": spec.tokenizer if spec else None,
        "depth": h.index,
        "token_range": [h.index * block_size, (h.index + 1) * block_size],
        "parent": None if parent_is_root else h.parent.hex(),
        "parent_stored": parent_is_root or h.parent in index.headers,
        "children": [c.hex() for c in index.children.get(h.chain_hash, [])],
        "chains": index.chains_through(h.chain_hash),
        "last_use": last,
    }


def _print_human(info: dict[str, Any]) -> None:
    parent = "namespace root" if info["parent"] is None else info["parent"]
    if not info["parent_stored"]:
        parent += " (NOT STORED: dangling chain)"
    kids = info["children"]
    payload = info["payload"]
    comp = "" if info["compressed"] is None else (", lz4" if info["compressed"] else ", raw")
    state = info["state"]
    lo, hi = info["token_range"]
    rows: list[tuple[str, Any]] = [
        ("block", info["hash"]),
        ("namespace", f"{info['namespace']} (root {info['root'][:16]})"),
        ("depth", f"{info['depth']} (tokens {lo}..{hi})"),
        ("parent", parent),
        ("children", f"{len(kids)}: {', '.join(k[:12] for k in kids)}" if kids else "0"),
        ("chains", info["chains"]),
        ("last use", when(info["last_use"])),
        ("payload", f"{human_bytes(payload['bytes'])}{comp}, digest {payload['status']}"),
        (
            "state",
            "not stored at this boundary"
            if state is None
            else f"stored at token {hi}, {human_bytes(state['bytes'])}, digest {state['status']}",
        ),
        ("tokens", " ".join(str(t) for t in info["tokens"])),
    ]
    if info["text"] is not None:
        rows.append(("text", repr(info["text"])))
    elif info["tokenizer"] is not None:
        rows.append(("text", f"(tokenizer {info['tokenizer']!r} is not one the tools decode)"))
    out: list[Any] = []
    out.append(fields(rows))
    if info["layers"]:
        out.append(
            table(
                ["from", "layer", "kind", "array", "shape", "dtype", "bytes"],
                [
                    (
                        r["source"],
                        "?" if r["layer"] is None else r["layer"],
                        r["kind"],
                        r["array"],
                        "x".join(str(d) for d in r["shape"]),
                        r["dtype"],
                        r["bytes"],
                    )
                    for r in info["layers"]
                ],
            )
        )
    else:
        out.append(Text("(payload not decoded: see its digest status)"))
    emit(*out)
