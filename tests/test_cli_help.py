"""The command line reads as a manual: every option of every command says what it does; `inspect`
shows only what applies to the engine."""
from __future__ import annotations

import dataclasses

import click
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.cli.model_cmds import _kv_summary
from bie_trt.config import KVCacheConfig

def walk(command: click.Command, path: str = "bie-trt"):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from walk(sub, f"{path} {name}")


def options_without_help(root: click.Command) -> list[str]:
    missing = []
    for path, command in walk(root):
        for param in command.params:
            if isinstance(param, click.Option) and not (param.help or "").strip():
                missing.append(f"{path} {param.opts[0]}")
    return missing


def test_every_option_has_help():
    assert options_without_help(main) == []


def test_the_walk_finds_an_option_without_help():
    @click.group()
    def root():
        """A root."""

    @root.command()
    @click.option("--documented", help="Says what it does.")
    @click.option("--bare")
    def leaf(documented, bare):
        """A leaf."""

    assert options_without_help(root) == ["bie-trt leaf --bare"]


def test_every_command_has_a_summary():
    for path, command in walk(main):
        assert (command.help or "").strip(), path


def test_inspect_of_an_fp16_engine_shows_no_quantisation_fields(smollm2_engine):
    out = CliRunner().invoke(main, ["inspect", str(smollm2_engine)])
    assert out.exit_code == 0, out.output
    kv_line = next(line for line in out.output.splitlines() if line.startswith("kv cache"))
    assert kv_line.split(None, 2)[2] == "fp16 (block 16)"
    assert "cuda_graphs" not in out.output and "cuda_context" not in out.output   # 0 bytes on the CPU
    assert "SM 0" not in out.output


def test_kv_summary_names_what_each_format_uses():
    kv = KVCacheConfig(dtype="int4_asym", group_size=64, sink_tokens=8, window=128, rotation="hadamard",
                       key_centering=False, block_size=16)
    assert _kv_summary(kv) == ("int4_asym (group 64, sinks 8, window 128, rotation hadamard, key centering off, "
                               "key scale off, block 16)")
    assert _kv_summary(dataclasses.replace(kv, dtype="fp8", key_scale=True)) == (
        "fp8 (sinks 8, window 128, rotation hadamard, key centering off, key scale on, block 16)")


def test_build_and_plan_state_the_drafts_head_rule_and_budget():
    """--draft-vocab-size reads the same in `build` and `plan`: a row count, and without it the rows whose
    weights fit the byte budget, which the help names."""
    from bie_trt.plan import DEFAULT_DRAFT_HEAD_BYTES

    budget = f"fit {DEFAULT_DRAFT_HEAD_BYTES // 2**20} MiB"
    for command in ("build", "plan"):
        out = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=200).output.split())
        rule = out[out.index("--draft-vocab-size"):out.index("--draft-window-tokens")]
        assert "as a row count" in rule and budget in rule and "at most the whole vocabulary" in rule, rule
