"""What a bundle file holds (the layout: the package docstring): its constants and the
records `export` writes and `load` reads back."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from cas_bank.index.chain import Header
from cas_bank.spec import ModelSpec

MAGIC = b"CASBUNDL"
BUNDLE_VERSION = 2
BUNDLE_CONTEXT = "cas_bank 2026-11-29 bundle v1"
_LEAD = struct.Struct("<8sII")
_TRAILER = 32


@dataclass(frozen=True, slots=True)
class BundleEntry:
    header: Header
    payload: bytes
    state: bytes | None


@dataclass(frozen=True, slots=True)
class Bundle:
    """A checked bundle: a chain from block 0, in order."""

    block_size: int
    root: bytes
    spec: ModelSpec
    entries: list[BundleEntry]
    ends: list[tuple[bytes, bytes]] = field(default_factory=list)  # end records (key, value)

    @property
    def tokens(self) -> int:
        return len(self.entries) * self.block_size


@dataclass(frozen=True, slots=True)
class ExportReport:
    path: Path
    namespace: str
    blocks: int
    states: int
    tokens: int
    file_bytes: int  # size of the bundle file
    leaf: bytes
    ends: int = 0


@dataclass(frozen=True, slots=True)
class ImportReport:
    namespace: str
    blocks: int
    blocks_written: int
    blocks_existing: int
    states_written: int
    bytes_written: int
    leaf: bytes
    ends_written: int = 0
