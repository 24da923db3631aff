"""`bie-trt build --draft-checkpoint`: draft/ in the engine, its digests, the reduced vocabulary,
and the refusals (another tokenizer, another vocabulary) before any heavy work."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.cli import main
from bie_trt.config import ModelConfig
from bie_trt.engine_format import sha256_file, verify_engine
from bie_trt.errors import BieError, CheckpointError, PlanError
from bie_trt.spec_decode.draft_vocab import frequency_order, reduced_vocabulary
from tiny_model import write_tiny_hf

K = 4096   # tiny_draft_engine's (conftest.py)


@pytest.fixture(scope="module")
def engine(tiny_draft_engine):
    return tiny_draft_engine


def test_draft_dir_is_in_the_manifest_digests(engine, tiny_draft):
    manifest = json.loads((engine / "manifest.json").read_text())
    for name in ("draft/weights.safetensors", "draft/vocab.json", "draft/head.safetensors"):
        assert manifest["files"][name] == sha256_file(engine / name)
    d = manifest["draft"]
    assert d["vocab_size"] == K and d["window"] == 64 and d["sink_tokens"] == 8 and d["request_vocab"] == 4096
    assert ModelConfig.from_dict(d["config"]) == Checkpoint(tiny_draft).model
    assert d["source"]["weight_group_size"] == 32
    assert verify_engine(engine).ok
    (engine / "draft" / "vocab.json").write_bytes((engine / "draft" / "vocab.json").read_bytes() + b" ")
    try:
        report = verify_engine(engine)
        assert not report.ok and any("draft/vocab.json" in p for p in report.problems)
    finally:
        (engine / "draft" / "vocab.json").write_bytes((engine / "draft" / "vocab.json").read_bytes()[:-1])
    out = CliRunner().invoke(main, ["inspect", str(engine)])
    assert out.exit_code == 0 and f"head over {K:,} of 49,152 token ids" in out.output


def test_draft_head_holds_exactly_the_chosen_rows(engine, tiny_draft, smollm2_checkpoint):
    """The cpu profile keeps heads fp16: the stored head is exactly the chosen rows of the draft's."""
    ids = json.loads((engine / "draft" / "vocab.json").read_text())["ids"]
    assert ids == reduced_vocabulary(smollm2_checkpoint, 49152, K) and len(ids) == K
    w = load_file(str(engine / "draft" / "weights.safetensors"))
    head = Checkpoint(tiny_draft).tensor("lm_head.weight")
    assert torch.equal(w["lm_head"], head[torch.tensor(ids)].half())
    assert w["embed_tokens"].shape == (49152, 64) and "kv.key_mean" not in w
    # every row of the head, for the ids a request brings (all of them: tied heads too)
    assert torch.equal(load_file(str(engine / "draft" / "head.safetensors"))["lm_head"], head.half())


def _swap_two_tokens(src, dst, a: int, b: int):
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    ta, tb = (next(t for t, i in vocab.items() if i == x) for x in (a, b))
    vocab[ta], vocab[tb] = b, a
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return ta, tb


def test_a_draft_with_another_tokenizer_is_refused_naming_the_id(tmp_path, smollm2_checkpoint, tiny_draft):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_draft, other)
    ta, _ = _swap_two_tokens(tiny_draft, other, 300, 301)
    out = tmp_path / "engine"
    with pytest.raises(CheckpointError, match=r"token id 300 is .* in the target but .* in the draft") as e:
        build_engine(BuildOptions(checkpoint=str(smollm2_checkpoint), out=str(out), profile="cpu",
                                  draft_checkpoint=str(other)), log=lambda m: None)
    assert repr(ta) in str(e.value)
    assert not out.exists()   # refused before anything was written


@pytest.mark.parametrize("rows, refusal", [(32768, "has 32,768 vocabulary rows but its tokenizer names 49,152"),
                                           (49153, "vocab_size 49,153 is larger than the target's 49,152")])
def test_a_draft_with_another_vocabulary_is_refused(tmp_path, smollm2_checkpoint, rows, refusal):
    small = quantize_checkpoint(write_tiny_hf(tmp_path / "hf", smollm2_checkpoint, vocab_size=rows),
                                tmp_path / "awq", group_size=32)
    with pytest.raises(BieError, match=refusal):
        build_engine(BuildOptions(checkpoint=str(smollm2_checkpoint), out=str(tmp_path / "e"), profile="cpu",
                                  draft_checkpoint=str(small)), log=lambda m: None)


def test_frequency_order_bpe_unigram_and_added_tokens(tmp_path):
    bpe = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "bc": 5},
                     "merges": ["b c", "a b", ["ab", "c"]]},
           "added_tokens": [{"id": 6, "content": "<eos>"}]}
    # base alphabet first (by id), then by merge rank: bc (first merge), ab, abc.
    assert frequency_order(bpe) == [0, 1, 2, 5, 3, 4]
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe))
    assert reduced_vocabulary(tmp_path, 7, 3) == [0, 1, 6]          # the added token always kept
    assert reduced_vocabulary(tmp_path, 7, 5) == [0, 1, 2, 5, 6]
    assert reduced_vocabulary(tmp_path, 7, 7) == list(range(7))
    unigram = {"model": {"type": "Unigram", "vocab": [["x", -3.0], ["y", -1.0], ["z", -2.0]]}}
    assert frequency_order(unigram) == [1, 2, 0]


def test_a_token_two_merges_make_ranks_by_the_first():
    """BPE may list several merges producing one token; the tokenizer applies the earliest, so that one
    is the token's frequency rank."""
    bpe = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "cc": 6},
                     "merges": ["b c", "a b", "ab c", "c c", "a bc"]}}
    assert frequency_order(bpe) == [0, 1, 2, 4, 3, 5, 6]    # abc (merge 2) before cc (merge 3)


def test_by_default_a_narrow_drafts_head_keeps_the_whole_vocabulary(build, tiny_draft):
    """The default head is the rows whose weights fit the byte budget: the tiny draft's 49,152 x 64 fp16 head
    fits whole, so the engine has no request rows and no host copy of the head to gather them from."""
    engine = build(checkpoint=str(tiny_draft), draft_checkpoint=str(tiny_draft))   # no --draft-vocab-size
    d = json.loads((engine / "manifest.json").read_text())["draft"]
    assert d["vocab_size"] == 49152 and d["request_vocab"] == 0
    assert json.loads((engine / "draft" / "vocab.json").read_text())["ids"] == list(range(49152))
    assert not (engine / "draft" / "head.safetensors").exists()
    assert load_file(str(engine / "draft" / "weights.safetensors"))["lm_head"].shape == (49152, 64)
