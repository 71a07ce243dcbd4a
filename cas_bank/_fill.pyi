def read_into(
    path: str, head: bytes, lead: int, segments: bytes, index: int, context: str, /
) -> tuple[int, int]: ...
def read_many(
    paths: tuple[bytes, ...],
    heads: tuple[bytes, ...],
    indices: bytes,
    lead: int,
    segments: tuple[bytes, ...],
    context: str,
    counter: object,
    codes: object,
    /,
) -> None: ...
