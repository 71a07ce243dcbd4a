from typing import Any

from typing_extensions import Buffer

def chain(root: bytes, data: Buffer, step: int, context: str, /) -> list[bytes]: ...
def max_id(ids: Buffer, /) -> int: ...
def prefixes(
    root: bytes, data: Buffer, step: int, context: str | None, block: int = 0, /
) -> list[bytes]: ...
def set_header_type(cls: type, /) -> None: ...
def header(chain_hash: bytes, raw: Buffer, /) -> Any: ...
def run(
    record: Buffer,
    offset: int,
    first: int,
    count: int,
    root: bytes,
    hashes: Any,
    tokens: Buffer,
    step: int,
    /,
) -> list[Any]: ...
def prefix_run(
    record: Buffer, offset: int, first: int, count: int, root: bytes, tokens: Buffer, step: int, /
) -> list[Any]: ...
