"""The Responses API's stored responses (`store`, `previous_response_id`, GET /v1/responses/{id}): the
most recent ones, in this process's memory only, so a restart or another replica forgets them. Each
keeps its body and the whole conversation up to and including its output, as chat messages; a request
that continues it renders that conversation again, and the prefix cache finds its tokens cached."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024    # responses kept; the oldest goes first


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]   # chat messages, instructions left out (they are not carried over)


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"a response store holds at least one response; got capacity {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
