"""RequestVocab: which ids of a sequence's own text get rows of the draft's head, and which row."""
from __future__ import annotations

from bie_trt.spec_decode.request_vocab import RequestVocab


def test_ids_outside_the_static_set_take_rows_in_first_seen_order():
    v = RequestVocab(3, frozenset(range(10)), 100)
    assert v.admit([1, 20, 21, 20, 5, 22]) == [(0, 20), (1, 21), (2, 22)]
    assert v.ids == [20, 21, 22] and v.seen == 6
    assert v.admit([3, 21, 22]) == [] and v.seen == 9      # nothing new: no row changes


def test_past_capacity_the_least_recently_seen_gives_its_row():
    v = RequestVocab(3, frozenset(range(10)), 100)
    v.admit([20, 21, 22, 20])                               # recency now: 21, 22, 20
    assert v.admit([23]) == [(1, 23)] and v.ids == [20, 23, 22]
    assert v.admit([24]) == [(2, 24)] and v.ids == [20, 23, 24]   # 22 was the oldest then


def test_more_new_ids_than_rows_in_one_call_keeps_the_last_ones():
    v = RequestVocab(3, frozenset(), 200)
    writes = v.admit(range(100, 110))
    assert sorted(v.ids) == [107, 108, 109] and len(v.ids) == 3
    assert writes == sorted((row, i) for row, i in enumerate(v.ids))   # each row written once, with its final id


def test_ids_past_the_drafts_vocabulary_take_no_row():
    """A target padded past its draft's vocabulary (Qwen2.5-7B over its 0.5B) may see such ids; the
    draft's head has no row for them."""
    v = RequestVocab(3, frozenset(range(10)), 100)
    assert v.admit([99, 100, 150, 98]) == [(0, 99), (1, 98)] and v.seen == 4


def test_no_rows_admits_nothing():
    v = RequestVocab(0, frozenset(), 100)
    assert v.admit([5, 6]) == [] and v.ids == [] and v.seen == 2
