"""Chain hashing, format v1 (docs/design.md, "Hashing (format v1)").

Block i of a token sequence is named `H(name of block i-1, tokens of block i)`; block
0's parent is the namespace root. H is blake3 in derive-key mode with a fixed,
versioned context, over the parent's 32 bytes then the tokens as little-endian uint32.
These names are persistent keys: a change here is a format version bump, and the
golden vectors in tests/test_hashing.py must fail first.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any, Literal, NewType

import blake3
import numpy as np
import xxhash

from cas_bank.errors import InvalidInputError
from cas_bank.native import chain_module

# The C helper built with the package (setup.py); absent (no compiler at install, or
# CAS_BANK_PURE_PYTHON=1): the Python loop, same values (cas_bank.native says which).
_native_chain: Callable[[bytes, bytes | np.ndarray, int, str], list[bytes]] | None = (
    chain_module.chain if chain_module is not None else None
)

BlockHash = NewType("BlockHash", bytes)
"""The 32-byte name of a block: a digest of its whole token prefix."""

HASH_FORMAT_VERSION = 1
DIGEST_SIZE = 32

BLOCK_CONTEXT = "cas_bank 2026-11-29 block chain v1"
ROOT_CONTEXT = "cas_bank 2026-11-29 namespace root v1"
SPEC_CONTEXT = "cas_bank 2026-11-29 model spec v1"
PAYLOAD_CONTEXT = "cas_bank 2026-11-29 payload v1"
END_CONTEXT = "cas_bank 2026-12-01 prompt end v1"

_MAX_TOKEN = (1 << 32) - 1
_TOKEN_DTYPE = np.dtype("<u4")


def as_token_array(tokens: Any) -> np.ndarray:
    """`tokens` as a 1-D little-endian uint32 array, or a clear `InvalidInputError`.

    Accepts a sequence of ints, a numpy array or an MLX array of integers (a leading
    batch axis of 1 is allowed). Rejects floats, bools, negatives and ids >= 2**32.
    An array that is one already (a restore passes its tokens down three calls) comes
    back as it is: every uint32 is an id in range.
    """
    if type(tokens) is np.ndarray and tokens.dtype == _TOKEN_DTYPE and tokens.ndim == 1:
        return tokens
    if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray):
        try:
            tokens = np.asarray(tokens)  # an MLX array (zero-copy)
        except (ValueError, TypeError):  # a dtype numpy has not (bfloat16)
            raise InvalidInputError(
                f"token ids must be integers; got {getattr(tokens, 'dtype', type(tokens))}"
            ) from None
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, (str, bytes)):
            raise InvalidInputError("tokens must be a sequence of int ids, not a string")
        try:
            seq = tokens if isinstance(tokens, list) else list(tokens)
        except TypeError:
            raise InvalidInputError(
                f"tokens must be a sequence of int ids, got {type(tokens).__name__}"
            ) from None
        try:  # C-speed conversion; it refuses floats, strings, negatives and ids >= 2**32
            arr = np.frombuffer(array.array("I", seq), dtype=np.uint32)
        except (TypeError, OverflowError):
            _explain_bad_tokens(seq)
            raise
        # Only bools pass (as 0 and 1): look at element types only when those appear.
        if (arr <= 1).any() and not all(map(_is_int_type, set(map(type, seq)))):
            _explain_bad_tokens(seq)
        return arr  # in range: array("I") checked every id
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidInputError(f"tokens must be 1-D (or [1, T]); got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must be integers; got dtype {arr.dtype}")
    if arr.size and _out_of_range(arr):
        bad = int(arr[(arr < 0) | (arr > _MAX_TOKEN)][0])
        raise InvalidInputError(f"token id {bad} is outside [0, 2**32)")
    return arr.astype("<u4", copy=False)


def _out_of_range(arr: np.ndarray) -> bool:
    """Whether an integer array holds an id outside [0, 2**32), in one reduction where
    one will do (a restore's tokens are checked on every request)."""
    if arr.dtype.kind == "u":
        return arr.itemsize > 4 and int(arr.max()) > _MAX_TOKEN
    if arr.itemsize == 8:  # seen as unsigned, a negative id is above the range too
        return int(arr.view(np.uint64).max()) > _MAX_TOKEN
    return int(arr.min()) < 0  # a signed id of 4 bytes or fewer is below 2**32


def _explain_bad_tokens(seq: list[Any]) -> None:
    """Raise the `InvalidInputError` naming the first bad token of `seq`."""
    for t in seq:
        if not _is_int_type(type(t)):
            raise InvalidInputError(f"token ids must be ints; got {type(t).__name__} {t!r}")
        if t < 0 or t > _MAX_TOKEN:
            raise InvalidInputError(f"token id {t} is outside [0, 2**32)")


def _is_int_type(t: type) -> bool:
    return t is not bool and t is not np.bool_ and issubclass(t, (int, np.integer))


def hash_block(parent: bytes, block_tokens: np.ndarray | bytes) -> BlockHash:
    """The chain hash of one block: a pure function of its parent's name and its tokens."""
    data = block_tokens if isinstance(block_tokens, bytes) else block_tokens.astype("<u4").tobytes()
    h = blake3.blake3(derive_key_context=BLOCK_CONTEXT)
    h.update(parent)
    h.update(data)
    return BlockHash(h.digest())


def end_hash(parent: bytes, tail_tokens: np.ndarray | bytes) -> BlockHash:
    """The name of an end record: a whole prompt, as the chain hash of its last full
    block (or the namespace root) and the 0..block_size-1 tokens after it.

    Its own derive-key context: an end hash never equals a block hash (docs/design.md,
    "End records")."""
    h = blake3.blake3(derive_key_context=END_CONTEXT)
    h.update(parent)
    h.update(tail_tokens if isinstance(tail_tokens, bytes) else tail_tokens.astype("<u4").tobytes())
    return BlockHash(h.digest())


def end_hashes(parent: bytes, tail_tokens: bytes) -> list[BlockHash]:
    """`end_hash(parent, tail_tokens[:4 * t])` for t = 0..len(tail_tokens) // 4, in one
    incremental pass (a restore's lookup names all its candidates)."""
    h = blake3.blake3(derive_key_context=END_CONTEXT)
    h.update(parent)
    out = [BlockHash(h.digest())]
    for at in range(0, len(tail_tokens), 4):
        h.update(tail_tokens[at : at + 4])
        out.append(BlockHash(h.digest()))
    return out


_native_max_id: Callable[[Any], int] | None = (
    chain_module.max_id if chain_module is not None else None
)


def max_token(tokens: np.ndarray) -> int:
    """The largest id of a token array from `as_token_array` (0 if empty): one short
    native loop where the helper is built (numpy's reduction cost a cold restore's
    vocabulary check ~50 us at 1k tokens)."""
    if _native_max_id is not None:
        return _native_max_id(tokens)
    return int(tokens.max()) if tokens.size else 0


def chain_hashes(root: bytes, tokens: Any, block_size: int) -> list[BlockHash]:
    """Names of every full block of `tokens`, in order (the partial tail has none)."""
    arr = as_token_array(tokens)
    n = len(arr) // block_size
    if _native_chain is not None:
        # One call for the whole prompt (cas_bank/_native/chain.c, the official BLAKE3
        # C code): the Python loop below is most of a long lookup's time. It reads the
        # array's own bytes: a copy first cost a reopened 16k-token lookup ~15 us.
        data = np.ascontiguousarray(arr[: n * block_size])
        return _native_chain(root, data, block_size * 4, BLOCK_CONTEXT)  # type: ignore[return-value]
    return chain_hashes_python(root, arr[: n * block_size].tobytes(), block_size)


def chain_hashes_python(root: bytes, data: bytes, block_size: int) -> list[BlockHash]:
    """`chain_hashes` over little-endian uint32 token bytes, with the blake3 package."""
    step = block_size * 4
    out: list[BlockHash] = []
    parent = root
    hasher = blake3.blake3
    view = memoryview(data)
    for i in range(0, len(data) - len(data) % step, step):
        h = hasher(parent, derive_key_context=BLOCK_CONTEXT)
        h.update(view[i : i + step])
        parent = h.digest()
        out.append(BlockHash(parent))
    return out


def namespace_root(spec_fingerprint: str, block_size: int, salt: bytes = b"") -> bytes:
    """The root of a namespace: model identity, layout and block size, format v1, and a
    tenant's salt (none by default: the unsalted root is unchanged by it)."""
    h = blake3.blake3(derive_key_context=ROOT_CONTEXT)
    h.update(bytes.fromhex(spec_fingerprint))
    h.update(block_size.to_bytes(4, "little"))
    h.update(HASH_FORMAT_VERSION.to_bytes(4, "little"))
    if salt:
        h.update(b"salt")
        h.update(len(salt).to_bytes(8, "little"))
        h.update(salt)
    return h.digest()


def salt_bytes(salt: str | bytes | None) -> bytes:
    """A tenant salt as bytes (text as UTF-8); None and empty mean no salt.

    Text that is not Unicode (a lone UTF-16 surrogate, as JSON's "\\ud800" decodes to)
    has no UTF-8 form: an `InvalidInputError` says so, never a `UnicodeEncodeError`.
    """
    if salt is None:
        return b""
    if isinstance(salt, str):
        try:
            return salt.encode()
        except UnicodeEncodeError as e:
            raise InvalidInputError(
                f"a salt must be Unicode text; this one holds a lone surrogate "
                f"({salt[e.start]!a}) at character {e.start}"
            ) from None
    if isinstance(salt, (bytes, bytearray)):
        return bytes(salt)
    raise TypeError(f"a salt is a str or bytes, got {type(salt).__name__}")


_THREADED_FROM = 1 << 20  # blake3's own threads pay off from about 1 MiB per update


def digest(*parts: bytes | bytearray | memoryview, context: str = PAYLOAD_CONTEXT) -> bytes:
    """blake3 of the parts in order (the same digest however many threads compute it).

    A part of 1 MiB or more is hashed on blake3's thread pool: a restore verifies
    every payload it reads, and that check is a large share of its time.
    """
    big = any(len(p) >= _THREADED_FROM for p in parts)
    h = blake3.blake3(derive_key_context=context, max_threads=blake3.blake3.AUTO if big else 1)
    for p in parts:
        h.update(p)
    return h.digest()


Check = Literal["xxh3", "blake3"]
"""The kind of a payload's local check (docs/design.md, "Payload codec")."""

XXH3_TAG = b"cas_bank xxh3128"
"""The last 16 bytes of a 32-byte payload digest field that holds an XXH3-128 check:
the field says which check it carries (a blake3 digest ends so with odds 2**-128)."""


def check_of(field: bytes) -> Check:
    """Which check a 32-byte digest field carries."""
    return "xxh3" if field[16:] == XXH3_TAG else "blake3"


def payload_check(*parts: bytes | bytearray | memoryview, check: Check) -> bytes:
    """The 32-byte digest field of a payload's parts: blake3 (`digest`, the payload
    context), or XXH3-128 (seed 0, canonical big-endian) followed by `XXH3_TAG`."""
    if check == "blake3":
        return digest(*parts)
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p)
    return h.digest() + XXH3_TAG


def short(h: bytes, n: int = 12) -> str:
    return h.hex()[:n]
