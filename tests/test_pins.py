"""Pins (`Namespace.pin`, `cas-bank pin|unpin|pins`): a pinned prefix's blocks, states
and end records survive eviction under pressure and a reopen; unpinning makes them
evictable; a pin past `pin_share` of `max_bytes` is refused, naming the numbers.
The invariants under random pins, stores and evictions: tests/test_evict_machine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cas_bank.tools import cli
from conftest import (
    BLOCK_SIZE,
    attention_spec,
    hybrid_spec,
    kv_prefix_bits,
    layers_bits,
    random_layers,
    random_state,
)
from test_evict import counted, headers, open_bank, recount, store_at
from test_payload_check import PROMPT_DB, PROMPT_FILES, _format, _old_bank, _restores_bit_exact
from test_payload_check import SPEC as SPEC_V3

from cas_bank import Bank, BankConfig, InvalidInputError
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget, pins
from cas_bank.evict.pins import PREFIX, Pin

B = BLOCK_SIZE
SYSTEM = list(range(1, 3 * B + 1))  # three blocks


def block_bytes(bank: Bank, chain: list[bytes]) -> int:
    hs = headers(bank.store)
    return sum(hs[h].payload_size + hs[h].state_size for h in chain)


def test_a_pinned_prefix_survives_eviction_under_pressure_and_a_reopen(bank_path: Path) -> None:
    spec = attention_spec()
    probe, _ = open_bank(bank_path.with_name("probe"))
    with probe:
        size = probe.namespace(spec).store(list(range(B)), random_layers(spec, B)).bytes_written
    config = {"max_bytes": 8 * size}
    bank, clock = open_bank(bank_path, **config)
    layers = random_layers(spec, len(SYSTEM), seed=7)
    with bank:
        ns = bank.namespace(spec)
        clock.now = 1
        chain = ns.store(SYSTEM, layers).chain
        report = ns.pin(SYSTEM)
        assert (report.tokens, report.blocks, report.new) == (3 * B, 3, True)
        assert report.bytes == report.pinned_bytes == 3 * size
        assert report.limit == 4 * size  # pin_share 0.5 of max_bytes
        assert ns.pin(SYSTEM).new is False  # idempotent
        # Newer one-off prompts fill the budget many times over: the pin is older than all.
        for k in range(10):
            store_at(clock, 2 + k, ns, [1000 + k] * 4 * B, k)
        assert set(chain) <= set(headers(bank.store))
        assert bank.stats().payload_bytes <= 8 * size and bank.stats().blocks_evicted >= 30
        assert recount(bank) == counted(bank)
    bank, clock = open_bank(bank_path, **config)
    with bank:
        ns = bank.namespace(spec)
        assert [p.tokens for p in pins(bank.store)] == [tuple(SYSTEM)]
        clock.now = 100
        for k in range(10):
            store_at(clock, 100 + k, ns, [2000 + k] * 4 * B, k)
        assert evict_to_budget(bank, 0).pinned_bytes == 3 * size
        assert set(headers(bank.store)) == set(chain)  # only the pin is left
        hit = ns.restore(SYSTEM)
        assert hit is not None and hit.tokens == 3 * B
        assert layers_bits(hit.layers, spec) == kv_prefix_bits(layers, spec, 3 * B)

        assert ns.unpin(SYSTEM) is True and ns.unpin(SYSTEM) is False
        assert pins(bank.store) == []
        report = evict_to_budget(bank, 0)
        assert report.blocks_evicted == 3 and report.pinned_bytes == 0
        assert headers(bank.store) == {}
    with Bank.open(bank_path) as again:  # the unpin was written too
        assert pins(again.store) == []


def test_a_pin_holds_its_ancestors_states_and_end_records_not_its_descendants(
    bank_path: Path,
) -> None:
    spec = hybrid_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        prompt = [*SYSTEM, 7, 8]  # three blocks and a tail: its end record
        clock.now = 1
        layers = random_layers(spec, len(prompt), seed=1)
        chain = ns.store(prompt, layers, {B: random_state(spec, 1), 3 * B: random_state(spec, 2)})
        ns.store_end(prompt, layers, random_state(spec, 3))
        longer = SYSTEM + list(range(500, 500 + 2 * B))
        clock.now = 2  # a longer prompt on the pinned prefix, and another end record beside
        ns.store(longer, random_layers(spec, len(longer), seed=2), {5 * B: random_state(spec, 4)})
        assert ns.pin(prompt).tokens == len(prompt)  # the end record is held: every token
        report = evict_to_budget(bank, 0)
        kept = headers(bank.store)
        assert set(kept) == set(chain.chain)  # the descendants went, the pin stayed
        assert kept[chain.chain[0]].has_state and kept[chain.chain[2]].has_state
        assert report.bytes_after == report.pinned_bytes > 0
        assert len(list(bank.store.iterate(Family.ENDS))) == 1
        hit = ns.restore(prompt)
        assert hit is not None and hit.tokens == len(prompt) and hit.end is not None
        assert recount(bank) == counted(bank)
        ns.unpin(prompt)
        evict_to_budget(bank, 0)
        assert headers(bank.store) == {} and list(bank.store.iterate(Family.ENDS)) == []


def test_a_pin_past_the_share_is_refused_with_the_numbers(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path, max_bytes=1 << 20, pin_share=0.25)
    with bank:
        ns = bank.namespace(spec)
        size = store_at(clock, 1, ns, SYSTEM, 1).bytes_written // 3
        other = [9] * 2 * B
        store_at(clock, 2, ns, other, 2)
    limit = 4 * size  # room for four of the five blocks
    bank, clock = open_bank(bank_path, max_bytes=limit * 4, pin_share=0.25)
    with bank:
        ns = bank.namespace(spec)
        ns.pin(SYSTEM)
        with pytest.raises(InvalidInputError) as refused:
            ns.pin(other)
        message = str(refused.value)
        assert (
            f"pins would hold {5 * size} bytes ({3 * size} pinned now + {2 * size} for this "
            f"prefix of {2 * B} tokens"
        ) in message
        assert f"over pin_share 0.25 x max_bytes {limit * 4} = {limit} bytes" in message
        assert [p.tokens for p in pins(bank.store)] == [tuple(SYSTEM)]  # nothing written
        assert bank.access.index is not None and bank.access.index.pinned_bytes == 3 * size
        # A prefix sharing the pinned blocks adds only what it does not share.
        assert ns.pin(SYSTEM[: 2 * B]).pinned_bytes == 3 * size


def test_only_a_stored_prefix_of_a_full_block_or_more_can_be_pinned(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        store_at(clock, 1, ns, SYSTEM[: 2 * B], 1)
        with pytest.raises(InvalidInputError, match=f"only {2 * B} of the prefix's {3 * B}"):
            ns.pin(SYSTEM)
        with pytest.raises(InvalidInputError, match="no full block"):
            ns.pin(SYSTEM[: B - 1])
        assert pins(bank.store) == []
        assert ns.pin(SYSTEM[: 2 * B + 1]).tokens == 2 * B  # no end record: the blocks
    with (
        Bank.open(bank_path, mode="read_only") as reader,
        pytest.raises(RuntimeError, match="read-only"),
    ):
        reader.namespace(spec).pin(SYSTEM[:B])


def test_pins_are_records_an_unreadable_one_is_skipped(bank_path: Path) -> None:
    spec = attention_spec()
    bank, clock = open_bank(bank_path)
    with bank:
        ns = bank.namespace(spec)
        store_at(clock, 1, ns, SYSTEM, 1)
        ns.pin(SYSTEM)
        [pin] = pins(bank.store)
        assert Pin.decode(pin.encode()) == pin
        bank.store.put_batch([(Family.META, PREFIX + b"x" * 48, b"\x09future")])
        assert pins(bank.store) == [pin]  # a newer version's record: skipped, kept
        assert bank.store.get(Family.META, PREFIX + b"x" * 48) is not None


def test_a_bank_an_older_cas_bank_wrote_opens_and_takes_pins(tmp_path: Path) -> None:
    """The version-3 fixture of tests/test_payload_check.py: no pin records; it opens,
    takes a pin, keeps it through an eviction and a reopen, and stays version 3."""
    path = _old_bank(tmp_path)
    with Bank.open(path, BankConfig(max_bytes=1 << 20)) as bank:
        ns = bank.namespace(SPEC_V3)
        chain = ns.chain(PROMPT_FILES)
        assert ns.pin(PROMPT_FILES).tokens == len(PROMPT_FILES)  # its end record too
        evict_to_budget(bank, 0)
        assert set(headers(bank.store)) == set(chain)
    assert _format(path) == 3
    with Bank.open(path, mode="read_only") as bank:
        assert len(pins(bank.store)) == 1
        assert _restores_bit_exact(bank, PROMPT_FILES) == len(PROMPT_FILES)
        assert bank.namespace(SPEC_V3).restore(PROMPT_DB) is None


# -- the command line ---------------------------------------------------------------------
def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_pin_unpin_and_pins_commands(bank_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = attention_spec()
    with Bank.open(bank_path, BankConfig(block_size=B)) as bank:
        chain = bank.namespace(spec).store(SYSTEM, random_layers(spec, len(SYSTEM))).chain
        size = block_bytes(bank, chain)
    tokens = bank_path.with_name("system.json")
    tokens.write_text(json.dumps(SYSTEM))
    bank = str(bank_path)

    status, out, err = run(capsys, "pin", bank, "--tokens", str(tokens), "--max-bytes", "100")
    assert status == 1 and "pin refused" in err and "max_bytes 100 = 50 bytes" in err
    status, out, _ = run(capsys, "pin", bank, "--tokens", str(tokens), "--json")
    assert status == 0
    assert json.loads(out) == {
        "pinned": True,
        "tokens": 3 * B,
        "blocks": 3,
        "bytes": size,
        "pinned_bytes": size,
        "limit": None,
    }
    status, out, _ = run(capsys, "pins", bank, "--json")
    [row] = json.loads(out)["pins"]
    assert (row["namespace"], row["tokens"], row["blocks_stored"], row["bytes"]) == (
        spec.name,
        3 * B,
        3,
        size,
    )
    status, out, _ = run(capsys, "pins", bank)
    assert status == 0 and spec.name in out and "3/3" in out
    status, out, _ = run(capsys, "gc", bank, "--max-bytes", "0", "--json")
    assert json.loads(out)["blocks_evicted"] == 0  # gc keeps the pin
    status, out, _ = run(capsys, "unpin", bank, "--tokens", str(tokens))
    assert (status, out.strip()) == (0, "unpinned")
    status, out, _ = run(capsys, "unpin", bank, "--tokens", str(tokens))
    assert status == 1 and "not pinned" in out
    status, out, _ = run(capsys, "pins", bank)
    assert out.strip() == "no pins"
    missing = str(bank_path.with_name("nothing"))
    status, _, err = run(capsys, "pin", missing, "--tokens", str(tokens))
    assert status == 1 and err.strip().count("\n") == 0 and "no bank" in err
    status, _, err = run(capsys, "pins", missing)
    assert status == 1 and err.strip().count("\n") == 0
