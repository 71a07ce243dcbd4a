"""`cas-bank mlx-lm-server` with a fault planted in mlx-lm's generation loop (a test child).

    python tests/mlx_lm_faults.py mlx-lm-server --bank ... --model ...

Runs the real command (`cas_bank.tools.cli.main`) after one change to mlx-lm's server:
a request whose stop words include `FAULT` makes `ResponseGenerator._make_state_machine`
raise (on mlx-lm's batched path that call is outside any `try`, as mlx-lm 0.32's own
stop-word tokenizing was, which ended the thread); one with `BREAK` does that and makes
every later `ModelProvider.load_default` raise too, so the loop cannot start again.
The edge checks refuse every request known to do this; the fault stands for the
next one nobody foresaw. mlx-lm, the model and the bank are otherwise real.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

import mlx_lm.server as mls

FAULT = "plant-a-fault-in-the-loop"
BREAK = "plant-a-fault-and-break-the-model"

_broken: list[bool] = []
_make_state_machine: Any = mls.ResponseGenerator._make_state_machine
_load_default: Any = mls.ModelProvider.load_default


def _faulty_state_machine(self: Any, model_key: Any, tokenizer: Any, stop_words: Any) -> Any:
    if BREAK in stop_words:
        _broken.append(True)
    if FAULT in stop_words or BREAK in stop_words:
        raise RuntimeError("a planted fault in mlx-lm's generation loop")
    return _make_state_machine(self, model_key, tokenizer, stop_words)


def _faulty_load_default(self: Any) -> Any:
    if _broken:
        raise RuntimeError("a planted fault: the model cannot be loaded again")
    return _load_default(self)


if __name__ == "__main__":
    mls.ResponseGenerator._make_state_machine = _faulty_state_machine  # type: ignore[method-assign]
    mls.ModelProvider.load_default = _faulty_load_default  # type: ignore[method-assign]
    sys.argv = ["cas-bank", *sys.argv[1:]]
    runpy.run_module("cas_bank.tools.cli", run_name="__main__")  # exits with its status
