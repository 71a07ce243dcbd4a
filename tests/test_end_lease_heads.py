"""A hybrid model's end record kept as a file (format 5) and leased decoded is charged
once: the lease holds its arrays, the hot tier its head (its file named and first
bytes), where before it held the whole record too (4.9 MB more for a medium hybrid's at
1k tokens). The lookup learns the record's header, and so its lease's name, from the
head (`blocks.hot.record_heads`, `index.ends.stored_end`); the file is read only when no
lease holds the arrays. A restore of the same end again is bit-exact and a lease hit; a
record rewritten since is read again; eviction and revoke drop it; a damaged file is
found by verify.

Real RocksDB, files and MLX arrays under tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import (
    BLOCK_SIZE,
    FILED_ENDS,
    bits,
    end_file,
    end_leases,
    filed_hybrid_spec,
    hot_end_bytes,
    layers_bits,
    prefix_layers,
    random_logits,
    random_state,
    state_bits,
    stored_filed_end,
    tokens_of,
)

from cas_bank import Bank
from cas_bank.blocks.files import HEAD_BYTES
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.maintenance.verify import verify

B = BLOCK_SIZE
HYBRID = filed_hybrid_spec()
HOT = FILED_ENDS
HEAD_HELD = HEAD_BYTES + 1024  # a head, its key and bookkeeping


def test_a_leased_end_file_is_charged_once_and_restored_from_its_lease(bank_path: Path) -> None:
    with Bank.open(bank_path, HOT) as bank:
        tokens, _, state = stored_filed_end(bank, 2 * B + 3, logits=random_logits(1))
        record = end_file(bank_path).stat().st_size
        hit = bank.namespace(HYBRID).restore(tokens)  # its head cached by its write
        assert hit is not None and hit.exact
        assert hot_end_bytes(bank) < HEAD_HELD and end_leases(bank)
    with Bank.open(bank_path, HOT) as bank:  # reopened: nothing in memory
        ns = bank.namespace(HYBRID)
        first = ns.restore(tokens)
        assert first is not None and first.exact and first.tokens == len(tokens)
        assert state_bits(first.layers, HYBRID) == state_bits(state, HYBRID)
        (entry,) = end_leases(bank)
        assert entry.nbytes > record // 2 and hot_end_bytes(bank) < HEAD_HELD
        file = end_file(bank_path)
        aside = file.rename(file.with_name("aside"))  # a lease hit reads no file
        try:
            for _ in range(2):
                again = ns.restore(tokens)
                assert again is not None and again.exact and again.tokens == len(tokens)
                assert layers_bits(again.layers, HYBRID) == layers_bits(first.layers, HYBRID)
                assert state_bits(again.layers, HYBRID) == state_bits(state, HYBRID)
                assert bits(again.logits) == bits(random_logits(1))  # type: ignore[arg-type]
        finally:
            aside.rename(file)
        assert hot_end_bytes(bank) < HEAD_HELD and verify(bank).ok


def test_a_rewritten_end_file_is_read_again_and_eviction_drops_it(bank_path: Path) -> None:
    with Bank.open(bank_path, HOT) as bank:
        tokens, _, state = stored_filed_end(bank, 2 * B + 3, logits=random_logits(1))
        ns = bank.namespace(HYBRID)
        assert ns.restore(tokens) is not None and ns.restore(tokens) is not None
        more = dict(logits=random_logits(1), hidden=random_logits(2))
        assert ns.store_end(tokens, prefix_layers(HYBRID, tokens), state, **more) > 0
        for _ in range(2):  # read from its new file, then from its new lease
            hit = ns.restore(tokens)
            assert hit is not None and bits(hit.hidden) == bits(random_logits(2))  # type: ignore[arg-type]
            assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert len(end_leases(bank)) == 1 and hot_end_bytes(bank) < HEAD_HELD
        evict_to_budget(bank, 0)
        assert bank.stats().ends == 0 and not end_leases(bank) and hot_end_bytes(bank) < 1024
        assert ns.restore(tokens) is None


def test_a_damaged_end_file_under_a_lease_is_found_by_verify(bank_path: Path) -> None:
    """The lease holds the arrays checked when the file was read; the file damaged
    since is verify's to find, and `fix` removes the record, and its lease with it."""
    with Bank.open(bank_path, HOT) as bank:
        tokens, _, state = stored_filed_end(bank, 2 * B + 5, logits=random_logits(3))
        ns = bank.namespace(HYBRID)
        assert ns.restore(tokens) is not None and end_leases(bank)
        file = end_file(bank_path)
        data = bytearray(file.read_bytes())
        data[-3] ^= 0x10
        file.write_bytes(bytes(data))
        hit = ns.restore(tokens)  # from the lease: the arrays checked before
        assert hit is not None and state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        assert [p.kind for p in verify(bank).problems] == ["corrupt_end"]
        assert verify(bank, fix=True).fixed and verify(bank).ok
        assert not end_leases(bank) and ns.restore(tokens) is None


def test_a_revoked_tenants_end_file_goes_with_its_head_and_lease(bank_path: Path) -> None:
    with Bank.open(bank_path, HOT) as bank:
        tokens = tokens_of(np.random.default_rng(9), 2 * B + 3)
        layers = prefix_layers(HYBRID, tokens)
        ns = bank.namespace(HYBRID, salt="tenant-a")
        ns.store(tokens, layers)
        assert ns.store_end(tokens, layers, random_state(HYBRID, 9), logits=random_logits(9)) > 0
        assert ns.restore(tokens) is not None and end_leases(bank)
        assert bank.revoke("tenant-a").ends == 1
        assert not end_leases(bank) and hot_end_bytes(bank) < 1024
        assert ns.restore(tokens) is None
