"""Bundles: `cas-bank export` -> `cas-bank import` into an empty bank restores the same
arrays (KV and states); a damaged bundle (a flipped byte anywhere, a truncation, a
chain that does not hash) is refused with one line and imports nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
from conftest import BLOCK_SIZE, hybrid_spec, kv_prefix_bits, layers_bits, state_bits
from tool_banks import (
    BuiltBank,
    assert_one_line_error,
    attn_text_spec,
    build_bank,
    cas_bank,
    cas_bank_json,
    fleet_spec,
)

from cas_bank import Bank, BankConfig
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError, InvalidInputError
from cas_bank.evict.access import last_use
from cas_bank.maintenance.bundle import BUNDLE_CONTEXT, import_bundle, read_bundle


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltBank:
    return build_bank(tmp_path_factory.mktemp("bundle") / "bank")


@pytest.fixture(scope="module")
def hybrid_bundle(built: BuiltBank, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "hybrid.casb"
    leaf = built.chains["hybrid"][-1].hex()[:10]
    info = cas_bank_json("export", built.path, "--leaf", leaf, "-o", out)
    assert info["blocks"] == 5 and info["states"] == 2 and info["namespace"] == "tiny-hybrid"
    return out


def _headers(path: Path) -> list[bytes]:
    if not (path / "CURRENT").exists():
        return []
    with Bank.open(path, mode="read_only") as bank:
        return list(bank.store.keys(Family.HEADERS))


def test_export_import_restore_gives_identical_hybrid_arrays(
    built: BuiltBank, hybrid_bundle: Path, tmp_path: Path
) -> None:
    target = tmp_path / "empty"
    info = cas_bank_json("import", target, hybrid_bundle, "--create")
    assert info["blocks_written"] == 5 and info["states_written"] == 2
    assert info["ends_written"] == len(read_bundle(hybrid_bundle).ends)
    spec = hybrid_spec()
    with Bank.open(target) as bank:
        assert bank.config.block_size == BLOCK_SIZE
        # Imported blocks and states count as used at import (eviction keeps them).
        chain = built.chains["hybrid"]
        assert all(t is not None for t in last_use(bank.store, bank.access, chain))
        assert [t is not None for t in last_use(bank.store, bank.access, chain, states=True)] == [
            False,
            True,
            False,
            True,
            False,
        ]
        ns = bank.namespace(spec)
        hit = ns.restore(built.prompts["hybrid"])
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE  # deepest stored state
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(
            built.layers["hybrid"], spec, hit.tokens
        )
        assert state_bits(hit.layers, spec) == state_bits(
            built.states["hybrid"][4 * BLOCK_SIZE], spec
        )
        # Restoring only to the first state's boundary gets that state back too.
        short = ns.restore(built.prompts["hybrid"][: 3 * BLOCK_SIZE])
        assert short is not None and short.tokens == 2 * BLOCK_SIZE
        assert state_bits(short.layers, spec) == state_bits(
            built.states["hybrid"][2 * BLOCK_SIZE], spec
        )
    assert cas_bank_json("verify", target)["ok"]
    again = cas_bank_json("import", target, hybrid_bundle)  # idempotent
    assert again["blocks_written"] == 0 and again["blocks_existing"] == 5


def test_export_by_tokens_takes_the_longest_stored_prefix(built: BuiltBank, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    prompt = built.prompts["agent1"] + [5, 5, 5, 5, 5]  # a tail beyond what is stored
    tokens.write_text(" ".join(str(t) for t in prompt))
    out = tmp_path / "agent1.casb"
    proc = cas_bank("export", built.path, "--tokens", tokens, "--namespace", "fleet", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "5 blocks (20 tokens)" in proc.stdout

    target = tmp_path / "target"
    with Bank.open(target, BankConfig(block_size=BLOCK_SIZE)):
        pass  # an existing, empty bank
    cas_bank("import", target, out, check=True)
    with Bank.open(target) as bank:
        ns = bank.namespace(fleet_spec())
        hit = ns.restore(prompt)
        assert hit is not None and hit.tokens == len(built.chains["agent1"]) * BLOCK_SIZE
        assert layers_bits(hit.layers, ns.spec) == kv_prefix_bits(
            built.layers["agent1"], ns.spec, hit.tokens
        )
        # Agent 0 shares the first four blocks (system prompt + tool block) with agent 1.
        assert ns.match(built.prompts["agent0"]) == 4 * BLOCK_SIZE


def test_export_by_a_json_token_list_keeps_the_tokenizer(built: BuiltBank, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(built.prompts["text0"]))
    out = tmp_path / "text0.casb"
    cas_bank(
        "export", built.path, "--tokens", tokens, "--namespace", "tiny-attn", "-o", out, check=True
    )
    bundle = read_bundle(out)
    assert bundle.spec == attn_text_spec() and bundle.spec.tokenizer == "bytes"
    assert [e.header.chain_hash for e in bundle.entries] == built.chains["text0"]


def _damaged_copies(bundle: Path, tmp_path: Path) -> dict[str, Path]:
    data = bundle.read_bytes()
    out: dict[str, Path] = {}
    for name, at in (("magic", 0), ("manifest", 20), ("payload", len(data) // 2), ("digest", -1)):
        b = bytearray(data)
        b[at] ^= 0x40
        out[name] = tmp_path / f"flip-{name}.casb"
        out[name].write_bytes(bytes(b))
    for name, size in (("truncated", len(data) - 100), ("cut-digest", len(data) - 1), ("empty", 0)):
        out[name] = tmp_path / f"{name}.casb"
        out[name].write_bytes(data[:size])
    return out


def test_a_damaged_bundle_fails_with_one_line_and_imports_nothing(
    hybrid_bundle: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    damaged = _damaged_copies(hybrid_bundle, tmp_path)
    with Bank.open(target, BankConfig(block_size=BLOCK_SIZE)) as bank:
        for name, path in damaged.items():
            with pytest.raises(CorruptDataError, match="damaged bundle"):
                import_bundle(bank, path)
            assert list(bank.store.keys(Family.HEADERS)) == [], name
            assert list(bank.store.keys(Family.NAMESPACES)) == [], name
    for name in ("payload", "truncated"):  # and through the CLI: one line, nothing written
        assert_one_line_error(cas_bank("import", target, damaged[name]), "damaged bundle")
        assert _headers(target) == []
    # With --create, a damaged bundle does not even create the bank.
    fresh = tmp_path / "fresh"
    assert_one_line_error(cas_bank("import", fresh, damaged["digest"], "--create"), "damaged")
    assert not fresh.exists()


def _redigest(data: bytes) -> bytes:
    body = data[:-32]
    return body + blake3.blake3(body, derive_key_context=BUNDLE_CONTEXT).digest()


def test_a_bundle_whose_chain_does_not_hash_is_refused_despite_a_good_file_digest(
    hybrid_bundle: Path, tmp_path: Path
) -> None:
    data = hybrid_bundle.read_bytes()
    (manifest_len,) = struct.unpack_from("<I", data, 12)
    manifest = json.loads(data[16 : 16 + manifest_len])
    first = manifest["blocks"][0]
    # The last token of block 1's header: its chain hash no longer recomputes.
    at = 16 + manifest_len + first["header"] + first["payload"] + first["state"]
    at += manifest["blocks"][1]["header"] - 1
    forged = bytearray(data)
    forged[at] ^= 0x01
    path = tmp_path / "forged.casb"
    path.write_bytes(_redigest(bytes(forged)))
    with pytest.raises(CorruptDataError, match="chain hash does not recompute"):
        read_bundle(path)
    with Bank.open(tmp_path / "target", BankConfig(block_size=BLOCK_SIZE)) as bank:
        with pytest.raises(CorruptDataError):
            import_bundle(bank, path)
        assert list(bank.store.keys(Family.HEADERS)) == []


def test_a_bundle_for_another_block_size_is_refused(hybrid_bundle: Path, tmp_path: Path) -> None:
    target = tmp_path / "bs8"
    with (
        Bank.open(target, BankConfig(block_size=8)) as bank,
        pytest.raises(InvalidInputError, match="block_size=4"),
    ):
        import_bundle(bank, hybrid_bundle)
    assert_one_line_error(cas_bank("import", target, hybrid_bundle), "block_size=4")
    assert _headers(target) == []


def test_export_refuses_a_corrupt_chain_and_bad_token_files(tmp_path: Path) -> None:
    built = build_bank(tmp_path / "bank")
    chain = built.chains["text1"]
    store = RocksStore(built.path)
    raw = bytearray(store.get(Family.BLOCKS, chain[1]) or b"")
    raw[-1] ^= 1
    store.put_batch([(Family.BLOCKS, chain[1], bytes(raw))])
    store.close()
    out = tmp_path / "x.casb"
    proc = cas_bank("export", built.path, "--leaf", chain[-1].hex(), "-o", out)
    assert_one_line_error(proc, "fails its digest", "verify")
    assert not out.exists()

    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 three")
    assert_one_line_error(
        cas_bank("export", built.path, "--tokens", bad, "--namespace", "fleet", "-o", out),
        "neither a JSON list nor integers",
    )
    toks = tmp_path / "toks.txt"
    toks.write_text("1 2 3 4 5 6 7 8")
    assert_one_line_error(
        cas_bank("export", built.path, "--tokens", toks, "-o", out), "give --namespace"
    )
    assert_one_line_error(
        cas_bank("export", built.path, "--tokens", toks, "--namespace", "fleet", "-o", out),
        "no stored block matches",
    )


def test_a_salted_namespace_is_refused_by_name_and_no_file_is_written(tmp_path: Path) -> None:
    """The salt is in the root and recorded nowhere: an import could not check the
    bundle's namespace, so export says why it cannot carry one."""
    from conftest import attention_spec, prefix_layers, tokens_of

    from cas_bank.maintenance.bundle import chain_for_tokens, export_chain

    spec = attention_spec()
    tokens = tokens_of(np.random.default_rng(3), 3 * BLOCK_SIZE)
    with Bank.open(tmp_path / "bank", BankConfig(block_size=BLOCK_SIZE)) as bank:
        ns = bank.namespace(spec, salt="tenant")
        ns.store(tokens, prefix_layers(spec, tokens))
        chain = chain_for_tokens(bank, ns.root, tokens)
        assert len(chain) == 3
        with pytest.raises(InvalidInputError, match="salted"):
            export_chain(bank, chain, tmp_path / "out.casb")
    assert not (tmp_path / "out.casb").exists()
