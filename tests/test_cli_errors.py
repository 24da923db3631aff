"""Every bad input to the command line: one line naming the problem and the fix, a non-zero exit,
and nothing damaged. One table row per input; each asserts the exit code and the message."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.cli import main
from tiny_model import write_tiny_hf

LLAMA_CONFIG = Path(__file__).resolve().parents[1] / "docs" / "examples" / "llama-3.1-8b-instruct-awq.config.json"


def run_cli(args: list[str]):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, code: int, *fragments: str) -> str:
    """The command failed with `code` and printed exactly one line on stderr holding every fragment."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("profile:", "checkpoint:"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# --- engine directories with a damaged manifest ----------------------------------------------

MANIFEST_DAMAGE = {
    "not UTF-8": (lambda m: b"\xff\xfe{\"schema_version\": 2}", "not UTF-8"),
    "a JSON list": (lambda m: b"[1, 2, 3]", "holds a JSON list, not an object"),
    **{f"without {key}": ((lambda key: lambda m: json.dumps({k: v for k, v in m.items() if k != key}).encode())(key),
                          f"missing {key}") for key in ("model", "kv", "plan", "files")},
    "a KV field this version lacks": (lambda m: json.dumps({**m, "kv": {**m["kv"], "bits": 3}}).encode(),
                                      "manifest.json: malformed (TypeError"),
}


@pytest.fixture(scope="module")
def manifest(smollm2_engine) -> dict:
    return json.loads((smollm2_engine / "manifest.json").read_text())


def _damaged_engine(tmp_path: Path, manifest: dict, damage: str) -> Path:
    # Only manifest.json: every command must stop at the manifest, before the weights.
    make, _ = MANIFEST_DAMAGE[damage]
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_bytes(make(manifest))
    return engine


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
@pytest.mark.parametrize("command", ["inspect", "generate", "run"])
def test_damaged_manifest_is_one_line(tmp_path, manifest, damage, command):
    engine = _damaged_engine(tmp_path, manifest, damage)
    before = (engine / "manifest.json").read_bytes()
    args = {"inspect": ["inspect", engine],
            "generate": ["generate", "--engine", engine, "--prompt", "Hi", "--device", "cpu"],
            "run": ["run", "--engine", engine, "--port", "8123", "--device", "cpu"]}[command]
    line = assert_one_line_error(run_cli(args), 2, str(engine), MANIFEST_DAMAGE[damage][1])
    assert "rebuild" in line
    assert (engine / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
def test_verify_reports_a_damaged_manifest_with_exit_1(tmp_path, manifest, damage):
    engine = _damaged_engine(tmp_path, manifest, damage)
    r = run_cli(["verify", engine])
    assert r.exit_code == 1 and r.stdout.strip() == "FAILED"
    problems = [line for line in r.stderr.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and MANIFEST_DAMAGE[damage][1] in problems[0], r.stderr


# --- damaged weights ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def truncated_engine(tmp_path_factory, smollm2_engine) -> Path:
    engine = tmp_path_factory.mktemp("truncated") / "engine"
    shutil.copytree(smollm2_engine, engine)
    weights = engine / "weights.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    return engine


@pytest.mark.parametrize("command", ["generate", "run"])
@pytest.mark.parametrize("skip_verify", [False, True])
def test_truncated_weights_are_one_line(truncated_engine, command, skip_verify):
    args = {"generate": ["generate", "--engine", truncated_engine, "--prompt", "Hi", "--device", "cpu"],
            "run": ["run", "--engine", truncated_engine, "--port", "8123", "--device", "cpu"]}[command]
    if skip_verify:
        if command == "run":
            pytest.skip("`run` takes its options from the serving command")
        args.append("--skip-verify")
    want = "unreadable" if skip_verify else "weights.safetensors: sha256 mismatch"
    assert_one_line_error(run_cli(args), 2, "weights.safetensors", want, "rebuild")


# --- checkpoints and configs -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory, smollm2_checkpoint) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return quantize_checkpoint(write_tiny_hf(root / "hf", smollm2_checkpoint), root / "awq", group_size=32)


def _checkpoint_with(tmp_path: Path, tiny_awq: Path, change: str) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_awq, ckpt)
    weights = ckpt / "model.safetensors"
    if change == "config not UTF-8":
        (ckpt / "config.json").write_bytes(b"\xff\xfe{}")
    elif change == "config a list":
        (ckpt / "config.json").write_text("[]")
    elif change == "weights truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 100)
    elif change == "weights garbled":
        weights.write_bytes(b"\x00" * 8 + weights.read_bytes()[8:])   # header length 0: not safetensors
    elif change == "no tokenizer.json":
        (ckpt / "tokenizer.json").unlink()
    return ckpt


CHECKPOINT_ROWS = [
    ("config not UTF-8", ["config.json", "not UTF-8"]),
    ("config a list", ["config.json", "holds a JSON list, not an object"]),
    ("weights truncated", ["model.safetensors", "truncated or corrupt"]),
    ("weights garbled", ["model.safetensors", "truncated or corrupt"]),
    ("no tokenizer.json", ["tokenizer does not load", "tokenizer.json"]),
]


@pytest.mark.parametrize("change,fragments", CHECKPOINT_ROWS, ids=[r[0] for r in CHECKPOINT_ROWS])
def test_build_refuses_a_bad_checkpoint_before_heavy_work(tmp_path, tiny_awq, change, fragments):
    ckpt = _checkpoint_with(tmp_path, tiny_awq, change)
    out = tmp_path / "engines" / "e"
    r = run_cli(["build", "--checkpoint", ckpt, "--out", out, "--profile", "cpu", "--max-model-len", "256"])
    assert_one_line_error(r, 2, *fragments)
    assert "calibrating" not in r.stderr          # stopped before the repack and calibration
    assert not out.parent.exists() or not any(out.parent.iterdir())   # nothing half-written


@pytest.mark.parametrize("change,fragments", CHECKPOINT_ROWS[:2], ids=[r[0] for r in CHECKPOINT_ROWS[:2]])
@pytest.mark.parametrize("as_json", [False, True])
def test_plan_refuses_a_bad_config(tmp_path, tiny_awq, change, fragments, as_json):
    ckpt = _checkpoint_with(tmp_path, tiny_awq, change)
    r = run_cli(["plan", "--checkpoint", ckpt, "--profile", "cpu"] + (["--json"] if as_json else []))
    assert r.exit_code == 2
    if as_json:   # scripts read stdout: the error is JSON there
        error = json.loads(r.stdout)["error"]
        assert all(f in error for f in fragments), error
    else:
        assert_one_line_error(r, 2, *fragments)


# --- options -----------------------------------------------------------------------------------

ZERO_OPTIONS = [
    (["plan", "--model-config", LLAMA_CONFIG], "--max-model-len"),
    (["plan", "--model-config", LLAMA_CONFIG], "--max-num-seqs"),
    (["plan", "--model-config", LLAMA_CONFIG], "--chunked-prefill-size"),
    (["build", "--checkpoint", "unused", "--out", "unused"], "--max-model-len"),
    (["build", "--checkpoint", "unused", "--out", "unused"], "--max-num-seqs"),
    (["build", "--checkpoint", "unused", "--out", "unused"], "--chunked-prefill-size"),
]


@pytest.mark.parametrize("args,option", ZERO_OPTIONS, ids=[f"{a[0]} {o}" for a, o in ZERO_OPTIONS])
def test_zero_is_refused_not_taken_as_the_default(args, option):
    line = assert_one_line_error(run_cli(args + [option, "0"]), 2, option, "0 is not in the range x>=1")
    assert f"{args[0]} --help" in line


def test_eval_options(tmp_path, smollm2_engine):
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 40)
    base = ["eval", "--engine", smollm2_engine, "--text", text]
    assert_one_line_error(run_cli(base + ["--context", "0"]), 2, "--context", "x>=1")
    assert_one_line_error(run_cli(base + ["--kv-group-size", "7"]), 2, "--kv-group-size", "'7' is not one of")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Caf\xe9 au lait. ".encode("latin-1") * 20)
    assert_one_line_error(run_cli(["eval", "--engine", smollm2_engine, "--text", latin1]), 2,
                          str(latin1), "not UTF-8", "iconv")


