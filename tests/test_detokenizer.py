"""The incremental detokeniser gives exactly the text of one whole decode, streamed without take-backs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from bie_trt.executor.sequence import Detokenizer, Sequence
from bie_trt.sampling_params import SamplingParams

SAMPLE = "Naïve café: 日本語のテキスト 🙂🚀 — “quotes”, tabs\tand\nnew lines; x = f(1, 2) ≥ 3 ñ ü ß"


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


def stream(tokenizer, ids: list[int], stop: list[str], drop_last: bool = False) -> tuple[list[str], str, bool]:
    """Feed ids one at a time, as the engine loop does; -> (deltas, final seq.text, stop hit)."""
    seq = Sequence([1], SamplingParams(stop=stop), torch.Generator())
    detok, deltas = Detokenizer(tokenizer, stop), []
    for n, token in enumerate(ids, 1):
        seq.output_ids.append(token)
        final = n == len(ids)
        delta, hit = detok.update(seq, final=final, drop_last=final and drop_last)
        deltas.append(delta)
        # Streamed text is never taken back: what went out is a prefix of the whole decode so far.
        assert "".join(deltas) == seq.text[:len("".join(deltas))]
        if hit:
            return deltas, seq.text, True
    return deltas, seq.text, False


def token_lists(tokenizer):
    sample = tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    token = st.one_of(st.sampled_from(sample), st.integers(0, tokenizer.vocab_size - 1))
    return st.lists(token, min_size=1, max_size=40)


def test_streamed_text_equals_one_decode(tokenizer):
    @settings(max_examples=150, deadline=None)
    @given(token_lists(tokenizer))
    def check(ids):
        deltas, text, hit = stream(tokenizer, ids, [])
        assert not hit
        assert text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)

    check()


def test_multibyte_characters_are_held_until_complete(tokenizer):
    ids = tokenizer("🙂🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2   # byte-level pieces: the emoji arrive split across tokens
    deltas, text, _ = stream(tokenizer, ids, [])
    assert text == "🙂🚀" and "\ufffd" not in "".join(deltas)


def test_stop_strings_cut_at_the_first_hit(tokenizer):
    @settings(max_examples=100, deadline=None)
    @given(token_lists(tokenizer), st.data())
    def check(ids, data):
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if len(whole) < 3:
            return
        a = data.draw(st.integers(0, len(whole) - 2))
        stop = [whole[a:a + data.draw(st.integers(1, 3))], "\x00never"]
        deltas, text, hit = stream(tokenizer, ids, stop)
        assert hit and text == whole[:whole.find(stop[0])] == "".join(deltas)

    check()


def test_stop_token_text_is_dropped(tokenizer):
    ids = tokenizer(" one two three", add_special_tokens=False)["input_ids"]
    _, text, _ = stream(tokenizer, ids, [], drop_last=True)
    assert text == tokenizer.decode(ids[:-1])


def test_sentencepiece_spacing_needs_context():
    """Llama-2-style decoders drop the leading space of a decode's first piece: the new tokens must be
    decoded after context tokens, or words run together."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "▁The", "▁pass", "▁key", "▁is", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "."]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    sp = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sp.decode(ids) == "The pass key is🙂." and sp.decode([2]) == "pass"
    deltas, text, _ = stream(sp, ids, [])
    assert text == "".join(deltas) == "The pass key is🙂."


def test_two_stop_strings_in_one_token_cut_at_the_earlier(tokenizer):
    ids = tokenizer(" one two three", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[-1:]) == " three"      # both stop strings arrive with this one token
    for stop in ([" th", "ree"], ["ree", " th"]):       # the earlier in the text wins, not the first listed
        _, text, hit = stream(tokenizer, ids, stop)
        assert hit and text == " one two"
