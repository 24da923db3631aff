"""A draft proposes token ids for its target, so both must spell every id the same way."""
from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointError


def id_to_token(tokenizer_dir: Path) -> dict[int, str]:
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()   # with added tokens
    return {i: t for t, i in vocab.items()}


def first_difference(target: dict[int, str], draft: dict[int, str]) -> int | None:
    """The smallest id the two tokenizers map differently (or only one of them maps), else None."""
    differing = (i for i in sorted(target.keys() | draft.keys()) if target.get(i) != draft.get(i))
    return next(differing, None)


def check_same_tokenizer(target_dir: Path, draft_dir: Path, draft_vocab_size: int) -> None:
    """Both spell every id alike, and the draft has a row for each id its tokenizer names (it may lack
    only the rows a target pads its vocabulary with)."""
    target, draft = id_to_token(target_dir), id_to_token(draft_dir)
    if (named := max(draft, default=-1) + 1) > draft_vocab_size:
        raise CheckpointError(
            f"the draft ({draft_dir}) has {draft_vocab_size:,} vocabulary rows but its tokenizer names {named:,} "
            f"ids: it could neither read nor propose the rest. Use the draft's own unmodified checkpoint.")
    i = first_difference(target, draft)
    if i is not None:
        raise CheckpointError(
            f"the draft's tokenizer ({draft_dir}) differs from the target's: token id {i} is "
            f"{target.get(i, '(absent)')!r} in the target but {draft.get(i, '(absent)')!r} in the draft. "
            f"A draft must share the target's tokenizer (e.g. Llama-3.2-1B for Llama-3.1-8B).")
