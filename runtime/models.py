"""The models cas_bank runs with: embedded configs, local mlx-lm directories, digests.

Nothing is downloaded. The embedded models are real mlx-lm architectures built from
a config dict with seeded random weights:

- ``tiny-*``: milliseconds to build, for tests and the demo. ``tiny-qwen3`` and
  ``tiny-llama`` are attention-only; ``tiny-hybrid`` (qwen3_next) and
  ``tiny-qwen3_5`` alternate Gated DeltaNet and attention layers
  (``full_attention_interval=2``: ArraysCache, KVCache, ArraysCache, KVCache).
- ``medium-*``: ~60-80M parameters, for benchmarks only (slow to prefill on the
  mlx-cpu wheel: docs/design.md, "Where each figure is measured").

A loaded model carries its weights digest, which the bank puts into the namespace
root so that a cache is never served to different weights. It is computed once per
model object: weights are treated as immutable once loaded (a model whose
parameters are changed in place must be digested again with ``refresh=True``).
"""

from __future__ import annotations

import copy
import functools
import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

import blake3
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as _mlx_lm_load_model
from mlx_lm.utils import load_tokenizer as _mlx_lm_load_tokenizer

from cas_bank.errors import InvalidInputError

from .tokenizer import AnyTokenizer, ByteTokenizer

if TYPE_CHECKING:
    # For annotations only (`mlx.nn.Module` is the same class).
    from mlx.nn.layers.base import Module

# Tiny models: vocab 512 holds the byte tokenizer (256 bytes + specials); a long
# context so that tests may use any prompt length without touching the config.
_TINY_COMMON: Final[Mapping[str, Any]] = MappingProxyType(
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=512,
        max_position_embeddings=32768,
        rope_theta=10000.0,
    )
)

# Gated DeltaNet settings shared by the tiny hybrids.
_TINY_LINEAR: Final[Mapping[str, Any]] = MappingProxyType(
    dict(
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
    )
)

