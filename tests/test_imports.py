"""The import rules `make lint` checks (scripts/check_imports.py): the repository
meets them, and the checker finds a cycle and a layer broken in a package made up
for it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from conftest import REPO_ROOT


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_imports", REPO_ROOT / "scripts" / "check_imports.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_repository_has_no_cycle_and_keeps_its_layers() -> None:
    assert checker().violations(REPO_ROOT) == []


def test_a_cycle_and_an_index_importing_the_bank_are_found(tmp_path: Path) -> None:
    files = {
        "cas_bank/__init__.py": "from cas_bank.bank import Bank\n",
        "cas_bank/bank.py": "from cas_bank.namespace import Namespace\n",
        "cas_bank/namespace.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .bank import Bank\n"
        ),
        "cas_bank/index/__init__.py": "",
        "cas_bank/evict/eviction.py": "def f():\n    from cas_bank import bank\n",
        "cas_bank/blocks/__init__.py": "",
        "cas_bank/blocks/store.py": "from cas_bank.evict import eviction\n",
        "runtime/__init__.py": "",
        "tools/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert checker().violations(tmp_path) == [
        "import cycle among: cas_bank.bank, cas_bank.namespace",
        "cas_bank.blocks.store imports cas_bank.evict.eviction: "
        "a lower layer must not import a higher one",
        "cas_bank.evict.eviction imports cas_bank.bank: a lower layer must not import a higher one",
    ]
