"""The bank as mlx-vlm's automatic prefix cache (APC), for `cas-bank mlx-vlm-server`.

mlx-vlm's server hands a prompt cache to its generator (`BatchGenerator`) only through
its APC manager: before a prompt's prefill it asks the manager's tiers for the longest
cached prefix (`lookup_prefix`: its in-memory block pool; `lookup_exact_cache`;
`lookup_prefix_disk_cache`: its SSD tier, which returns a ready prompt cache), and after
the prefill it hands the manager the prompt's K/V (`store_kv_blocks`). `BankAPC` is that
manager with the bank in place of its tiers: the pool and the exact-cache tier hold
nothing, the disk lookup restores from the bank (`VisionPrefixCache.restore`), and the
store queues the prompt's blocks into the bank (`VisionPrefixCache.store`), keyed by the
images they hold. Every hit is then the bank's, and it survives a restart.

The manager sees a request's token ids and mlx-vlm's `extra_hash`: one 64-bit hash of
all of a request's pixels (and its tenant), not the images one by one. The server's
generator (`mlx_vlm_server`) therefore registers each request as it is queued
(`remember`): its token ids, pixels and image grid, from which the bank's key sequence
is computed (`VisionPrefixCache.prompt`: a digest per image, at its placeholder
positions), under (`extra_hash`, the token ids). A lookup or store that finds no
registered request, or two registered under one key with different pixels (a 64-bit
collision of mlx-vlm's hash), does not touch the bank: the request is served without a
cache, never with another image's blocks.

mlx-vlm's own rule stays: a prefix is reused only when it covers every image of the
prompt (the rest of the prompt is text: `prefix_leaves_text_only_suffix`), so a hit
that ends before an image's last placeholder is not used (and not counted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import blake3
import mlx.core as mx
import numpy as np
from mlx_vlm.apc import APCManager, make_warm_kv_cache_from_layers

from cas_bank.bank import Bank

from .vlm import VisionPrefixCache

REMEMBERED: Final = 256  # requests registered and not yet stored (a bound, LRU)
# mlx-vlm's model types whose `get_input_embeddings` takes the encoder's output as
# `cached_image_features` (the rows of every image, in order) and then skips the encoder.
FEATURE_TYPES: Final = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class _Request:
    """What a queued request brings that mlx-vlm's hash does not say."""

    pixels: Any  # pixel_values as the processor fed them (None: text only)
    grid: Any  # image_grid_thw
    salt: str | None  # the request's tenant (mlx-vlm's X-APC-Tenant)
    digest: bytes  # of the pixels and grid: tells two requests' images apart


def _digest(pixels: Any, grid: Any) -> bytes:
    h = blake3.blake3()
    for part in (pixels, grid):
        if part is None:
            h.update(b"\0")
            continue
        arr = np.asarray(part)
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.digest()


def _token_key(extra_hash: int, token_ids: Sequence[int]) -> tuple[int, bytes]:
    ids = np.asarray(token_ids, dtype=np.int64)
    return int(extra_hash), blake3.blake3(ids.tobytes()).digest()


class Requests:
    """Queued requests by (`extra_hash`, token ids) (see the module docstring), each with
    how many are queued under it. Two queued under one key with different pixels (a
    64-bit collision of mlx-vlm's hash) leave the key ambiguous: `get` gives None for
    it until both are forgotten."""

    def __init__(self, bound: int = REMEMBERED) -> None:
        # key -> [the request (None: ambiguous), how many are queued under it]
        self._by_key: OrderedDict[tuple[int, bytes], list[Any]] = OrderedDict()
        self._bound = bound
        self._lock = threading.Lock()

    def remember(
        self, extra_hash: int, token_ids: Sequence[int], raw: Mapping[str, Any], salt: str | None
    ) -> None:
        pixels, grid = raw.get("pixel_values"), raw.get("image_grid_thw")
        request = _Request(pixels, grid, salt, _digest(pixels, grid))
        key = _token_key(extra_hash, token_ids)
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None:
                self._by_key[key] = [request, 1]
            else:
                same = entry[0] is not None and entry[0].digest == request.digest
                entry[0], entry[1] = (entry[0] if same else None), entry[1] + 1
                self._by_key.move_to_end(key)
            while len(self._by_key) > self._bound:
                self._by_key.popitem(last=False)

    def get(self, extra_hash: int, token_ids: Sequence[int]) -> _Request | None:
        """The request queued with these, or None (unknown, or ambiguous)."""
        with self._lock:
            entry = self._by_key.get(_token_key(extra_hash, token_ids))
            return None if entry is None else entry[0]

    def forget(self, extra_hash: int, token_ids: Sequence[int]) -> None:
        """One request queued with these is done (stored)."""
        key = _token_key(extra_hash, token_ids)
        with self._lock:
            entry = self._by_key.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._by_key[key]


