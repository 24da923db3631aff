"""The real agents (Codex CLI, Claude Code, OpenCode, Qwen Code, at the versions scripts/agent_check.py pins)
against `bie-trt serve` on the built-in Qwen2.5-Coder-0.5B with an FP16 KV cache: each finishes a reply-only
turn with no 4xx/5xx on the way. Slow, and skipped where node or the agents are not installed (CI installs
neither): the skip names the install command. On two CPU cores one agent's first prompt (4k to 12k tokens)
takes minutes, so this runs one agent, BIE_TRT_AGENT (default codex, the shortest prompt); the script runs
all four."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import agent_check  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_agent_finishes_its_turn_against_the_server(tmp_path):
    agent = os.environ.get("BIE_TRT_AGENT", "codex")
    agents_dir = agent_check.DEFAULT_AGENTS_DIR
    install = " ".join(agent_check.install_command(agents_dir))
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed; install Node.js 20+, then `{install}`")
    if agent in agent_check.missing_agents(agents_dir):
        pytest.skip(f"{agent} is not installed: `{install}`")
    engine = agents_dir.parent / "engines" / "coder-fp16"   # built once (about two minutes), kept
    if not (engine / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "bie_trt.cli", "build", "--checkpoint", "qwen2.5-coder-0.5b",
                        "--max-model-len", "32768", "--kv-cache-dtype", "fp16", "--out", str(engine), "--force"],
                       check=True)
    out = tmp_path / "agents"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "agent_check.py"), "--engine", str(engine),
                           "--agents", agent, "--tasks", "reply", "--out", str(out), "--timeout", "480"],
                          capture_output=True, text=True, timeout=560)
    # the script exits 1 on any 4xx/5xx (its message printed) or an agent that fails or times out
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
