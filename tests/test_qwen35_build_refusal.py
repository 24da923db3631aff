"""Until the engine path exists end to end, `bie-trt build` refuses a Qwen3.5 checkpoint by name (what is in
place, what is missing, what it can build) before reading any tensor; `bie-trt plan` still plans it."""
from __future__ import annotations

from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.model.synthetic import write_word_tokenizer
from qwen35_tiny import hf_tiny_qwen35


def test_build_refuses_a_qwen35_checkpoint_by_name(tmp_path):
    ckpt = tmp_path / "qwen35"
    hf_tiny_qwen35().save_pretrained(ckpt)   # a real checkpoint: config.json and safetensors
    write_word_tokenizer(ckpt)
    r = CliRunner().invoke(main, ["build", "--checkpoint", str(ckpt), "--out", str(tmp_path / "engine"),
                                  "--profile", "cpu"])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    for fragment in ("Qwen3_5ForCausalLM", "not supported by `bie-trt build` yet", "Missing:", "recurrent state",
                     "Buildable architectures: Gemma3ForCausalLM", "Qwen3ForCausalLM"):
        assert fragment in lines[0], (fragment, lines[0])
    assert "Qwen3_5ForCausalLM," not in lines[0].split("Buildable architectures:")[1]
    assert not (tmp_path / "engine").exists() or not any((tmp_path / "engine").iterdir())
    plan = CliRunner().invoke(main, ["plan", "--checkpoint", str(ckpt), "--profile", "cpu"])
    assert plan.exit_code == 0 and "recurrent_state" in plan.stdout, plan.output
