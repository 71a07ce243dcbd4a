"""`cas_bank.maintenance.verify` and `cas-bank verify`: corruption and broken chains are found, the
exit status says so, `--fix` removes exactly what is broken or unreachable (keeping
the counters right), and a second verify is clean. Damage is made by writing to the
RocksDB families directly, behind the bank's back."""

from __future__ import annotations

from pathlib import Path

from conftest import BLOCK_SIZE, kv_prefix_bits, layers_bits, state_bits
from tool_banks import BuiltBank, build_bank, cas_bank, cas_bank_json

from cas_bank import Bank
from cas_bank.blocks.rocks import RocksStore
from cas_bank.blocks.store import Family
from cas_bank.index.tree import HeaderIndex
from cas_bank.maintenance.verify import verify


def _flip(store: RocksStore, family: Family, key: bytes, at: int = -5) -> None:
    raw = bytearray(store.get(family, key) or b"")
    raw[at] ^= 0xFF
    store.put_batch([(family, key, bytes(raw))])


def _damage(built: BuiltBank) -> None:
    """A corrupt payload (fleet's shared tool block), a dangling chain (text1 loses
    block 2's header) and a corrupt state (hybrid block 1)."""
    store = RocksStore(built.path)
    _flip(store, Family.BLOCKS, built.chains["agent0"][3])
    store.put_batch([(Family.HEADERS, built.chains["text1"][2], None)])
    _flip(store, Family.STATES, built.chains["hybrid"][1], at=-3)
    store.close()


def test_a_clean_bank_verifies(tmp_path: Path) -> None:
    built = build_bank(tmp_path / "bank")
    proc = cas_bank("verify", built.path, check=True)
    assert "29 blocks, 2 states" in proc.stdout and "problems  0" in proc.stdout
    data = cas_bank_json("verify", built.path)
    assert data["ok"] and data["problems"] == [] and data["blocks_checked"] == 29
    assert data["states_checked"] == 2 and data["counter_drift"] == {}


def test_verify_finds_corruption_and_a_dangling_chain_and_fix_removes_them(
    tmp_path: Path, check: str
) -> None:
    built = build_bank(tmp_path / "bank", check)
    _damage(built)
    agents, text1, hybrid = built.chains["agent0"], built.chains["text1"], built.chains["hybrid"]

    proc = cas_bank("verify", built.path, "--json")
    assert proc.returncode == 1
    import json

    found = {(p["kind"], p["hash"]) for p in json.loads(proc.stdout)["problems"]}
    assert ("payload_corrupt", agents[3].hex()) in found
    assert ("dangling", text1[3].hex()) in found
    assert ("state_corrupt", hybrid[1].hex()) in found
    assert ("orphan_payload", text1[2].hex()) in found  # its header was deleted
    assert ("orphan_access", text1[2].hex()) in found  # and its last use with it
    below = set(agents[4:]) | set(built.chains["agent1"][4:]) | set(text1[4:])
    assert {h for k, h in found if k == "unreachable"} == {h.hex() for h in below}

    human = cas_bank("verify", built.path)
    assert human.returncode == 1
    assert "payload_corrupt" in human.stdout and "dangling" in human.stdout
    assert "--fix" in human.stdout

    fixed = cas_bank("verify", built.path, "--fix", "--json")
    assert fixed.returncode == 1  # problems were found (and removed)
    report = json.loads(fixed.stdout)
    assert report["fixed"]
    assert set(report["removed_blocks"]) == {h.hex() for h in below | {agents[3], text1[3]}}
    assert report["removed_states"] == [hybrid[1].hex()]
    assert report["removed_orphans"] == 2  # text1[2]'s payload and last use
    assert report["counter_drift"] == {}  # counters agree with what is left

    again = cas_bank_json("verify", built.path)
    assert again["ok"] and again["blocks_checked"] == 29 - 1 - len(below) - 2
    assert again["states_checked"] == 1

    stats = cas_bank_json("stats", built.path)
    assert stats["blocks"] == again["blocks_checked"] and stats["states"] == 1

    # What survived still restores bit for bit; the broken chains end where they broke.
    with Bank.open(built.path) as bank:
        from conftest import attention_spec, hybrid_spec

        fleet = bank.namespace(attention_spec(name="fleet"))
        for name in ("agent2", "agent3"):
            hit = fleet.restore(built.prompts[name])
            assert hit is not None and hit.tokens == len(built.chains[name]) * BLOCK_SIZE
            assert layers_bits(hit.layers, fleet.spec) == kv_prefix_bits(
                built.layers[name], fleet.spec, hit.tokens
            )
        assert fleet.match(built.prompts["agent0"]) == 3 * BLOCK_SIZE
        hyb = bank.namespace(hybrid_spec())
        hit = hyb.restore(built.prompts["hybrid"])
        assert hit is not None and hit.tokens == 4 * BLOCK_SIZE  # the intact state at 16
        assert state_bits(hit.layers, hyb.spec) == state_bits(
            built.states["hybrid"][4 * BLOCK_SIZE], hyb.spec
        )