_MEDIUM_COMMON: Final[Mapping[str, Any]] = MappingProxyType(
    dict(
        hidden_size=512,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
)

_CONFIGS: Final[Mapping[str, Mapping[str, Any]]] = MappingProxyType(
    {
        "tiny-qwen3": dict(
            model_type="qwen3",
            num_hidden_layers=4,
            tie_word_embeddings=True,
            **_TINY_COMMON,
        ),
        "tiny-llama": dict(
            model_type="llama",
            num_hidden_layers=2,
            tie_word_embeddings=False,
            **_TINY_COMMON,
        ),
        "tiny-hybrid": dict(
            model_type="qwen3_next",
            num_hidden_layers=4,
            tie_word_embeddings=False,
            partial_rotary_factor=0.25,
            # A small mixture of experts on every layer, as in Qwen3-Next itself.
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=64,
            moe_intermediate_size=64,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **_TINY_COMMON,
            **_TINY_LINEAR,
        ),
        "tiny-qwen3_5": dict(
            model_type="qwen3_5",
            text_config=dict(
                model_type="qwen3_5_text",
                num_hidden_layers=4,
                tie_word_embeddings=False,
                # Explicit, so the config says what it builds (the class default is mrope).
                rope_parameters=dict(
                    type="default", rope_theta=10000.0, partial_rotary_factor=0.25
                ),
                **_TINY_COMMON,
                **_TINY_LINEAR,
            ),
        ),
        "medium-qwen3": dict(
            model_type="qwen3",
            intermediate_size=1536,
            **_MEDIUM_COMMON,
        ),
        "medium-hybrid": dict(
            model_type="qwen3_next",
            intermediate_size=1536,
            partial_rotary_factor=0.25,
            # Qwen3-Next's own layout: three GDN layers to one attention layer.
            linear_num_value_heads=8,
            linear_num_key_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            # Dense MLPs: mixture-of-experts layers (gather_mm) run only in float32 on
            # the CPU, and benchmarks need bfloat16.
            num_experts=0,
            num_experts_per_tok=0,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=0,
            moe_intermediate_size=0,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **_MEDIUM_COMMON,
        ),
    }
)

MODEL_NAMES: Final[tuple[str, ...]] = tuple(_CONFIGS)
DEFAULT_MODEL: Final = "tiny-hybrid"  # what the demo and the servers run with no model named

# Bumped when the byte layout hashed by `weights_digest` changes.
_DIGEST_CONTEXT: Final = "cas_bank 2025 weights digest v1"


@dataclass(frozen=True)
class LoadedModel:
    """A ready model and what the bank needs to know about it."""

    model: Module
    config: dict[str, Any]
    name: str
    tokenizer: AnyTokenizer
    weights_digest: str


def model_config(name: str) -> dict[str, Any]:
    """A fresh copy of the embedded config `name` (callers may change it freely)."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    return _plain_copy(_CONFIGS[name])


def build_model(name: str, *, seed: int = 0, dtype: mx.Dtype | None = None) -> LoadedModel:
    """Build embedded model `name` with random weights drawn from `seed`.

    `dtype` (e.g. `mx.bfloat16`) casts the floating parameters the way mlx-lm's
    converter does, leaving those the architecture keeps in float32 (GDN's `A_log`).
    Reseeds MLX's global random generator (`mx.random.seed(seed)`). Raises
    `ValueError` for an unknown name, or a dtype the device cannot run the model in.
    """
    config = model_config(name)
    if dtype is not None:
        _check_dtype_supported(name, config, dtype)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    # Args get their own copy: some __post_init__s edit nested dicts in place.
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    if dtype is not None:
        _cast_parameters(model, dtype)
    model.eval()
    mx.eval(model.parameters())
    return LoadedModel(
        model=model,
        config=config,
        name=name,
        tokenizer=ByteTokenizer(vocab_size=_vocab_size(config)),
        weights_digest=weights_digest(model),
    )


def load_model(path: str | Path) -> LoadedModel:
    """Load a local mlx-lm model directory (config.json and model*.safetensors).

    The tokenizer comes from the directory's tokenizer files when it has any, else
    it is a `ByteTokenizer`. Never downloads: a missing path is an error, not a hub id.
    """
    model_path = Path(path)
    if not model_path.exists():
        raise FileNotFoundError(f"model directory {model_path} does not exist")
    if not model_path.is_dir():
        raise NotADirectoryError(f"model path {model_path} is not a directory")
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model_path} has no config.json")
    if not any(model_path.glob("model*.safetensors")):
        raise FileNotFoundError(f"model directory {model_path} has no model*.safetensors")
    model, config = _mlx_lm_load_model(model_path)
    tokenizer: AnyTokenizer
    if _has_tokenizer_files(model_path):
        tokenizer = _mlx_lm_load_tokenizer(model_path)  # type: ignore[no-untyped-call]
    else:
        tokenizer = ByteTokenizer(vocab_size=_vocab_size(config))
    return LoadedModel(
        model=model,
        config=config,
        name=model_path.resolve().name,
        tokenizer=tokenizer,
        weights_digest=weights_digest(model),
    )


def resolve_model(model: str | Path | None, *, seed: int = 0) -> LoadedModel:
    """None or an embedded name -> `build_model`; anything else is a local directory."""
    if model is None:
        return build_model(DEFAULT_MODEL, seed=seed)
    if isinstance(model, str) and model in MODEL_NAMES and not Path(model).exists():
        return build_model(model, seed=seed)
    if not Path(model).exists():
        raise InvalidInputError(
            f"unknown model {str(model)!r}: not an embedded model ({', '.join(MODEL_NAMES)}) "
            "nor a model directory"
        )
    return load_model(model)


def save_model(loaded: LoadedModel, path: str | Path) -> Path:
    """Write `loaded` as an mlx-lm directory (config.json + model.safetensors).

    `load_model` reads it back with the same weights digest. A tokenizer with
    `save_pretrained` (a Hugging Face one) is saved alongside; a `ByteTokenizer`
    needs no files. Returns the directory.
    """
    model_path = Path(path)
    model_path.mkdir(parents=True, exist_ok=True)
    # Shards of an earlier save would be loaded together with this one.
    stale = sorted(p.name for p in model_path.glob("model*.safetensors"))
    if stale and stale != ["model.safetensors"]:
        raise ValueError(f"{model_path} already holds other weight files: {stale}")
    weights = dict(_named_parameters(loaded.model))
    mx.save_safetensors(str(model_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(model_path / "config.json", "w", encoding="utf-8") as f:
        json.dump(loaded.config, f, indent=2, sort_keys=True)
    save_pretrained = getattr(loaded.tokenizer, "save_pretrained", None)
    if save_pretrained is not None:
        save_pretrained(str(model_path))
    return model_path


# Digests by id(model); weakref.finalize drops an entry when its model is collected.
# (An nn.Module is a dict, hence unhashable: a WeakKeyDictionary cannot hold it.)
_digest_cache: dict[int, str] = {}


def weights_digest(model: Module, *, refresh: bool = False) -> str:
    """A blake3 hex digest of every parameter: name, dtype, shape and raw bytes.

    Parameters are taken in sorted name order, so the digest depends on the
    weights only. Cached per model object; `refresh=True` recomputes it.
    """
    key = id(model)
    cached = _digest_cache.get(key)
    if cached is not None and not refresh:
        return cached
    hasher = blake3.blake3(derive_key_context=_DIGEST_CONTEXT, max_threads=blake3.blake3.AUTO)
    for name, array in sorted(_named_parameters(model), key=lambda item: item[0]):
        raw = _host_bytes(array)
        # "float32", not "mlx.core.float32": the spelling should not follow MLX's repr.
        dtype_name = str(array.dtype).rsplit(".", 1)[-1]
        header = f"{name}\0{dtype_name}\0{tuple(array.shape)}\0{raw.nbytes}\0".encode()
        # Length-prefixed, so no two parameter lists frame into the same byte stream.
        hasher.update(len(header).to_bytes(8, "little"))
        hasher.update(header)
        hasher.update(raw.data)
    digest = hasher.hexdigest()
    if key not in _digest_cache:
        weakref.finalize(model, _digest_cache.pop, key, None)
    _digest_cache[key] = digest
    return digest


def model_context_length(loaded: LoadedModel) -> int:
    """The model's maximum context (max_position_embeddings, top level or text_config)."""
    for config in (loaded.config, loaded.config.get("text_config") or {}):
        value = config.get("max_position_embeddings")
        if value is not None:
            return int(value)
    raise ValueError(f"model {loaded.name!r} has no max_position_embeddings in its config")


def _host_bytes(array: mx.array) -> np.ndarray:
    """The array's raw bytes as a flat uint8 numpy array (numpy has no bfloat16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    # np.asarray is a zero-copy view; ascontiguousarray copies only a strided one.
    # blake3 takes only byte-formatted buffers, hence the uint8 view.
    return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def _cast_parameters(model: Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters to `dtype`, honouring the model's `cast_predicate`."""
    keep = getattr(model, "cast_predicate", lambda _path: True)
    cast_parameters = [
        (path, value.astype(dtype))
        for path, value in _named_parameters(model)
        if keep(path) and mx.issubdtype(value.dtype, mx.floating)
    ]
    model.update(tree_unflatten(cast_parameters))


def _named_parameters(model: Module) -> list[tuple[str, mx.array]]:
    """Every parameter array of `model` by its dotted name (unsorted)."""
    parameters = model.parameters()  # type: ignore[no-untyped-call]
    return cast(list[tuple[str, mx.array]], tree_flatten(parameters))


def _check_dtype_supported(name: str, config: Mapping[str, Any], dtype: mx.Dtype) -> None:
    """Fail at build time, not at the first forward pass, on a dtype the device cannot run.

    Mixture-of-experts layers use `gather_mm`, which MLX's CPU backend runs in
    float32 only (measured with mlx 0.32: "[GatherMM::eval] Currently only supports
    float32"); Metal runs them in any float dtype.
    """
    text_config = config.get("text_config") or {}
    if not (config.get("num_experts") or text_config.get("num_experts")):
        return
    if not _gather_mm_runs_in(dtype):
        raise ValueError(
            f"model {name!r} has mixture-of-experts layers, which the {mx.default_device()} "
            f"device runs in float32 only, not {dtype}; build it without dtype, or use "
            "'tiny-qwen3_5' / 'medium-hybrid' (dense hybrids) for a low-precision hybrid"
        )


@functools.cache
def _gather_mm_probe(dtype: mx.Dtype, device: str) -> bool:
    try:
        lhs = mx.ones((2, 1, 4), dtype=dtype)
        rhs = mx.ones((2, 4, 4), dtype=dtype)
        mx.eval(mx.gather_mm(lhs, rhs, rhs_indices=mx.array([[0], [1]])))
    except RuntimeError:
        return False
    return True


def _gather_mm_runs_in(dtype: mx.Dtype) -> bool:
    # Keyed by device too: the answer differs between the CPU and the GPU.
    return _gather_mm_probe(dtype, str(mx.default_device()))


def _vocab_size(config: Mapping[str, Any]) -> int:
    text_config = config.get("text_config") or {}
    return int(config.get("vocab_size") or text_config["vocab_size"])


def _has_tokenizer_files(model_path: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((model_path / name).is_file() for name in names)


def _plain_copy(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy with plain dicts in place of the read-only registry mappings."""
    return {
        key: _plain_copy(value) if isinstance(value, Mapping) else copy.deepcopy(value)
        for key, value in config.items()
    }
