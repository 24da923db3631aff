"""The README's path from a Hugging Face checkpoint: its plan commands run as printed, on the shipped
Llama-3.1-8B config and on a Llama-3-8B-shaped random checkpoint directory, and print what it shows."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bie_trt.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTION = README.split("## From a Hugging Face AWQ checkpoint")[1].split("\n## ")[0]
EXAMPLE_CONFIG = "docs/examples/llama-3.1-8b-instruct-awq.config.json"


def code_blocks(language: str) -> list[list[str]]:
    """The lines of each fenced block of the section whose fence names `language` ('' for none)."""
    blocks, fence = [], None
    for line in SECTION.splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, lines = line[3:], []
            else:
                if fence == language:
                    blocks.append(lines)
                fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


def readme_commands(name: str) -> list[list[str]]:
    """Every `bie-trt NAME ...` line of the section's shell blocks, split as a shell would."""
    lines = [line for block in code_blocks("bash") for line in block]
    return [shlex.split(line)[1:] for line in lines if line.startswith(f"bie-trt {name} ")]


def printed_output() -> list[str]:
    """The lines of the plan output the README shows (its one plain block), without the elisions."""
    (block,) = code_blocks("")
    return [line for line in block if line.strip() and line.strip() != "..."]


@pytest.fixture()
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)   # the README's paths are relative to the clone


def test_the_readme_shows_both_plan_commands_and_the_shipped_config():
    plans = readme_commands("plan")
    assert [p[:2] for p in plans] == [["plan", "--model-config"], ["plan", "--checkpoint"]]
    assert plans[0][2] == EXAMPLE_CONFIG and (ROOT / EXAMPLE_CONFIG).is_file()
    assert "<" not in SECTION   # no placeholders: every path is one a user can type


def test_plan_of_the_shipped_config_prints_what_the_readme_shows(in_repo):
    args = readme_commands("plan")[0]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    for line in printed_output():
        assert line in r.stdout.splitlines(), line


def test_plan_of_a_random_8b_checkpoint_directory(in_repo, tmp_path):
    ckpt = tmp_path / "llama-3.1-8b-awq"
    subprocess.run([sys.executable, "scripts/random_awq_checkpoint.py", "--out", str(ckpt), "--config-only",
                    "--config", EXAMPLE_CONFIG], check=True, capture_output=True, timeout=300)
    args = readme_commands("plan")[1]
    args[args.index("--checkpoint") + 1] = str(ckpt)   # where `hf download` would have put it
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    for line in printed_output():
        assert line in r.stdout.splitlines(), line
    # the same directory with a smaller profile: refused with exit 3 and what to change
    r = CliRunner().invoke(main, args[:args.index("--profile")] + ["--profile", "rtx4060ti-8gb",
                                                                  "--max-model-len", "131072"])
    largest = next(line for line in printed_output() if "largest max_model_len" in line).split()[-1]
    assert r.exit_code == 3 and f"--max-model-len {largest.rstrip('.').replace(',', '')}" in r.stdout


def test_build_and_serve_lines_name_the_same_checkpoint_and_engine():
    plan, build, serve = readme_commands("plan")[1], readme_commands("build")[0], readme_commands("serve")[0]
    ckpt = plan[plan.index("--checkpoint") + 1]
    assert build[build.index("--checkpoint") + 1] == ckpt
    assert build[build.index("--out") + 1] == serve[serve.index("--engine") + 1]
    assert "hf download" in SECTION and f"--local-dir {ckpt}" in SECTION
