"""Every `bie-trt ...` command that README.md and docs/*.md show (in code blocks and inline code) names a
command that exists and only options that command has: checked against the click definitions, so a
renamed or promised-but-missing option fails here rather than on a reader's terminal."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from bie_trt.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BREAKS = {"&&", "||", "|", ";", ">", "2>&1"}


def code_texts(markdown: str) -> list[str]:
    """The text of every fenced block (continuation lines joined) and of every inline code span."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    return [block.replace("\\\n", " ") for block in fenced] + re.findall(r"`([^`\n]+)`", prose)


def commands(text: str) -> list[list[str]]:
    """Each `bie-trt SUB ...` invocation in `text` (bare or as .venv/bin/bie-trt), up to a shell operator."""
    found = []
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:   # an unbalanced quote in prose: not a command line
            continue
        for i, word in enumerate(words):
            if word.split("/")[-1] == "bie-trt" and i + 1 < len(words):
                rest = words[i + 1:]
                end = next((j for j, w in enumerate(rest) if w in SHELL_BREAKS), len(rest))
                found.append(rest[:end])
    return found


def problems(argv: list[str]) -> list[str]:
    """What is wrong with one documented command line: an unknown command or an unknown option."""
    name, args = argv[0], argv[1:]
    command = main.commands.get(name)
    if command is None:
        return [f"no command {name!r}"]
    known = {"--help", "-h"}
    for param in command.params:
        known.update(param.opts)
        known.update(param.secondary_opts)
    used = [a.strip("[]").split("=")[0] for a in args if a.strip("[]").startswith("-")]
    return [f"`bie-trt {name}` has no option {opt}" for opt in used if opt not in known]


def documented() -> list[tuple[str, list[str]]]:
    return [(path.relative_to(ROOT).as_posix(), argv)
            for path in DOCS for text in code_texts(path.read_text()) for argv in commands(text)]


def test_the_docs_show_commands_to_check():
    names = {argv[0] for _, argv in documented()}
    assert {"build", "generate", "serve", "plan", "eval", "quantize"} <= names


@pytest.mark.parametrize("where, argv", documented(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_documented_command_uses_only_existing_options(where, argv):
    assert problems(argv) == [], f"{where}: bie-trt {' '.join(argv)}"


def test_the_check_finds_a_missing_option_and_a_missing_command():
    markdown = "Run `bie-trt serve ENGINE --no-such-option` or\n```bash\n.venv/bin/bie-trt frobnicate --x && ls\n```\n"
    found = [argv for text in code_texts(markdown) for argv in commands(text)]
    assert found == [["frobnicate", "--x"], ["serve", "ENGINE", "--no-such-option"]]
    assert [problems(argv) for argv in found] == [["no command 'frobnicate'"],
                                                  ["`bie-trt serve` has no option --no-such-option"]]