@pytest.mark.parametrize("device,fragments", [
    ("tpu", ["--device", "'tpu' is unknown", "cuda:N"]),
    ("cuda:x", ["--device", "'cuda:x' is unknown"]),
])
def test_device_is_a_choice(smollm2_engine, device, fragments):
    r = run_cli(["generate", "--engine", smollm2_engine, "--prompt", "Hi", "--device", device])
    assert_one_line_error(r, 2, *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu(smollm2_engine, device):
    r = run_cli(["generate", "--engine", smollm2_engine, "--prompt", "Hi", "--device", device])
    assert_one_line_error(r, 2, f"device {device}", "0 CUDA GPU(s)", "--device cpu")


def test_generate_refuses_a_blank_chat_prompt_and_too_many_tokens(smollm2_engine, manifest):
    engine = ["generate", "--engine", smollm2_engine, "--device", "cpu"]
    assert_one_line_error(run_cli(engine + ["--prompt", "   ", "--chat"]), 2, "--prompt is empty")
    limit = manifest["max_model_len"]
    n_prompt = len(AutoTokenizer.from_pretrained(smollm2_engine)("The capital of France is")["input_ids"])
    r = run_cli(engine + ["--prompt", "The capital of France is", "--max-tokens", limit - n_prompt + 1])
    assert_one_line_error(r, 2, f"--max-tokens {limit - n_prompt + 1}", f"context of {limit}",
                          f"at most {limit - n_prompt}.")
    ok = run_cli(engine + ["--prompt", "The capital of France is", "--max-tokens", "2", "--temperature", "0"])
    assert ok.exit_code == 0, ok.output


def test_generate_gives_a_prompt_longer_than_the_context_the_sdks_advice(smollm2_engine, manifest):
    limit = manifest["max_model_len"]
    r = run_cli(["generate", "--engine", smollm2_engine, "--device", "cpu", "--echo",
                 "--prompt", "the cat sat " * limit])
    line = assert_one_line_error(r, 2, f"maximum context length is {limit} tokens",
                                 "shorten the prompt or rebuild with a larger --max-model-len")
    assert "--max-tokens" not in line and r.stdout == ""   # nothing echoed for a request that never ran
