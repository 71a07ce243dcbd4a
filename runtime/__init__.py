"""cas_bank's MLX runtime: mlx-lm models and their prompt caches in and out of a bank.

`PrefixCache` is the integration (restore before prefill, store after); the models
module builds the embedded tiny models and loads local mlx-lm directories.

The names below are imported on first use: `cas_bank.runtime.tokenizer` (what the
inspection tools need to decode a block's text) then loads without mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .draft_cache import DraftPrefixCache
    from .model_spec import spec_for_model
    from .models import LoadedModel, build_model, load_model, save_model
    from .prefill import PrefillCancelled, PrefillReport
    from .prefix_cache import PrefixCache
    from .prompt_cache_adapter import BankPromptCache
    from .state_recorder import StateRecorder

_HOMES = {
    "BankPromptCache": "prompt_cache_adapter",
    "DraftPrefixCache": "draft_cache",
    "spec_for_model": "model_spec",
    "LoadedModel": "models",
    "build_model": "models",
    "load_model": "models",
    "save_model": "models",
    "PrefillCancelled": "prefill",
    "PrefillReport": "prefill",
    "PrefixCache": "prefix_cache",
    "StateRecorder": "state_recorder",
}

__all__ = [
    "BankPromptCache",
    "DraftPrefixCache",
    "LoadedModel",
    "PrefillCancelled",
    "PrefillReport",
    "PrefixCache",
    "StateRecorder",
    "build_model",
    "load_model",
    "save_model",
    "spec_for_model",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
