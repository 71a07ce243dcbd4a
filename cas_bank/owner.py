"""What the code under the API needs of the bank that owns it, as protocols.

`Bank` meets both; nothing here imports it. Eviction needs a `Writer` (the store, the
last uses, transactions); a `Namespace` needs an `Owner` (that, and the settings, the
hot and file tiers, the counters and suspect marks its reads record, the leases, the
background writer, the admission memory, the shared tier and the restores' resources).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from threading import RLock
from typing import Protocol

from cas_bank.blocks.files import FileTier
from cas_bank.blocks.hashing import Check
from cas_bank.blocks.hot import HotStore
from cas_bank.blocks.store import BlockStore
from cas_bank.config import BankConfig
from cas_bank.evict.access import AccessLog
from cas_bank.index.continuation import ChainTier
from cas_bank.index.lease import Leases
from cas_bank.restore.resources import Resources
from cas_bank.stats import Counters, RestoreClock
from cas_bank.write.admission import SeenBlocks
from cas_bank.write.txn import Suspects, Transaction
from cas_bank.write.writer import BackgroundWriter


class Writer(Protocol):
    """A store, its last uses, and the transactions that change it."""

    @property
    def store(self) -> BlockStore: ...

    @property
    def access(self) -> AccessLog: ...

    def transaction(self, *, budget: bool = True) -> AbstractContextManager[Transaction]: ...


class Owner(Writer, Protocol):
    """A `Writer` with its settings, hot tier, counters and suspect marks."""

    @property
    def path(self) -> Path: ...

    @property
    def write_lock(self) -> RLock: ...

    @property
    def config(self) -> BankConfig: ...

    @property
    def read_only(self) -> bool: ...

    @property
    def payload_check(self) -> Check: ...

    @property
    def hot(self) -> HotStore | None: ...

    @property
    def counters(self) -> Counters: ...

    @property
    def suspects(self) -> Suspects: ...

    @property
    def remote(self) -> ChainTier | None: ...

    @property
    def files(self) -> FileTier | None: ...

    @property
    def leases(self) -> Leases | None: ...

    @property
    def writer(self) -> BackgroundWriter | None: ...

    @property
    def seen(self) -> SeenBlocks: ...

    @property
    def restore_clock(self) -> RestoreClock: ...

    @property
    def resources(self) -> Resources: ...

    def flush(self, *, wait: bool = True) -> None: ...
