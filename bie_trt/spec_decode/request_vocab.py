"""The draft's per-request vocabulary: the ids of a request's own text that its static head lacks.

A document repeats its own rare words (names, identifiers, jargon) more than anything, and a
token outside the draft's head can never be proposed. So each sequence also gets up to R rows of
the draft's full head, one per distinct id of its prompt and output outside the static ids, in
first-seen order. When more than R such ids have appeared, the least recently seen one gives its
row to the newcomer: the R most recently seen stay. Rows only change when a new id arrives.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable


class RequestVocab:
    """Which id each of a sequence's R extra head rows holds (`ids[row]`)."""

    def __init__(self, capacity: int, static: Collection[int], vocab_size: int) -> None:
        self.capacity = capacity
        self.static = static
        self.vocab_size = vocab_size   # the draft's: a target id past it has no row to hold
        self.ids: list[int] = []
        self._row: OrderedDict[int, int] = OrderedDict()   # id -> row, least recently seen first
        self.seen = 0   # the sequence's tokens admitted so far

    def admit(self, tokens: Iterable[int]) -> list[tuple[int, int]]:
        """Note `tokens` (the sequence's next ones, in order) as seen; returns the (row, id) pairs
        whose head rows must be filled, ascending by row."""
        writes: dict[int, int] = {}
        for t in tokens:
            self.seen += 1
            if t in self.static or t >= self.vocab_size or self.capacity == 0:
                continue
            if t in self._row:
                self._row.move_to_end(t)
                continue
            if len(self.ids) < self.capacity:
                row = len(self.ids)
                self.ids.append(t)
            else:
                _, row = self._row.popitem(last=False)
                self.ids[row] = t
            self._row[t] = row
            writes[row] = t
        return sorted(writes.items())
