"""Conventions of the command line: one sampling default, --echo, --chat-template, eval's default
comparison, build's --gpu-memory-utilization, and where the bundled checkpoint is cached."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from bie_trt import SamplingParams
from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.cli import main

PROMPT = "The capital of France is"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_sampling_defaults_are_the_sdks():
    options = {p.name: p.default for p in main.commands["generate"].params}
    sdk = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "max_tokens"):
        assert options[name] == getattr(sdk, name), name


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine):
    return AutoTokenizer.from_pretrained(smollm2_engine)


def test_echo_puts_the_prompt_before_the_completion(smollm2_engine):
    base = ["generate", "--engine", smollm2_engine, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "3"]
    plain = json.loads(invoke(*base, "--json").stdout)
    echoed = json.loads(invoke(*base, "--json", "--echo").stdout)
    assert echoed["text"] == PROMPT + plain["text"] and echoed["token_ids"] == plain["token_ids"]
    streamed = invoke(*base, "--echo")
    assert streamed.exit_code == 0 and streamed.stdout == PROMPT + plain["text"] + "\n"


def test_chat_template_file_replaces_the_checkpoints(smollm2_engine, tokenizer, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    base = ["generate", "--engine", smollm2_engine, "--prompt", "hi", "--chat", "--temperature", "0",
            "--max-tokens", "1", "--json"]
    own = json.loads(invoke(*base).stdout)["prompt_token_ids"]
    assert own == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    r = invoke(*base, "--chat-template", template)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_token_ids"] == tokenizer("[user] hi\n[assistant]", add_special_tokens=False)["input_ids"]
    template.write_text("{% for m in messages %}")
    r = invoke(*base, "--chat-template", template)
    assert r.exit_code == 2
    assert json.loads(r.stdout)["error"].startswith(f"chat template {template}: jinja2 syntax error")


def test_chat_template_without_chat_is_an_error(smollm2_engine, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = invoke("generate", "--engine", smollm2_engine, "--prompt", "hi", "--chat-template", template)
    assert r.exit_code == 2
    assert "--chat-template applies only with --chat" in r.output and "add --chat" in r.output


@pytest.mark.slow
def test_generate_takes_template_variables(smollm2_engine, tokenizer):
    base = ["generate", "--engine", smollm2_engine, "--prompt", "hi", "--chat", "--chat-template", "qwen3",
            "--temperature", "0", "--max-tokens", "1", "--json"]
    thinking = json.loads(invoke(*base).stdout)["prompt_token_ids"]
    plain = json.loads(invoke(*base, "--chat-template-kwargs", '{"enable_thinking": false}').stdout)["prompt_token_ids"]
    assert plain == thinking + tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    r = invoke("generate", "--engine", smollm2_engine, "--prompt", "hi", "--chat-template-kwargs", "{}")
    assert r.exit_code == 2 and "--chat-template-kwargs applies only with --chat" in r.output


def test_generate_json_returns_a_chat_replys_reasoning(smollm2_engine, tmp_path):
    """A template whose generation prompt opens a <think> block: the reply starts inside it, so its
    reasoning is split off as the server splits it; SmolLM2's own template does not think: null."""
    from bie_trt.chat.reasoning import split_reasoning

    template = tmp_path / "think.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}<|im_start|>assistant\n<think>\n")
    base = ["generate", "--engine", smollm2_engine, "--prompt", "hi", "--chat", "--temperature", "0",
            "--max-tokens", "8", "--json"]
    thinking = json.loads(invoke(*base, "--chat-template", template).stdout)
    assert thinking["reasoning_content"] == split_reasoning(thinking["text"], inside=True)[0] is not None
    assert json.loads(invoke(*base).stdout)["reasoning_content"] is None


def test_eval_without_a_kv_flag_compares_int4_against_fp16(smollm2_engine, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat and looked at the dog across the room. " * 20)
    assert json.loads((smollm2_engine / "manifest.json").read_text())["kv"]["dtype"] == "fp16"
    r = invoke("eval", "--engine", smollm2_engine, "--text", text, "--context", "64", "--max-windows", "1",
               "--kv-window", "16", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [row["kv"]["dtype"] for row in out["rows"]] == ["fp16", "int4_asym"]
    assert out["kld"] > 0   # FP16 against itself would be exactly 0


def test_build_gpu_memory_utilization_reaches_the_plan(smollm2_checkpoint, tmp_path):
    r = invoke("build", "--checkpoint", smollm2_checkpoint, "--out", tmp_path / "e", "--profile", "cpu",
               "--max-model-len", "2048", "--gpu-memory-utilization", "0.001")
    assert r.exit_code == 2 and "does not fit" in r.stderr and "x 0.001" in r.stderr
    assert not (tmp_path / "e").exists()


def test_the_bundled_checkpoint_says_where_it_is_cached(smollm2_checkpoint):
    heard = []
    assert resolve_checkpoint("smollm2-135m", log=heard.append) == smollm2_checkpoint
    assert heard == [f"checkpoint: smollm2-135m (cached at {smollm2_checkpoint})"]


def test_the_stats_line_counts_one_token_without_a_rate_and_shows_speculation():
    from bie_trt.cli.model_cmds import stats_line
    from bie_trt.executor.outputs import RequestOutput, Usage

    def output(n: int, rate: float, spec: dict | None = None) -> RequestOutput:
        return RequestOutput("r", [1, 2], "x" * n, list(range(n)), "stop", Usage(2, n), 0.1, rate, spec_decode=spec)

    assert stats_line(output(1, 0.0)) == "[1 token, finish: stop]"
    assert stats_line(output(5, 3.25, {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4})) == \
        "[5 tokens, 3.2 tok/s, 4 of 6 speculated tokens accepted, finish: stop]"


def test_text_mode_generate_shows_speculations_acceptance(smollm2_engine):
    r = invoke("generate", "--engine", smollm2_engine, "--prompt", "one two three four one two three four one two",
               "--temperature", "0", "--max-tokens", "8", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert r.exit_code == 0, r.output
    assert "speculated tokens accepted" in r.stderr


@pytest.mark.parametrize("command", ["plan", "build"])
def test_help_lists_every_build_profile(command):
    from bie_trt.profiles import list_profiles

    text = invoke(command, "--help").output
    assert all(f"  {name} " in text for name in list_profiles())


def test_the_cpu_profile_plans_against_this_machines_memory(smollm2_checkpoint):
    from pathlib import Path

    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024
    r = invoke("plan", "--checkpoint", smollm2_checkpoint, "--profile", "cpu", "--json")
    budget = json.loads(r.stdout)["budget_bytes"]
    assert 0.8 * total <= budget <= total
