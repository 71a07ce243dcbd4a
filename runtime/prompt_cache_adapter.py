"""`BankPromptCache`: a bank behind the interface of mlx-lm's `LRUPromptCache`.

mlx-lm's server (`mlx_lm.server.ResponseGenerator`) keeps prompt caches in an
`LRUPromptCache`: it calls `fetch_nearest_cache(model_key, tokens)` before a prompt
and `insert_cache(model_key, tokens, cache, cache_type=...)` after it (and, on its
batched path, at the end of each chat segment: the system prompt, the user turns).
A `BankPromptCache` answers the same calls from a cas_bank bank, so mlx-lm's own
server code runs on the bank unchanged, and its caches survive restarts and are
shared block by block between prompts:

    prompt_cache = BankPromptCache(Bank.open("bank"), model)  # where LRUPromptCache(...) was
    ResponseGenerator(model_provider, prompt_cache)

- `fetch_nearest_cache` restores the longest stored prefix of `tokens[:-1]` into a
  fresh mlx-lm cache and returns it with the tokens left to prefill (at least one:
  mlx-lm's `generate_step` refuses an empty prompt); `(None, tokens)` on a miss.
- `insert_cache` stores the full blocks of the tokens the cache holds (its offset;
  the last sampled token may not have been through the model), and the end record
  of exactly those tokens (docs/design.md, "End records"): the KV of the partial last
  block and, for a hybrid model, the recurrent state at that exact position, which
  is what mlx-lm's cache holds at an insert. So a prompt that extends an inserted
  one (the next turn of a chat, the next segment) restores up to its very end, also
  on a hybrid model whose boundary states were never captured. Blocks and end
  records already stored are not written again. `keep_end=False` stores whole blocks
  (and boundary states) only. mlx-lm passes no logits, so these
  end records carry none, and mlx-lm's own contract for an exact match (`rest=[]`)
  is not used: `generate_step` refuses an empty prompt, so a fetch always leaves at
  least one token to prefill.
- Hybrid models: mlx-lm prefills on its own, so the recurrent state inside a prompt
  is never seen, only the one at the end of an inserted cache (stored when that end
  is a block boundary). With `capture_states` (the default), an insert of a hybrid
  cache that does not end on a boundary runs `PrefixCache.prefill` over the new part
  of its tokens again, from the deepest stored state to the last boundary, ending
  its chunks on the boundaries where states are due, and stores those blocks and
  states (one computation, so a restore never mixes two). The cost: the new tokens of
  a prefix are prefilled twice, once by mlx-lm and once here (on mlx-lm's generation
  thread, when mlx-lm inserts: at a chat segment's end, after a request's last
  token); every later prompt sharing the prefix restores it. `capture_states=False`
  stores blocks only, which a hybrid restore cannot use without a state.
- Hybrid models, an exact repeat: a fetch looks up all of a prompt but its last
  token. mlx-lm's sequential path (`_serve_single`: a seeded or salted request)
  inserts the prompt and its answer as one cache, so the states above all sat past
  that token and a repeat restored nothing. An insert whose tokens extend the prompt
  of the last fetch (fetch and insert run one request at a time there) is prefilled
  again first up to that prompt's last token but one, whose end record it stores,
  unless the bank restores that far already: a repeat restores all but the last
  token, as after the batched path, whose inserts stop there. (Attention-only models
  restore it from the blocks: a partial block serves its first tokens.)
- Quantized KV: a cache whose attention layers are `QuantizedKVCache` goes to the
  namespace of its bits and group size (mlx-lm's `--kv-bits` quantizes a cache once
  it passes `--quantized-kv-start`, so one server may insert both kinds); a fetch
  restores from whichever namespace covers more of the prompt.

- A draft model (speculative decoding, `draft_model=`): mlx-lm's cache list is then the
  model's caches followed by the draft model's. The draft model's go to a namespace
  of its own (its own spec: weights digest and layout), beside the model's in the same
  bank, through `PrefixCache`s of its own (per quantized-KV kind too); a fetch restores
  both to the same length, as far as both hold the prompt (`draft_cache.
  restore_together`: the longer trimmed; a hybrid side only where it holds a state),
  and an insert stores each up to the tokens it holds (after speculative decoding the
  draft's may hold one token less than the model's). mlx-lm cannot trim a hybrid
  draft model's cache (its recurrent state), so after speculative decoding it may
  hold rejected draft tokens: for a hybrid draft model an insert prefills the draft
  again over the tokens the bank lacks (with `capture_states` off too), and stores
  that, up to where the model's part ends. A cache holding only the
  model's layers (no draft part) stores the model's; it restores nothing until the
  draft model's caches are stored too. Salts salt both.

What the interface cannot carry (said in the README too): the states inside mlx-lm's
own prefill (recomputed instead, above), and a prompt with nothing to prefill.
`trim_to(n_sequences=...)` has no meaning for a bank of blocks (it holds no
sequences) and is refused; `trim_to(n_bytes=...)` evicts the
bank (least recently used leaves first) to that many payload and state bytes.
`len()`, `stats_by_type()` count the sequences this object inserted by cache type,
`nbytes` is the bank's stored bytes (all namespaces).

A cache failure never stops serving: `fetch_nearest_cache` and `insert_cache` run on
mlx-lm's generation thread, so an error there (an unsupported cache class, a failed
write) is logged and counted in `stats()`, and the request goes on uncached.

Stores go through the bank's background writer by default (`PrefixCache`'s
`background`): `insert_cache` returns once the cache is snapshotted and its stores are
queued, so mlx-lm's generation thread never waits for a write; a fetch right after
sees what the insert stored (blocks, states, the end record, and so the namespace of
its cache type: quantized or not) from memory until it is written.
`blocks_written`, `bytes_written` and `end_bytes_written` count what the writer wrote
(`bank.flush()` waits for it); a queued store that fails is logged and raised by the
next `bank.flush()` (and `close()`). `background=False` stores inline.

Here: mlx-lm's interface, the namespaces and the fetches; what an insert stores (the
steps above: blocks, end records, the hybrid states prefilled again, the draft model's
part) is `runtime.prompt_cache_inserts`.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from cas_bank.bank import Bank
from cas_bank.errors import InvalidInputError
from cas_bank.evict.eviction import evict_to_budget

from .draft_cache import restore_together
from .models import LoadedModel
from .prefix_cache import PrefixCache
from .prompt_cache_inserts import QuantKey, store_insert

if TYPE_CHECKING:
    # mypy cannot see `mlx.nn.Module` through the package's star imports.
    from mlx.nn.layers.base import Module

log = logging.getLogger("cas_bank.mlx_lm")

# mlx-lm's cache types, in the order its LRUPromptCache reports them.
CACHE_TYPES: Final = ("assistant", "user", "system")

# `model_key` default: accept every key mlx-lm passes (one model per server).
ANY_MODEL: Final = object()


@dataclass
class AdapterStats:
    """What a `BankPromptCache` did in this process."""

    fetches: int = 0
    hits: int = 0
    hit_tokens: int = 0
    fetched_tokens: int = 0
    inserts: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    other_model: int = 0  # calls for another model_key: a miss, nothing stored
    recomputed_tokens: int = 0  # hybrid models: tokens prefilled again to capture states
    end_bytes_written: int = 0  # end records written by inserts
    failures: int = 0  # fetches or inserts that failed (logged), served uncached
    draft_bytes_written: int = 0  # of bytes_written, the draft model's (a draft model)
    trimmed_tokens: int = 0  # restored by one model past what the other held, dropped

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BankPromptCache:
    """A `Bank` with the interface of mlx-lm's `LRUPromptCache` (see the module docstring).

    `model`: the mlx-lm model the server runs (or a `LoadedModel`). `model_key`: the
    key mlx-lm passes for it (its `ModelProvider.model_key`); calls with another key
    are misses and store nothing. By default every key is taken as this model's.
    `kv_bits` / `kv_group_size`: the quantized KV the server may produce (its
    `--kv-bits`, `--kv-group-size`), so fetches look in that namespace from the start.
    `capture_states`: for a hybrid model, prefill new prefixes once more to capture
    the recurrent states at their block boundaries (see the module docstring).
    `salt`: a tenant's salt (vLLM's `cache_salt`), part of every namespace root this
    cache reads and writes: the same salt shares every block, different salts (or
    none) share none. `salted(salt)` is this cache for another tenant.
    `background`: `PrefixCache`'s (None: the bank's writer when it has one; False:
    inline stores). `draft_model`: speculative decoding's draft model (or its
    `LoadedModel`): caches are the model's followed by the draft model's, each kept in
    its own namespace and restored to the same length (`draft_name`: its namespace's
    name; see the module docstring). `store`: False stores nothing (`insert_cache` is
    a no-op; restores still run). `keep_end` (default True): an insert keeps the exact
    end of its cache, an end record (see the module docstring), so the next turn
    restores all of it; False: whole blocks and boundary states only.
    """

    def __init__(
        self,
        bank: Bank,
        model: Module | LoadedModel,
        *,
        model_key: Hashable = ANY_MODEL,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        name: str | None = None,
        capture_states: bool = True,
        salt: str | bytes | None = None,
        background: bool | None = None,
        store: bool = True,
        keep_end: bool = True,
        draft_model: Module | LoadedModel | None = None,
        draft_name: str | None = None,
    ) -> None:
        self.bank = bank
        self.store = store
        self.keep_end = keep_end
        self.capture_states = capture_states
        self.background = background
        self._count_lock = threading.Lock()  # the writer's thread counts what it wrote
        self.model = model
        self.model_key = model_key
        self.name = name
        self.salt = salt or None
        self.draft_model = draft_model
        self.draft_name = draft_name
        self._prefix: dict[QuantKey, PrefixCache] = {}
        self._prefix_for(None)
        # The draft model's namespaces, by quantized-KV kind (None: no draft model).
        self._draft: dict[QuantKey, PrefixCache] | None = None
        if draft_model is not None:
            self._draft = {}
            self._prefix_for(None, draft=True)
        if kv_bits is not None:
            self._prefix_for((kv_bits, kv_group_size))
            if draft_model is not None:
                self._prefix_for((kv_bits, kv_group_size), draft=True)
        self._counts = {t: 0 for t in CACHE_TYPES}
        self._bytes = {t: 0 for t in CACHE_TYPES}
        self.counters = AdapterStats()
        self._fetched: list[int] | None = None  # the tokens of the last fetch

    def salted(self, salt: str | bytes | None) -> BankPromptCache:
        """This cache for the tenant `salt` (None or empty: no salt): the same bank,
        model and counters, every namespace under that salt's root (`PrefixCache.salted`;
        the model is not probed again)."""
        salt = salt or None
        if salt == self.salt:
            return self
        other = copy.copy(self)
        other.salt = salt
        other._fetched = None
        other._prefix = {k: pc.salted(salt) for k, pc in self._prefix.items()}
        if self._draft is not None:
            other._draft = {k: pc.salted(salt) for k, pc in self._draft.items()}
        return other

    @property
    def prefix_cache(self) -> PrefixCache:
        """The `PrefixCache` of unquantized KV (the model's own spec)."""
        return self._prefix[None]

    @property
    def draft_prefix_cache(self) -> PrefixCache | None:
        """The draft model's `PrefixCache` of unquantized KV (None: no draft model)."""
        return None if self._draft is None else self._draft[None]

    @property
    def block_size(self) -> int:
        return self.prefix_cache.block_size

    # -- mlx-lm's interface -----------------------------------------------------------
    def __len__(self) -> int:
        return sum(self._counts.values())

    @property
    def nbytes(self) -> int:
        """Payload, state and end-record bytes the bank holds (every namespace)."""
        v = self.bank.counters.values()
        return int(v["payload_bytes"] + v["state_bytes"] + v["end_bytes"])

    def fetch_nearest_cache(self, model: Any, tokens: Sequence[int]) -> tuple[Any, Any]:
        """`(cache, rest)`: a fresh cache holding the longest stored prefix of
        `tokens[:-1]` and the tokens after it; `(None, tokens)` on a miss."""
        if not self._accepts(model):
            return None, tokens
        self.counters.fetches += 1
        # The prompt, copied: mlx-lm's sequential path appends its answer to this list.
        self._fetched = list(tokens) if all(isinstance(t, int) for t in tokens) else None
        try:
            found = self._restore(tokens)
        except Exception:
            log.exception("cas_bank: restoring a prompt failed; it is prefilled uncached")
            self.counters.failures += 1
            return None, tokens
        self.counters.fetched_tokens += len(tokens)
        if found is None:
            return None, tokens
        cache, n = found
        self.counters.hits += 1
        self.counters.hit_tokens += n
        return cache, tokens[n:]

    def insert_cache(
        self,
        model: Any,
        tokens: Sequence[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Store the full blocks of the tokens `prompt_cache` holds (see the module);
        nothing when made with `store=False`."""
        self._insert(model, tokens, prompt_cache, cache_type, self.capture_states)

    def insert_stopped(self, model: Any, tokens: Sequence[int], prompt_cache: list[Any]) -> None:
        """`insert_cache` of a prefill stopped before its prompt's end (counted as a
        "user" cache), without prefilling its tokens again: a hybrid cache that ends
        off a block boundary keeps its blocks and its end record (the recurrent state
        right there), which is all a prompt that extends it restores."""
        self._insert(model, tokens, prompt_cache, "user", False)

    def _insert(
        self,
        model: Any,
        tokens: Sequence[int],
        prompt_cache: list[Any],
        cache_type: str,
        capture: bool,
    ) -> None:
        if not self.store or not self._accepts(model):
            return
        if cache_type not in self._counts:
            log.warning("cas_bank: unknown cache_type %r counted as 'assistant'", cache_type)
            cache_type = "assistant"
        self.counters.inserts += 1
        self._counts[cache_type] += 1
        try:
            store_insert(self, tokens, prompt_cache, cache_type, capture)
        except Exception:
            log.exception("cas_bank: storing a prompt cache failed; nothing of it is kept")
            self.counters.failures += 1

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict the bank to `n_bytes` (least recently used leaves first)."""
        if n_sequences is not None:
            raise InvalidInputError(
                "trim_to(n_sequences=...): a bank holds blocks shared between prompts, not "
                "sequences; bound it by bytes (trim_to(n_bytes=...) or BankConfig.max_bytes)"
            )
        if n_bytes is not None and not self.bank.read_only:
            evict_to_budget(self.bank, max(0, int(n_bytes)))

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per cache type: sequences inserted by this object and the bytes they wrote."""
        return {t: {"n_sequences": self._counts[t], "n_bytes": self._bytes[t]} for t in CACHE_TYPES}

    def stats(self) -> dict[str, int]:
        """Fetches, hits, restored tokens, inserts, bytes written, failures."""
        return self.counters.as_dict()

    # -- the work ---------------------------------------------------------------------
    def _accepts(self, model: Any) -> bool:
        if self.model_key is ANY_MODEL or model == self.model_key:
            return True
        self.counters.other_model += 1
        return False

    def _prefix_for(self, key: QuantKey, *, draft: bool = False) -> PrefixCache:
        """The model's (`draft`: the draft model's) `PrefixCache` of KV kind `key`."""
        made = self._draft if draft else self._prefix
        assert made is not None
        pc = made.get(key)
        if pc is None:
            bits, group = key if key is not None else (None, 64)
            pc = PrefixCache(
                self.bank,
                self.draft_model if draft else self.model,  # type: ignore[arg-type]
                kv_bits=bits,
                kv_group_size=group,
                name=self.draft_name if draft else self.name,
                salt=self.salt,
                background=self.background,
                keep_end=self.keep_end,
            )
            made[key] = pc
        return pc

    @staticmethod
    def _best(made: dict[QuantKey, PrefixCache], tokens: Sequence[int]) -> PrefixCache:
        """The namespace that covers most of `tokens` (looked at, not read)."""
        candidates = list(made.values())
        if len(candidates) == 1:
            return candidates[0]
        return max(candidates, key=lambda pc: pc.match(tokens))

    def _restore(self, tokens: Sequence[int]) -> tuple[list[Any], int] | None:
        if len(tokens) < 2 or not all(isinstance(t, int) for t in tokens):
            return None  # nothing to restore, or a key that is not token ids (vision)
        pc = self._best(self._prefix, tokens)
        if self._draft is None:
            cache, n = pc.restore(tokens)
        else:  # both to the same length: as far as both hold the prompt
            sides = [pc, self._best(self._draft, tokens)]
            (model, draft), n, trimmed = restore_together(sides, tokens)
            cache = [*model, *draft]
            self.counters.trimmed_tokens += trimmed
        # mlx-lm's server prefills on its own and calls back (`insert_cache`) only
        # once the answer is done: the refill the restore held starts now, as before
        # `PrefixCache` held them, rather than 2 s into the answer or after it.
        self.bank.resources.release()
        return (cache, n) if n else None

    def _count(
        self, cache_type: str, blocks: int, nbytes: int, *, end: bool = False, draft: bool = False
    ) -> None:
        """What a store wrote (on the writer's thread for a queued one)."""
        with self._count_lock:
            self.counters.blocks_written += blocks
            self.counters.bytes_written += nbytes
            if end:
                self.counters.end_bytes_written += nbytes
            if draft:
                self.counters.draft_bytes_written += nbytes
            self._bytes[cache_type] += nbytes

    def _count_recomputed(self, tokens: int) -> None:
        """Tokens an insert prefilled again (a hybrid model's states; on its thread)."""
        self.counters.recomputed_tokens += tokens

    def __repr__(self) -> str:
        draft = self.draft_prefix_cache
        also = "" if draft is None else f", draft={draft.spec.name!r}"
        return f"BankPromptCache({self.bank!r}, {self.prefix_cache.spec.name!r}{also})"
