"""cas_bank: a content-addressed prefix-cache store for LLM inference on MLX.

KV caches are cut into fixed token blocks, each named by a blake3 hash of its whole
token prefix and kept once in RocksDB; a restore hands back the longest stored prefix
as MLX arrays.
"""

from cas_bank._version import __version__
from cas_bank.bank import Bank
from cas_bank.blocks.hashing import BlockHash
from cas_bank.config import BankConfig
from cas_bank.errors import (
    BankDamagedError,
    BankFullError,
    BankLockedError,
    BankSettingsError,
    CasBankError,
    CorruptDataError,
    InvalidInputError,
    NotABankError,
)
from cas_bank.namespace import Namespace
from cas_bank.restore.restoring import Hit
from cas_bank.spec import ArraySpec, LayerSpec, ModelSpec
from cas_bank.stats import BankStats, RestoreTimings, RestoreTotals
from cas_bank.write.storing import StoreReport

__all__ = [
    "ArraySpec",
    "Bank",
    "BankConfig",
    "BankDamagedError",
    "BankFullError",
    "BankLockedError",
    "BankSettingsError",
    "BankStats",
    "BlockHash",
    "CasBankError",
    "CorruptDataError",
    "Hit",
    "InvalidInputError",
    "LayerSpec",
    "ModelSpec",
    "Namespace",
    "NotABankError",
    "RestoreTimings",
    "RestoreTotals",
    "StoreReport",
    "__version__",
]
