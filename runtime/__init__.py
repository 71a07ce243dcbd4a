"""cas_bank's MLX runtime: mlx-lm models and their prompt caches in and out of a bank.

`PrefixCache` is the integration (restore before prefill, store after); the models
module builds the embedded tiny models and loads local mlx-lm directories.
"""

from cas_bank.runtime.model_spec import spec_for_model
from cas_bank.runtime.models import LoadedModel, build_model, load_model, save_model
from cas_bank.runtime.prefix_cache import PrefillReport, PrefixCache
from cas_bank.runtime.state_recorder import StateRecorder

__all__ = [
    "LoadedModel",
    "PrefillReport",
    "PrefixCache",
    "StateRecorder",
    "build_model",
    "load_model",
    "save_model",
    "spec_for_model",
]