def _kv_cache(keys: mx.array, values: mx.array) -> Any:
    """An mlx-lm `KVCache` holding `keys`/`values` ([1, heads, T, dim])."""
    from mlx_lm.models.cache import KVCache

    cache: Any = KVCache()  # type: ignore[no-untyped-call]
    cache.keys, cache.values, cache.offset = keys, values, int(keys.shape[2])
    return cache


class BankAPC(APCManager):  # type: ignore[misc]  # mlx-vlm is untyped (Any)
    """mlx-vlm's APC manager with the bank as its only tier (see the module docstring).

    `store`: False restores only. `background`: stores through the bank's writer
    (None: when the bank has one)."""

    def __init__(self, bank: Bank, *, store: bool = True, background: bool | None = None) -> None:
        # No block pool, no exact snapshots: what mlx-vlm would keep, the bank keeps.
        super().__init__(
            num_blocks=0,
            block_size=bank.config.block_size,
            disk=None,
            overrides={"memory_max_gb": 0, "checkpoint_entries": 0},
        )
        self.bank = bank
        self.storing = store
        self.background = background
        self.requests = Requests()
        self._model: Any = None
        self._caches: dict[str | None, VisionPrefixCache] = {}
        self.images_encoded = 0  # images this process ran the vision encoder on
        self.feature_hits = 0  # images whose encoder output came from the bank

    # -- the model and its requests ------------------------------------------------
    def bind(self, model: Any) -> None:
        """Serve `model` (mlx-vlm's, as its server loaded it). Raises (the model named)
        when the bank cannot key its images: the server then refuses to load it."""
        self._caches = {None: VisionPrefixCache(self.bank, model, background=self.background)}
        self._model = model

    def prefix_cache(self, salt: str | None) -> VisionPrefixCache:
        if salt not in self._caches:
            salted = self._caches[None].salted(salt)
            assert isinstance(salted, VisionPrefixCache)
            self._caches[salt] = salted
        return self._caches[salt]

    def remember(self, extra_hash: int, raw: Mapping[str, Any], salt: str | None) -> None:
        ids = raw.get("input_ids")
        if ids is None or self._model is None:
            return
        self.requests.remember(extra_hash, np.asarray(ids).reshape(-1).tolist(), raw, salt)

    def _prompt(self, token_ids: Sequence[int], extra_hash: int) -> tuple[Any, Any] | None:
        request = self.requests.get(extra_hash, token_ids)
        if request is None or self._model is None:
            return None
        vpc = self.prefix_cache(request.salt)
        ids = np.asarray(token_ids, dtype=np.int32)
        return vpc, vpc.prompt(ids, pixel_values=request.pixels, image_grid_thw=request.grid)

    def image_features(self, raw: Mapping[str, Any], extra_hash: int) -> mx.array | None:
        """The vision encoder's output for every image of a registered request, in order
        (`cached_image_features` for mlx-vlm's `get_input_embeddings`): each image's from
        the bank when it holds it (`VisionPrefixCache.features`), else encoded here, one
        image at a time, and stored. mlx-vlm's Qwen2-VL runs the encoder on every
        request, a prefix hit or not; with these it runs it on none it has seen. None
        (mlx-vlm encodes as usual): text only, an unregistered request, a model type
        without `cached_image_features`, or features off."""
        ids = raw.get("input_ids")
        ids = None if ids is None else np.asarray(ids).reshape(-1).tolist()
        found = None if ids is None else self._prompt(ids, extra_hash)
        if found is None:
            return None
        vpc, prompt = found
        if not prompt.spans or vpc.features is None or vpc.kind not in FEATURE_TYPES:
            return None
        rows = []
        for i in range(len(prompt.spans)):
            features, hit = vpc.image_features(prompt, i, store=self.storing)
            self.feature_hits += hit
            self.images_encoded += not hit
            rows.append(features)
        return mx.concatenate(rows)

    # -- mlx-vlm's tiers: the bank in place of its pool, snapshots and disk ---------
    def lookup_prefix(self, token_ids: Sequence[int], extra_hash: int = 0) -> tuple[list[Any], int]:
        return [], 0

    def lookup_exact_cache(self, token_ids: Sequence[int], **kwargs: Any) -> tuple[Any, int]:
        return None, 0

    def lookup_prefix_disk_cache(
        self,
        token_ids: Sequence[int],
        extra_hash: int = 0,
        max_prefix_tokens: int | None = None,
        min_prefix_tokens: int = 0,
        allow_memory_overlap: bool = False,
    ) -> tuple[list[Any] | None, int]:
        """The longest prefix of `token_ids` the bank holds for this request's images, as
        mlx-vlm's warm cache, when it is longer than `min_prefix_tokens` (it then covers
        every image); else (None, 0), the bank left untouched."""
        found = self._prompt(token_ids, extra_hash)
        if found is None:
            self._count(hit=0)
            return None, 0
        vpc, prompt = found
        if vpc.match(prompt) <= min_prefix_tokens:
            self._count(hit=0)
            return None, 0
        cache, n = vpc.restore(prompt)
        if n <= min_prefix_tokens or n >= len(token_ids):
            self._count(hit=0)
            return None, 0
        keys = [c.keys[..., :n, :] for c in cache]
        values = [c.values[..., :n, :] for c in cache]
        warm = make_warm_kv_cache_from_layers(keys, values, n)
        self._count(hit=n)
        return warm, n

    def store_kv_blocks(
        self,
        token_ids: Sequence[int],
        layer_keys: list[mx.array],
        layer_values: list[mx.array],
        *,
        extra_hash: int = 0,
        skip_first_n_tokens: int = 0,
    ) -> list[Any]:
        """Store the prompt's K/V in the bank (queued: the prefill does not wait)."""
        found = self._prompt(token_ids, extra_hash)
        self.requests.forget(extra_hash, token_ids)
        n = len(token_ids)
        if found is None or not self.storing or not layer_keys or layer_keys[0].shape[2] < n:
            return []
        vpc, prompt = found
        cache = [
            _kv_cache(k[..., :n, :], v[..., :n, :])
            for k, v in zip(layer_keys, layer_values, strict=True)
        ]
        vpc.store(prompt, cache, this_model=True)
        with self.lock:
            self.stats.stores += 1
            self.stats.stored_tokens += n
        return []

    def _count(self, *, hit: int) -> None:
        with self.lock:
            if hit:
                self.stats.hits += 1
                self.stats.disk_hits += 1
                self.stats.matched_tokens += hit
            else:
                self.stats.misses += 1

    def stats_snapshot(self) -> dict[str, Any]:
        """mlx-vlm's APC statistics (its hits are the bank's) and the bank's own."""
        snap: dict[str, Any] = super().stats_snapshot()
        snap["bank"] = self.bank.stats().model_dump(mode="json")
        snap["images_encoded"] = self.images_encoded
        snap["image_feature_hits"] = self.feature_hits
        return snap

    def clear(self) -> None:
        """mlx-vlm clears its APC when it unloads a model: the bank keeps what it holds
        (another model's namespace is another root); the bound model is dropped."""
        super().clear()
        self._model = None
        self._caches = {}

    def close(self) -> None:
        """The bank is the command's to close (it writes its queue then)."""
