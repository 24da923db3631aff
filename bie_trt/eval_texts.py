"""Texts `bie-trt eval` scores: a UTF-8 file, or `builtin:NAME`, a text an installed package ships, so the
command runs on a fresh clone without downloading anything."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .errors import BieError

BUILTIN_PREFIX = "builtin:"
# name -> what it is (for --help and errors)
BUILTIN_TEXTS = {
    "python-docs": "the Python language reference's topics as Python itself ships them (pydoc_data.topics, "
                   "PSF licence): about 465 KB of English prose and examples, in every Python install",
    "lee-background": "the Lee background corpus, 300 ABC news articles, LGPL-2.1, from gensim's test data "
                      "(`pip install gensim==4.4.0`): the text of the README's quality tables",
}
LEE_RECIPE = ("`pip install gensim==4.4.0` and use --text builtin:lee-background, or follow the README's "
              "'The evaluation text' to recreate lee_background.txt")


def _python_docs() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def _lee_background() -> str:
    spec = importlib.util.find_spec("gensim")
    path = Path(spec.origin).parent / "test" / "test_data" / "lee_background.cor" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise BieError(f"builtin:lee-background needs gensim's test data, which is not installed; {LEE_RECIPE}.")
    return path.read_text(encoding="utf-8")


_LOADERS = {"python-docs": _python_docs, "lee-background": _lee_background}


def load_eval_text(source: str) -> str:
    """The text `source` names: `builtin:NAME` or a UTF-8 file path."""
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):]
        if name not in _LOADERS:
            raise BieError(f"--text {source}: no such built-in text; choose "
                           f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_TEXTS)}, or give a file.")
        return _LOADERS[name]()
    path = Path(source)
    if not path.is_file():
        hint = LEE_RECIPE if path.name == "lee_background.txt" else \
            f"give a UTF-8 text file or a built-in text ({', '.join(BUILTIN_PREFIX + n for n in BUILTIN_TEXTS)})"
        raise BieError(f"--text {source}: no such file; {hint}.")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BieError(f"{source}: not UTF-8 text (byte {e.start}); convert it, e.g. "
                       f"`iconv -t UTF-8 {source} > text.txt`.") from None


# Tokenizer classes transformers runs from tokenizer.json as written. Config keys that rebuild its
# post-processor or add tokens, and special tokens the file does not list, send a tokenizer through
# transformers itself.
_AS_WRITTEN = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_REBUILDS = ("add_bos_token", "add_eos_token", "added_tokens_decoder", "additional_special_tokens",
             "extra_special_tokens", "split_special_tokens")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def tokenizer_json_as_written(tokenizer_config: dict, added_tokens: set[str]) -> bool:
    """Whether transformers tokenizes with tokenizer.json unchanged under this tokenizer_config.json, given the
    file's added tokens: a class that runs the file as it is, no key that changes it, and every special token
    the config names already one of the file's added tokens."""
    specials = [tokenizer_config[k] for k in _SPECIAL if tokenizer_config.get(k) is not None]
    return (tokenizer_config.get("tokenizer_class") in _AS_WRITTEN
            and not any(k in tokenizer_config for k in _REBUILDS)
            and all(isinstance(t, str) and t in added_tokens for t in specials))


def text_token_ids(engine_dir: str | Path, text: str) -> list[int]:
    """The ids the engine's tokenizer gives `text`, special tokens included as for a prompt. Read with the
    `tokenizers` library when that is what transformers would run: importing transformers costs a
    one-window eval seconds."""
    engine_dir = Path(engine_dir)
    config_path, file = engine_dir / "tokenizer_config.json", engine_dir / "tokenizer.json"
    if config_path.is_file() and file.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(file))
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        if tokenizer_json_as_written(json.loads(config_path.read_text()), added):
            tokenizer.no_truncation()   # as transformers runs it for one text
            tokenizer.no_padding()
            return tokenizer.encode(text).ids
    from .chat.tokenizer import load_tokenizer

    return load_tokenizer(str(engine_dir))(text)["input_ids"]
