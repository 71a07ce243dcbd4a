"""The end lease (`Leases.put_end`, `Leases.end`) against what could give a restore
wrong bits or hold memory it does not charge: a record rewritten under its key with the
same flags, evicted and stored again, namespaces of the same tokens (quantized too), a
secondary bank following its writer, a caller writing in place into what it was handed,
two restoring threads beside a thread rewriting the record, and what a lease keeps."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    bits,
    end_leases,
    hybrid_spec,
    layers_bits,
    prefix_layers,
    quantized_spec,
    random_logits,
    random_state,
    state_bits,
    tokens_of,
)

from cas_bank import Bank, BankConfig
from cas_bank.blocks.store import Family
from cas_bank.evict.eviction import evict_to_budget
from cas_bank.index.ends import decode_end, split_record
from cas_bank.spec import ModelSpec

B = BLOCK_SIZE
HYBRID = hybrid_spec()


def _store(bank: Bank, spec: ModelSpec, tokens: list[int], seed: int, **extra: Any) -> Any:
    """Store `tokens`' blocks and end record (state of `seed`); the state stored."""
    layers = prefix_layers(spec, tokens)
    state = random_state(spec, seed) if spec.is_hybrid else None
    ns = bank.namespace(spec)
    ns.store(tokens, layers)
    assert ns.store_end(tokens, layers, state, **extra) > 0
    return state


def _numpy_view(a: mx.array) -> np.ndarray:
    """A numpy view of an MLX array's buffer (bf16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.asarray(a)


def _damage(bank: Bank) -> None:
    """Flip the last payload byte of the bank's one end record (its header intact)."""
    ((key, value),) = list(bank.store.iterate(Family.ENDS))
    bad = bytearray(value)
    bad[-1] ^= 0xFF
    bank.store.put_batch([(Family.ENDS, key, bytes(bad))])


def test_a_damaged_record_rewritten_with_the_same_flags_is_decoded_again(bank: Bank) -> None:
    """A store skips a record that holds what it asks for unless that record is damaged:
    then the same key gets a record of the same flags and other arrays (another payload
    digest), and no restore gets the leased arrays of the old one."""
    tokens = tokens_of(np.random.default_rng(1), 2 * B + 3)
    _store(bank, HYBRID, tokens, 1, logits=random_logits(1))
    ns = bank.namespace(HYBRID)
    hit = ns.restore(tokens)
    assert hit is not None and bits(hit.logits) == bits(random_logits(1))  # type: ignore[arg-type]
    _damage(bank)
    state = _store(bank, HYBRID, tokens, 2, logits=random_logits(2))
    for _ in range(2):
        hit = ns.restore(tokens)
        assert hit is not None and bits(hit.logits) == bits(random_logits(2))  # type: ignore[arg-type]
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)


def test_a_record_evicted_and_stored_again_is_restored_as_stored_again(bank: Bank) -> None:
    tokens = tokens_of(np.random.default_rng(2), 2 * B + 3)
    _store(bank, HYBRID, tokens, 1, logits=random_logits(1))
    ns = bank.namespace(HYBRID)
    assert ns.restore(tokens) is not None and end_leases(bank)
    evict_to_budget(bank, 0)
    assert ns.restore(tokens) is None
    state = _store(bank, HYBRID, tokens, 2, logits=random_logits(2))
    for _ in range(2):
        hit = ns.restore(tokens)
        assert hit is not None and bits(hit.logits) == bits(random_logits(2))  # type: ignore[arg-type]
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)


def test_namespaces_of_the_same_tokens_each_restore_their_own(bank: Bank) -> None:
    """Another model's namespace (another root: other end keys), and a quantized one."""
    tokens = tokens_of(np.random.default_rng(3), 2 * B + 3)
    other = hybrid_spec().model_copy(update={"weights_digest": "w-other"})
    quant = quantized_spec()
    want = {
        spec.weights_digest: (_store(bank, spec, tokens, seed, logits=random_logits(seed)), seed)
        for spec, seed in ((HYBRID, 1), (other, 2))
    }
    _store(bank, quant, tokens, 3, logits=random_logits(3))
    first = bank.namespace(quant).restore(tokens)
    assert first is not None
    for _ in range(2):
        for spec in (HYBRID, other):
            state, seed = want[spec.weights_digest]
            hit = bank.namespace(spec).restore(tokens)
            assert hit is not None and bits(hit.logits) == bits(random_logits(seed))  # type: ignore[arg-type]
            assert state_bits(hit.layers, spec) == state_bits(state, spec)
        hit = bank.namespace(quant).restore(tokens)
        assert hit is not None and bits(hit.logits) == bits(random_logits(3))  # type: ignore[arg-type]
        assert layers_bits(hit.layers, quant) == layers_bits(first.layers, quant)
    assert len(end_leases(bank)) == 3


