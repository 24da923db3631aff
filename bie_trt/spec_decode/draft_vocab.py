"""The draft's reduced vocabulary: the K token ids its head may propose, chosen at build time.

Frequency comes from the tokenizer itself, offline: a BPE tokenizer learns its merges greedily,
the most frequent pair of its (large) training corpus first, so a token's merge rank is its
frequency rank there. Tokens no merge produces (the base alphabet, single bytes) rank first:
every text can be spelt with them. A Unigram tokenizer stores each piece's log-probability,
which orders it directly; any other kind falls back to id order (vocabularies are usually
built in frequency order). Added tokens (end-of-sequence, chat markers) are always kept.
"""
from __future__ import annotations

import json
from pathlib import Path

RANKING = "bpe merge rank (unigram score); added tokens always"


def _merge_pair(merge: str | list[str]) -> tuple[str, str]:
    # tokenizer.json spells a merge "a b" (tokenizers < 0.20) or ["a", "b"].
    a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
    return a, b


def frequency_order(tokenizer_json: dict) -> list[int]:
    """Every id of the tokenizer's model, most frequent first (added tokens not included)."""
    model = tokenizer_json.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        vocab: dict[str, int] = model["vocab"]
        merges = [_merge_pair(m) for m in model.get("merges", [])]
        rank = {a + b: i for i, (a, b) in reversed(list(enumerate(merges)))}   # the first merge making it
        return [i for _, i in sorted((rank.get(t, -1), i) for t, i in vocab.items())]
    if kind == "Unigram":
        pieces = model["vocab"]   # [[piece, log-probability], ...], the id is the index
        return sorted(range(len(pieces)), key=lambda i: (-pieces[i][1], i))
    vocab = model.get("vocab") or {}
    return sorted(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))


def reduced_vocabulary(tokenizer_dir: Path, vocab_size: int, k: int) -> list[int]:
    """The K ids the draft may propose, ascending: added tokens, then the most frequent, all below
    the model's vocab_size. Every id when K >= vocab_size."""
    if k >= vocab_size:
        return list(range(vocab_size))
    path = Path(tokenizer_dir) / "tokenizer.json"
    tok = json.loads(path.read_text()) if path.exists() else {}
    added = [a["id"] for a in tok.get("added_tokens", [])]
    order = frequency_order(tok) if tok else list(range(vocab_size))   # sentencepiece only: id order
    chosen: dict[int, None] = {}
    for i in [*added, *order, *range(vocab_size)]:   # range: ids the tokenizer does not name
        if len(chosen) == k:
            break
        if 0 <= i < vocab_size:
            chosen.setdefault(i)
    return sorted(chosen)
