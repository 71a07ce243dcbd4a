"""A cas_bank `ModelSpec` derived from an mlx-lm model and the cache objects it makes.

The spec is what roots a model's namespace in the bank, so it holds everything that
makes two caches incompatible:

- per layer, the cache's kind and array layout, read from a real cache after a
  one-token forward pass on a scratch cache (shapes and dtypes are what the model
  actually produces, not what a config claims);
- KV quantization (`kv_bits`, `kv_group_size`: mlx-lm's `QuantizedKVCache`);
- the weights digest (from the weights themselves, computed once per model object,
  see `runtime.models.weights_digest`) and a digest of the architecture's arguments.

The spec's `name` is the architecture (`model_type`), not a file or directory name:
the same weights loaded from two places share every block.

Supported cache classes: `KVCache`, `QuantizedKVCache` (attention) and `ArraysCache`
(Gated DeltaNet / Mamba style recurrent layers). Refused, with an error naming the
class: `RotatingKVCache` (a sliding window overwrites old tokens, so its KV is not a
function of the token prefix), `ChunkedKVCache`, `CacheList`, `ConcatenateKVCache`
and every `Batch*` cache (one sequence per cache here).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import mlx.nn as nn

from cas_bank.errors import InvalidInputError
from cas_bank.spec import LayerSpec, ModelSpec

from .cache_io import cache_kind_of, check_cache_class, new_cache
from .models import LoadedModel, weights_digest
from .tokenizer import ByteTokenizer

# Bumped when the bytes hashed by `config_digest` change.
_CONFIG_CONTEXT = "cas_bank 2026-11-29 model config digest v1"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a `PrefixCache` learns about its model once, at construction."""

    spec: ModelSpec
    vocab_size: int  # ids >= this are refused before any forward pass
    kv_bits: int | None
    kv_group_size: int


def unwrap(model: nn.Module | LoadedModel) -> tuple[nn.Module, LoadedModel | None]:
    """The mlx-lm module, and the `LoadedModel` around it if one was given."""
    if isinstance(model, LoadedModel):
        return model.model, model
    if isinstance(model, nn.Module):
        return model, None
    raise InvalidInputError(
        f"expected an mlx-lm model (nn.Module) or a LoadedModel, got {type(model).__name__}"
    )


def layer_spec_of(entry: Any, index: int) -> LayerSpec:
    """The layout of one cache object that has seen at least one token."""
    check_cache_class(entry, index)
    return cache_kind_of(entry).describe(entry, index)


def probe_model(
    model: nn.Module | LoadedModel,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    name: str | None = None,
) -> ModelInfo:
    """Run one token through a scratch cache and derive the spec from what it holds."""
    module, loaded = unwrap(model)
    if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidInputError(f"kv_bits={kv_bits}: mlx quantizes to 2, 3, 4, 5, 6 or 8 bits")
    cache = new_cache(module, kv_bits, kv_group_size)
    try:
        logits = module(mx.array([[0]]), cache=cache)
    except ValueError as e:  # mx.quantize refuses a group size that does not fit
        raise InvalidInputError(f"a one-token probe of the model failed: {e}") from e
    mx.eval(logits, [c.state for c in cache])
    layers = tuple(layer_spec_of(c, i) for i, c in enumerate(cache))
    spec = ModelSpec(
        name=name or _model_type(module, loaded),
        layers=layers,
        weights_digest=loaded.weights_digest if loaded else weights_digest(module),
        config_digest=config_digest(module, loaded),
        tokenizer=_tokenizer_name(loaded),
    )
    return ModelInfo(
        spec=spec, vocab_size=int(logits.shape[-1]), kv_bits=kv_bits, kv_group_size=kv_group_size
    )


def spec_for_model(
    model: nn.Module | LoadedModel,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    name: str | None = None,
) -> ModelSpec:
    """The `ModelSpec` of `model` (one forward pass of one token; cache it)."""
    return probe_model(model, kv_bits=kv_bits, kv_group_size=kv_group_size, name=name).spec


def config_digest(module: nn.Module, loaded: LoadedModel | None = None) -> str:
    """Hex blake3 of the architecture's arguments, canonical JSON.

    Taken from the module's `args` dataclass where it has one, so a model built from
    a config dict and the same model loaded from a directory agree; else from the
    `LoadedModel`'s config.
    """
    args = getattr(module, "args", None)
    body: Any = None
    if args is not None and dataclasses.is_dataclass(args) and not isinstance(args, type):
        body = _canonical(dataclasses.asdict(args))
    if body is None and loaded is not None:
        body = _canonical(loaded.config)
    if body is None:
        raise InvalidInputError(
            "cannot digest this model's configuration: it has no JSON-like `args` "
            "dataclass; pass a LoadedModel with its config"
        )
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(raw, derive_key_context=_CONFIG_CONTEXT).hexdigest()


def _canonical(value: Any) -> Any:
    """JSON-ready copy of `value`, or None when a leaf has no stable spelling.

    (A repr with a memory address would give another digest in every process, and
    every restart would silently miss.)
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            c = _canonical(v)
            if c is None and v is not None:
                return None
            out[str(k)] = c
        return out
    if isinstance(value, (list, tuple)):
        items = [_canonical(v) for v in value]
        if any(c is None and v is not None for c, v in zip(items, value, strict=True)):
            return None
        return items
    return None


def _model_type(module: nn.Module, loaded: LoadedModel | None) -> str:
    args = getattr(module, "args", None)
    model_type = getattr(args, "model_type", None) or getattr(module, "model_type", None)
    if not model_type and loaded is not None:
        model_type = loaded.config.get("model_type")
    return str(model_type or type(module).__module__.rsplit(".", 1)[-1])


def _tokenizer_name(loaded: LoadedModel | None) -> str | None:
    """Recorded for tools that decode a block's tokens; not part of the fingerprint."""
    if loaded is None:
        return None
    tok = loaded.tokenizer
    if isinstance(tok, ByteTokenizer):
        return f"byte:{tok.vocab_size}"
    path = getattr(tok, "name_or_path", None)
    if path and Path(str(path)).is_dir():
        # Absolute, so `cas-bank show` finds the model's own tokenizer from anywhere.
        return str(Path(str(path)).resolve())
    return str(path) if path else type(tok).__name__