def test_a_secondary_bank_restores_what_its_writer_rewrote(tmp_path: Path) -> None:
    path = tmp_path / "b"
    tokens = tokens_of(np.random.default_rng(4), 2 * B + 3)
    with Bank.open(path, BankConfig(block_size=B)) as primary:
        _store(primary, HYBRID, tokens, 1, logits=random_logits(1))
        primary.flush()
        with Bank.open(path, BankConfig(block_size=B), mode="secondary") as second:
            for _ in range(2):
                hit = second.namespace(HYBRID).restore(tokens)
                assert hit is not None and bits(hit.logits) == bits(random_logits(1))  # type: ignore[arg-type]
            assert end_leases(second)
            # Holds more (a hidden state): written under the same key, another digest.
            _store(primary, HYBRID, tokens, 2, logits=random_logits(2), hidden=random_logits(5))
            primary.flush()
            second.refresh()
            hit = second.namespace(HYBRID).restore(tokens)
            assert hit is not None and bits(hit.logits) == bits(random_logits(2))  # type: ignore[arg-type]
            assert hit.hidden is not None and bits(hit.hidden) == bits(random_logits(5))


def test_in_place_writes_into_what_restores_handed_out_never_reach_the_lease(bank: Bank) -> None:
    """Every restore's logits, hidden state and recurrent state written in place (item
    assignment, augmented assignment): the lease's bits do not change, nor the next
    restore's."""
    tokens = tokens_of(np.random.default_rng(5), 2 * B + 3)
    hidden = mx.array(np.arange(16, dtype=np.float32))
    state = _store(bank, HYBRID, tokens, 1, logits=random_logits(1), hidden=hidden)
    ns = bank.namespace(HYBRID)
    leased: list[bytes] = []
    for i in range(3):
        hit = ns.restore(tokens)
        assert hit is not None and hit.logits is not None and hit.hidden is not None
        assert bits(hit.logits) == bits(random_logits(1)) and bits(hit.hidden) == bits(hidden)
        assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
        if i == 0:
            leased = [bits(a) for e in end_leases(bank) for a in e.arrays]
        logits, hid = hit.logits, hit.hidden
        logits[3] = 99.0
        logits += 1
        hid[...] = 0
        written = [logits, hid]
        for layer, ls in zip(hit.layers, HYBRID.layers, strict=True):
            if ls.kind == "recurrent":
                for a in layer:
                    a[...] = 0
                    a *= 0
                    written.append(a)
        mx.eval(written)
        assert [bits(a) for e in end_leases(bank) for a in e.arrays] == leased


@pytest.mark.parametrize("n", [2 * B + 3, B - 1])
def test_the_leased_tail_is_a_read_only_copy_the_restores_copy_from(bank: Bank, n: int) -> None:
    """The tail a lease keeps owns its bytes (not a view of the record's) and cannot be
    written; the KV a restore hands out shares no memory with it, with or without room,
    after whole blocks or alone (a prompt shorter than a block: the tail is all the KV),
    and what a runtime writes into that KV in place reaches no later restore."""
    tokens = tokens_of(np.random.default_rng(6), n)
    _store(bank, HYBRID, tokens, 1, logits=random_logits(1))
    ns = bank.namespace(HYBRID)
    first = ns.restore(tokens)
    assert first is not None
    ((entry,),) = [end_leases(bank)]
    tail = entry.end[1].tail
    assert tail and all(t.base is None and not t.flags.writeable for t in tail)
    for room in (0, len(tokens) + 8):
        hit = ns.restore(tokens, room_for=room)
        assert hit is not None
        kv = [
            a
            for layer, ls in zip(hit.layers, HYBRID.layers, strict=True)
            if ls.per_block
            for a in layer
        ]
        assert not any(np.shares_memory(_numpy_view(a), t) for a in kv for t in tail)
        for a in kv:
            a[..., :1, :] = 0  # as mlx-lm's update writes rows in place
        mx.eval(kv)
    again = ns.restore(tokens)
    assert again is not None and layers_bits(again.layers, HYBRID) == layers_bits(
        first.layers, HYBRID
    )


def test_a_lease_keeps_no_bytes_of_the_record_it_was_decoded_from(bank: Bank) -> None:
    """Only the decoded arrays (the tail copied) stay: the record's value is let go, and
    the entry is charged exactly what it holds."""
    tokens = tokens_of(np.random.default_rng(7), 2 * B + 3)
    _store(bank, HYBRID, tokens, 1, logits=random_logits(1), hidden=random_logits(2))
    ((key, stored),) = list(bank.store.iterate(Family.ENDS))
    value = bytes(bytearray(stored))  # an object of this test's own
    header, payload = split_record(key, value)
    decoded = decode_end(HYBRID, header, payload)
    before = sys.getrefcount(value)
    assert bank.leases is not None
    bank.leases.put_end(key, header.payload_digest, decoded)
    del payload, decoded
    gc.collect()
    assert sys.getrefcount(value) < before  # the payload's view, and nothing else, let go
    (entry,) = end_leases(bank)
    kept = entry.end[1]
    held = [*kept.state, kept.logits, kept.hidden]
    assert entry.nbytes == sum(a.nbytes for a in held) + sum(t.nbytes for t in kept.tail)
    assert bank.stats().leased_bytes >= entry.nbytes


