"""The blocks stores have offered in this process, for `BankConfig.admit="second_use"`.

A bounded set of chain hashes, oldest forgotten first: a block offered once and never
again is not worth an SSD write; one offered twice (the next turn of a conversation,
a second agent on a shared prefix) is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_LIMIT = 1 << 20  # chain hashes remembered (~100 MB at most with the dict's overhead)


class SeenBlocks:
    """At most `limit` chain hashes, least recently offered first out."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def update(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._seen[bytes(k)] = None
                self._seen.move_to_end(bytes(k))
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
