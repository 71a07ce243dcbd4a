"""Bundles: one chain of blocks, its states and its namespace in a portable file, to
prewarm another machine's bank.

Layout (little-endian):

    magic "CASBUNDL" | version u32 | manifest_len u32 | manifest (JSON, UTF-8)
    | per block: header record, payload, state (the lengths are in the manifest)
    | per end record (version 2): its value (key and length in the manifest)
    | blake3 digest (32 bytes, bundle context) of every byte before it

Version 2 adds the end records (`index.ends`) under the chain's blocks and root; a
bundle without any is written as version 1, which older builds read.

The manifest names the block size, hash format, namespace root and its `ModelSpec`,
and per block its hash and record lengths. A bundle always holds a chain from its
first block (index 0), so an importer can recompute every chain hash from the root.

Import trusts nothing in the file: the whole-file digest, then every header (its
namespace, index, parent link and chain hash recomputed with `hash_block`), every
payload and state against its header's digest, every end record's name, parent and
payload digest. Only then is everything written, in
one batch: a damaged bundle imports nothing.


The package: `format` (the constants and the records a bundle holds), `export`
(choosing a chain, writing it), `load` (reading and checking one, importing it).
"""

from cas_bank.maintenance.bundle.export import chain_for_tokens, chain_to_leaf, export_chain
from cas_bank.maintenance.bundle.format import (
    BUNDLE_CONTEXT,
    BUNDLE_VERSION,
    MAGIC,
    Bundle,
    BundleEntry,
    ExportReport,
    ImportReport,
)
from cas_bank.maintenance.bundle.load import import_bundle, read_bundle

__all__ = [
    "BUNDLE_CONTEXT",
    "BUNDLE_VERSION",
    "MAGIC",
    "Bundle",
    "BundleEntry",
    "ExportReport",
    "ImportReport",
    "chain_for_tokens",
    "chain_to_leaf",
    "export_chain",
    "import_bundle",
    "read_bundle",
]
