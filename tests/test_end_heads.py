"""A large end record kept as a file (format 5) is held by the hot tier by its head: its
file named and its first bytes (`FileTier.record_heads`, `HotStore.record_heads`), so
a lookup learns its header, and so the name of its lease, without its payload; the
payload is read from the file only when its arrays are wanted (`index.ends.stored_end`,
`FoundEnd.arrays`). Before, the hot tier held the whole record (4.9 MB for a medium
hybrid's at 1k tokens) while a lease held its arrays decoded: charged twice.

Real RocksDB, files and MLX arrays under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    BLOCK_SIZE,
    FILED_ENDS,
    bits,
    filed_hybrid_spec,
    hot_end_bytes,
    prefix_layers,
    random_logits,
    stored_filed_end,
)

from cas_bank import Bank, BankConfig
from cas_bank.blocks.files import HEAD_BYTES, PayloadFile
from cas_bank.blocks.hot import record_heads
from cas_bank.blocks.store import Family
from cas_bank.errors import CorruptDataError
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index.ends import EndGone, split_record, stored_end

B = BLOCK_SIZE
HYBRID = filed_hybrid_spec()
SMALL_FILES = 1024  # every end record of these tests is a file
HOT = FILED_ENDS


def _end_key(bank: Bank) -> bytes:
    assert bank.files is not None
    (key,) = [k for k, _ in bank.files.inner.iterate(Family.ENDS)]
    return key


def test_the_hot_tier_holds_a_filed_end_record_by_its_head(bank_path: Path) -> None:
    """Its write caches its head (its file and first bytes), not the record; cached
    whole by a read of a key not held, it is answered whole once, then held by its head;
    `get_many` still reads it whole, without caching it so."""
    with Bank.open(bank_path, HOT) as bank:
        stored_filed_end(bank, 2 * B + 3, logits=random_logits(1))
        key, hot = _end_key(bank), bank.hot
        assert hot is not None
        assert 0 < hot_end_bytes(bank) < HEAD_BYTES + 1024  # the write cached its head
        whole = bank.store.get_many(Family.ENDS, [key])[0]
        assert whole is not None and len(whole) > SMALL_FILES
        assert hot_end_bytes(bank) < HEAD_BYTES + 1024  # read below, the head left
        hot.clear()
        assert hot.get_many(Family.ENDS, [key]) == [whole]
        assert hot_end_bytes(bank) > len(whole)  # a key not held: cached whole
        (first,) = hot.record_heads(Family.ENDS, [key])
        assert first == whole  # answered whole this once
        assert hot_end_bytes(bank) < HEAD_BYTES + 1024
        (head,) = hot.record_heads(Family.ENDS, [key])
        assert isinstance(head, PayloadFile) and head.size == len(whole)
        assert head.head == whole[:HEAD_BYTES] and head.read() == whole
        assert hot.get_many(Family.ENDS, [key]) == [whole]  # read below, not kept whole
        assert hot_end_bytes(bank) < HEAD_BYTES + 1024
        assert hot.lookup(Family.ENDS, key, head.digest) is None  # no payload held
        evict_to_budget(bank, 0)  # the record and its file go, and the head with them
        assert (Family.ENDS, key) not in hot and hot.record_heads(Family.ENDS, [key]) == [None]


def test_a_head_found_end_reads_its_file_only_for_its_arrays(bank_path: Path) -> None:
    """`stored_end` of a head: the header a whole read gives; its arrays decoded from
    the file; a file rewritten since (another digest) is gone for the old head
    (`EndGone`, a miss), and a damaged one fails its check (`CorruptDataError`)."""
    with Bank.open(bank_path, HOT) as bank:
        tokens, _, state = stored_filed_end(bank, 2 * B + 3, logits=random_logits(1))
        key = _end_key(bank)
        assert bank.files is not None
        (head,) = record_heads(bank.files, Family.ENDS, [key])  # the file tier's own answer
        assert isinstance(head, PayloadFile)
        found = stored_end(key, head, None)
        assert found is not None and found.raw is None and found.file == head
        whole = head.read()
        assert whole is not None and found.header == split_record(key, whole)[0]
        payload, leased = found.arrays(HYBRID)
        assert not leased and bits(payload.logits) == bits(random_logits(1))  # type: ignore[arg-type]
        flat = [a for layer in state if layer is not None for a in layer]
        assert [bits(a) for a in payload.state or []] == [bits(a) for a in flat]
        ns = bank.namespace(HYBRID)
        held = dict(logits=random_logits(1), hidden=random_logits(2))
        assert ns.store_end(tokens, prefix_layers(HYBRID, tokens), state, **held) > 0
        with pytest.raises(EndGone):  # the old head's file was replaced by the new one's
            found.arrays(HYBRID)
        (new,) = record_heads(bank.files, Family.ENDS, [key])
        assert isinstance(new, PayloadFile) and new.digest != head.digest
        again = stored_end(key, new, None)
        assert again is not None and again.header.has_hidden
        data = bytearray(Path(new.path).read_bytes())
        data[-3] ^= 0x10
        Path(new.path).write_bytes(bytes(data))
        with pytest.raises(CorruptDataError) as failed:
            again.arrays(HYBRID)
        assert not isinstance(failed.value, EndGone)


def test_records_kept_in_the_database_are_answered_whole(bank_path: Path) -> None:
    """Below `file_min_bytes` (here: no files at all) a record is its bytes, as
    `get_many` gives them, and the hot tier caches it so."""
    config = BankConfig(block_size=B, file_min_bytes=None, hot_bytes=64 << 20)
    with Bank.open(bank_path, config) as bank:
        stored_filed_end(bank, 2 * B + 3, logits=random_logits(1))
        assert bank.files is not None and bank.hot is not None
        (key,) = [k for k, _ in bank.files.inner.iterate(Family.ENDS)]
        whole = bank.store.get_many(Family.ENDS, [key])
        assert bank.hot.record_heads(Family.ENDS, [key]) == whole
        assert record_heads(bank.files, Family.ENDS, [key, b"\0" * 64]) == [*whole, None]
        found = stored_end(key, whole[0], None)
        assert found is not None and found.file is None and found.raw is not None
