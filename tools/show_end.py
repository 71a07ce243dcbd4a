"""`cas-bank show` of an end record (docs/design.md, "End records"): named by its end
hash (the last 32 bytes of its key) or a unique hex prefix of it."""

from __future__ import annotations

import argparse
from typing import Any

from cas_bank import Bank
from cas_bank.blocks import codec
from cas_bank.errors import CorruptDataError
from cas_bank.index.ends import split_record
from cas_bank.index.tree import load_namespaces, namespace_labels
from cas_bank.spec import ModelSpec

from .common import emit, fields, human_bytes, print_json, short


def end_info(bank: Bank, key: bytes, value: bytes) -> dict[str, Any]:
    specs: dict[bytes, ModelSpec] = load_namespaces(bank.store)[0]
    try:
        end, payload = split_record(key, value)
    except CorruptDataError as e:
        return {"end": key[32:].hex(), "parent": key[:32].hex(), "status": f"bad record: {e}"}
    spec = specs.get(end.root)
    label = namespace_labels(specs, bank.config.block_size).get(end.root)
    ok = codec.verify(payload, end.payload_digest)
    held = [w for w, f in (("state", end.has_state), ("logits", end.has_logits)) if f]
    if end.has_hidden:
        held.append("hidden")
    return {
        "end": key[32:].hex(),
        "namespace": label if spec else f"unknown namespace {short(end.root, 8)}",
        "root": end.root.hex(),
        "parent": None if end.parent == end.root else end.parent.hex(),
        "tokens": end.n_tokens,
        "tail": end.token_ids(),
        "holds": ["tail KV", *held],
        "payload": {"bytes": end.payload_size, "digest": end.payload_digest.hex()},
        "status": "ok" if ok else "digest mismatch",
    }


def show_end(args: argparse.Namespace, info: dict[str, Any]) -> int:
    ok = info["status"] == "ok"
    if args.json:
        print_json(info)
        return 0 if ok else 1
    rows: list[tuple[str, Any]] = [("end record", info["end"])]
    if "tokens" in info:
        rows += [
            ("namespace", f"{info['namespace']} (root {info['root'][:16]})"),
            ("parent", info["parent"] or "namespace root"),
            ("prompt length", f"{info['tokens']} tokens ({len(info['tail'])} after the parent)"),
            ("tail", " ".join(str(t) for t in info["tail"]) or "-"),
            ("holds", ", ".join(info["holds"])),
            ("payload", f"{human_bytes(info['payload']['bytes'])}, digest {info['status']}"),
        ]
    else:
        rows.append(("status", info["status"]))
    emit(fields(rows))
    return 0 if ok else 1