def test_missing_payloads_and_unreadable_headers_are_problems(tmp_path: Path) -> None:
    built = build_bank(tmp_path / "bank")
    text0, hybrid = built.chains["text0"], built.chains["hybrid"]
    store = RocksStore(built.path)
    store.put_batch(
        [
            (Family.BLOCKS, text0[5], None),
            (Family.HEADERS, hybrid[3], b"\x07garbage"),
            (Family.STATES, hybrid[2], b"a state nobody announced"),
        ]
    )
    store.close()
    with Bank.open(built.path, mode="read_only") as bank:
        report = verify(bank)
    kinds = {(p.kind, p.chain_hash) for p in report.problems}
    assert ("payload_missing", text0[5]) in kinds
    assert ("unreachable", text0[6]) in kinds
    assert ("bad_header", hybrid[3]) in kinds
    assert ("unreachable", hybrid[4]) in kinds
    assert ("orphan_state", hybrid[2]) in kinds
    assert not report.ok and not report.fixed

    with Bank.open(built.path) as bank:
        before = bank.counters.values()
        report = verify(bank, fix=True)
        after = bank.counters.values()
        index = HeaderIndex.load(bank.store)
        assert verify(bank).ok
    assert set(report.removed_blocks) == {text0[5], text0[6], hybrid[3], hybrid[4]}
    assert after["blocks"] == before["blocks"] - 4 == len(index.headers)
    # hybrid[3] held a state (announced by the header that was overwritten).
    assert after["states"] == before["states"] - 1
    assert after["payload_bytes"] == sum(h.payload_size for h in index.headers.values())
    assert after["state_bytes"] == sum(h.state_size for h in index.headers.values())


def test_damage_inside_rocksdb_blob_files_is_reported_not_raised(tmp_path: Path) -> None:
    """Payloads of 4 KiB and more live in BlobDB files; bytes flipped there are found
    by the digest check and removed by --fix, whatever RocksDB makes of them."""
    from conftest import attention_spec
    from tool_banks import chain_layers

    from cas_bank import BankConfig, ModelSpec

    wide = attention_spec()
    spec = ModelSpec(name="wide", layers=wide.layers * 8, weights_digest="w-wide")
    path = tmp_path / "bank"
    tokens = list(range(4 * BLOCK_SIZE))
    with Bank.open(path, BankConfig(block_size=BLOCK_SIZE, file_min_bytes=None)) as bank:
        ns = bank.namespace(spec)
        ns.store(tokens, chain_layers(ns, tokens))
    blobs = list(path.glob("*.blob"))
    assert blobs, "payloads this size are expected in BlobDB files"
    for blob in blobs:
        data = bytearray(blob.read_bytes())
        for off in range(len(data) // 2, len(data), 97):
            data[off] ^= 0xFF
        blob.write_bytes(bytes(data))

    proc = cas_bank("verify", path, "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    import json

    problems = json.loads(proc.stdout)["problems"]
    kinds = {"payload_corrupt", "payload_missing", "unreachable"}  # as RocksDB reads it
    assert problems and {p["kind"] for p in problems} <= kinds
    with Bank.open(path) as bank:
        report = verify(bank, fix=True)
        assert len(report.removed_blocks) == len(problems)
        assert verify(bank).ok


def test_last_uses_of_what_is_not_stored_are_flagged_and_fixed(tmp_path: Path) -> None:
    """A last-use record of a block, a state or end records the bank does not hold
    (what a store of blocks admission left out used to leave) is a problem; --fix
    deletes it and leaves the stored records' uses alone."""
    built = build_bank(tmp_path / "bank")
    stored = built.chains["text1"][0]
    ghost = bytes(32 * [7])
    store = RocksStore(built.path)
    use = store.get(Family.ACCESS, stored)
    assert use is not None
    store.put_batch([(Family.ACCESS, k, use) for k in (ghost, ghost + b"s", ghost + b"e")])
    store.put_batch([(Family.ACCESS, stored + b"s", use)])  # text1's block 0 has no state
    store.close()
    with Bank.open(built.path) as bank:
        report = verify(bank)
        found = {(p.kind, p.chain_hash) for p in report.problems}
        want = {ghost, ghost + b"s", ghost + b"e", stored + b"s"}
        assert found == {("orphan_access", k) for k in want}
        fixed = verify(bank, fix=True)
        assert fixed.fixed and fixed.removed_orphans == 4
        assert verify(bank).ok
        assert bank.store.get(Family.ACCESS, stored) is not None
        assert all(bank.store.get(Family.ACCESS, k) is None for k in want)