def test_restores_beside_a_thread_rewriting_the_record_get_one_records_bits(bank: Bank) -> None:
    """Two threads restore one end while a third puts either of two records of it
    (different arrays, the same key) in turn: each restore's logits and state are one
    record's, never a mix and never the other's leased arrays under its digest."""
    tokens = tokens_of(np.random.default_rng(8), 2 * B + 3)
    records: list[bytes] = []
    want: dict[bytes, list[list[bytes]]] = {}
    for seed in (1, 2):
        if records:
            _damage(bank)  # so that the second store writes (the same flags)
        state = _store(bank, HYBRID, tokens, seed, logits=random_logits(seed))
        ((key, value),) = list(bank.store.iterate(Family.ENDS))
        records.append(value)
        want[bits(random_logits(seed))] = state_bits(state, HYBRID)
    assert bank.leases is not None
    for k in [k for k in bank.leases._entries if k[:1] == b"l" and len(k) == 65]:
        bank.leases._drop(k)  # the stores' live leases: not what is tested
    ns = bank.namespace(HYBRID)
    errors: list[str] = []
    served: set[bytes] = set()
    done = threading.Event()

    def restorer() -> None:
        for _ in range(80):
            hit = ns.restore(tokens)
            if hit is None or hit.logits is None:
                errors.append("miss")
                continue
            got = bits(hit.logits)
            if want.get(got) != state_bits(hit.layers, HYBRID):
                errors.append("a mix or unknown")
            served.add(got)

    def writer() -> None:
        i = 0
        while not done.is_set():
            bank.store.put_batch([(Family.ENDS, key, records[i % 2])])
            i += 1

    restorers = [threading.Thread(target=restorer) for _ in range(2)]
    rewriting = threading.Thread(target=writer)
    rewriting.start()
    for t in restorers:
        t.start()
    for t in restorers:
        t.join()
    done.set()
    rewriting.join()
    assert not errors, errors[:5]
    assert len(served) == 2


def test_only_the_record_a_restore_resumes_from_is_asked_of_the_leases(
    bank: Bank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup reads end records for their headers: `Namespace.match` makes no arrays
    of an end lease (new MLX objects and an evaluation: ~9-13 us a record of a
    medium-hybrid layout's 19 arrays here) nor counts it as used (least recently used
    goes first), and a restore asks for the one record it resumes from, not for each
    shallower record it found beside it."""
    tokens = tokens_of(np.random.default_rng(9), 2 * B + 3)
    for n in (2 * B + 1, 2 * B + 3):
        _store(bank, HYBRID, tokens[:n], n, logits=random_logits(n))
    ns = bank.namespace(HYBRID)
    for n in (2 * B + 1, 2 * B + 3):
        assert ns.restore(tokens[:n]) is not None
    assert bank.leases is not None and len(end_leases(bank)) == 2
    ticks = [e.tick for e in end_leases(bank)]
    asked: list[bytes] = []
    real = bank.leases.end

    def asking(end_key: bytes, digest: bytes) -> Any:
        asked.append(bytes(end_key))
        return real(end_key, digest)

    monkeypatch.setattr(bank.leases, "end", asking)
    assert ns.match(tokens) == len(tokens)
    assert asked == [] and [e.tick for e in end_leases(bank)] == ticks
    hit = ns.restore(tokens)
    assert hit is not None and hit.exact and bits(hit.logits) == bits(random_logits(2 * B + 3))  # type: ignore[arg-type]
    records = list(bank.store.iterate(Family.ENDS))
    (deepest,) = [k for k, v in records if split_record(k, v)[0].n_tokens == len(tokens)]
    assert asked == [deepest]


def test_a_record_damaged_under_its_lease_is_served_the_leased_arrays_until_they_go(
    bank: Bank,
) -> None:
    """The lease is named by the payload digest the header claims, and the payload
    under it is not read again: a record damaged after its lease was made (its header
    intact) restores the arrays it was written with, and no corrupt read is counted;
    once the lease is gone, the same record is read, fails its digest and is a miss."""
    tokens = tokens_of(np.random.default_rng(10), 2 * B + 3)
    state = _store(bank, HYBRID, tokens, 1, logits=random_logits(1))
    ns = bank.namespace(HYBRID)
    assert ns.restore(tokens) is not None and end_leases(bank)
    _damage(bank)
    corrupt = bank.stats().corrupt_reads
    hit = ns.restore(tokens)
    assert hit is not None and bits(hit.logits) == bits(random_logits(1))  # type: ignore[arg-type]
    assert state_bits(hit.layers, HYBRID) == state_bits(state, HYBRID)
    assert bank.stats().corrupt_reads == corrupt
    assert bank.leases is not None
    bank.leases.clear()
    hit = ns.restore(tokens)
    assert hit is None or hit.logits is None
    assert bank.stats().corrupt_reads == corrupt + 1
