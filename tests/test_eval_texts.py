"""`bie-trt eval` runs on a fresh clone: a built-in text by default, gensim's copy of the quality
tables' text by name, and a missing file says where to get it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.errors import BieError
from bie_trt.eval_texts import load_eval_text


@pytest.mark.slow
def test_eval_scores_the_builtin_text_without_a_text_option(smollm2_engine):
    r = CliRunner().invoke(main, ["eval", "--engine", str(smollm2_engine), "--context", "64", "--max-windows", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == 63 and 1 < out["fp16_ppl"] < 1000   # English the model can read, not noise


def test_the_python_docs_text_is_english_prose():
    text = load_eval_text("builtin:python-docs")
    assert len(text) > 100_000 and "The \"assert\" statement" in text


def test_builtin_lee_background_is_gensims_copy(lee_text, tmp_path, monkeypatch):
    data = tmp_path / "gensim" / "test" / "test_data"
    data.mkdir(parents=True)
    (tmp_path / "gensim" / "__init__.py").write_text("")
    (data / "lee_background.cor").write_bytes(lee_text.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gensim", raising=False)
    assert load_eval_text("builtin:lee-background") == lee_text.read_text()


def test_without_gensim_lee_background_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(BieError, match=r"pip install gensim==4\.4\.0"):
        load_eval_text("builtin:lee-background")


@pytest.mark.parametrize("source, fragments", [
    ("../nowhere/lee_background.txt", ["no such file", "pip install gensim==4.4.0", "The evaluation text"]),
    ("missing.txt", ["no such file", "builtin:python-docs, builtin:lee-background"]),
    ("builtin:wiki", ["no such built-in text", "builtin:python-docs, builtin:lee-background"]),
])
def test_a_text_that_is_not_there_says_what_is(source, fragments):
    with pytest.raises(BieError) as e:
        load_eval_text(source)
    for f in fragments:
        assert f in str(e.value)


def test_eval_tokenizes_as_the_engines_own_tokenizer(smollm2_engine, tmp_path):
    """Eval reads tokenizer.json with the `tokenizers` library where transformers would run it as written:
    the ids must be the ones the engine's tokenizer (transformers) gives a prompt, also where the file
    carries truncation and padding and where the config names special tokens the file does not list."""
    import shutil

    from tokenizers import Tokenizer

    from bie_trt.eval_texts import text_token_ids
    from bie_trt.model.synthetic import write_word_tokenizer
    from bie_trt.chat.tokenizer import load_tokenizer

    truncating = tmp_path / "truncating"
    truncating.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_engine) / name, truncating / name)
    saved = Tokenizer.from_file(str(truncating / "tokenizer.json"))
    saved.enable_truncation(8)
    saved.enable_padding(length=64)
    saved.save(str(truncating / "tokenizer.json"))
    text = load_eval_text("builtin:python-docs")[:20_000] + "\n\n  trailing  spaces, <|im_start|> <s> the </s> a "
    for tokenizer_dir in (smollm2_engine, truncating, write_word_tokenizer(tmp_path / "words")):
        expected = load_tokenizer(str(tokenizer_dir))(text)["input_ids"]
        assert text_token_ids(tokenizer_dir, text) == expected and len(expected) > 1000, tokenizer_dir


def test_only_plain_tokenizer_configs_skip_transformers():
    from bie_trt.eval_texts import tokenizer_json_as_written

    added = {"<s>", "</s>"}
    assert tokenizer_json_as_written({"tokenizer_class": "TokenizersBackend", "bos_token": "<s>"}, added)
    assert tokenizer_json_as_written({"tokenizer_class": "PreTrainedTokenizerFast"}, set())
    assert not tokenizer_json_as_written({"tokenizer_class": "LlamaTokenizerFast"}, added)
    assert not tokenizer_json_as_written({}, added)
    assert not tokenizer_json_as_written({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True}, added)
    assert not tokenizer_json_as_written({"tokenizer_class": "TokenizersBackend", "add_eos_token": False}, added)
    assert not tokenizer_json_as_written({"tokenizer_class": "TokenizersBackend", "unk_token": "<unk>"}, added)
    assert not tokenizer_json_as_written({"tokenizer_class": "TokenizersBackend", "bos_token": {"content": "<s>"}},
                                         added)
    assert not tokenizer_json_as_written({"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<x>"]},
                                         added)
