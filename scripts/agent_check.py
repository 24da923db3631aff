"""The real coding agents against `bie-trt serve`: Codex CLI, Claude Code, OpenCode and Qwen Code, installed
from npm at pinned versions, each run non-interactively on a reply-only turn and on a tool task, every request
and reply logged by a proxy between the agent and the server.

    python scripts/agent_check.py --engine ENGINE_DIR --out /tmp/agents          # serves ENGINE_DIR itself
    python scripts/agent_check.py --base-url http://127.0.0.1:8080 --out /tmp/agents   # a server already up
    python scripts/agent_check.py --install-only                                 # npm install, nothing else

The agents are installed once into `--agents-dir` (default ~/.cache/bie-trt/agents; `npm install --prefix
DIR` with the versions in PINNED). Each agent runs in a fresh work folder holding `hello.txt`, with its own
config pointing it at the proxy (HOME and the agent's config folders moved there too, so nothing of the
user's own setup is read or written). The tool task asks the agent to read that file with a tool: a small
model may answer without calling one, which the report says ("tool called: no"); it is no failure, since only
the protocol is under test. What fails the run (exit 1): any 4xx/5xx from the server (its message is
printed), or an agent that exits non-zero or times out.

The proxy writes `NNN-request.json` and `NNN-reply.txt` per request into `--out`/<agent>-<task>/ and a line
per request: status, prompt tokens, of them served by the prefix cache, time to the reply's first byte (the
server sends its first streamed event with the first generated token, so this is the time to first token)
and to its end. The reply-only turn runs first and is turn 1; the tool task, in the same work folder and
HOME (so with the same system prompt and tools), is turn 2. The table in `report.md` gives per agent and turn
the whole turn's time and its main request's (the first carrying the agent's whole prompt) prompt tokens,
cached tokens and time to first token: turn 2's cached tokens are what the prefix cache kept of turn 1.
With `--continue-conversation` (Claude Code) turn 2 goes on in turn 1's conversation instead of a new session.
`summary.json` (and `--json PATH`) holds the same with the agents' installed versions.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

PINNED = {"codex": "@openai/codex@0.169.0", "claude": "@anthropic-ai/claude-code@2.1.328",
          "opencode": "opencode-ai@1.18.33", "qwen": "@qwen-code/qwen-code@0.24.4"}
DEFAULT_AGENTS_DIR = Path.home() / ".cache" / "bie-trt" / "agents"
MODEL = "qwen2.5-coder-0.5b"
SECRET = "The secret word is periwinkle."
TASKS = {
    "reply": "Answer in one short sentence, without using any tool: what does the Python expression 2 + 3 * 4 "
             "evaluate to?",
    # one command named outright: a small model asked to "read the file" answered from nothing
    "tool": "Call your shell tool now to run the command `cat hello.txt`, then tell me the secret word it "
            "printed.",
}


def install_command(agents_dir: Path) -> list[str]:
    return ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(agents_dir), *PINNED.values()]


def agent_bin(agents_dir: Path, agent: str) -> Path:
    return agents_dir / "node_modules" / ".bin" / agent


def installed_version(agents_dir: Path, agent: str) -> str | None:
    """The version npm installed, from the package's own package.json."""
    package = PINNED[agent].rsplit("@", 1)[0]
    path = agents_dir / "node_modules" / package / "package.json"
    return json.loads(path.read_text())["version"] if path.exists() else None


def missing_agents(agents_dir: Path) -> list[str]:
    return [a for a in PINNED if not agent_bin(agents_dir, a).exists()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the logging proxy

@dataclass
class Exchange:
    """One request through the proxy and what came back."""
    number: int
    method: str
    path: str
    status: int = 0
    first_byte_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    tool_called: bool = False
    tool_output: str | None = None   # the tool results the request sent back to the model, joined (None: none)
    client_left: bool = False   # the agent closed the connection before the reply's end (it gave up waiting)


# A reply's usage as each API words it (the last occurrence: a stream repeats usage in its final event).
USAGE_FIELDS = {"prompt": ("prompt_tokens", "input_tokens"), "cached": ("cached_tokens", "cache_read_input_tokens")}
CALL_MARKERS = ('"type":"function_call"', '"type": "function_call"', '"type":"tool_use"', '"type": "tool_use"',
                '"tool_calls":[{', '"tool_calls": [{', '"type":"local_shell_call"', '"type":"custom_tool_call"')


# A tool's result sent back to the model, as each API words it: a Responses output item, an Anthropic block, a
# chat message (its `role`).
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output", "local_shell_call_output", "tool_result")


def text_of(value: object) -> str:
    """Every string in a JSON value, joined: a tool result's content is a string or a list of blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "".join(text_of(v) for v in value.values())
    if isinstance(value, list):
        return "".join(text_of(v) for v in value)
    return ""


def tool_outputs(body: object) -> list[str]:
    """The tool results a request body sends back to the model, in order, in any of the three APIs' shapes."""
    found: list[str] = []
    if isinstance(body, dict):
        if body.get("type") in OUTPUT_TYPES or body.get("role") == "tool":
            return [text_of(body.get("output", body.get("content", "")))]
        for value in body.values():
            found += tool_outputs(value)
    elif isinstance(body, list):
        for value in body:
            found += tool_outputs(value)
    return found


def last_int(text: str, key: str) -> int | None:
    found = re.findall(rf'"{key}"\s*:\s*(\d+)', text)
    return int(found[-1]) if found else None


def read_usage(exchange: Exchange, text: str) -> None:
    """Prompt and cached tokens from a reply (Anthropic counts its input_tokens apart from the cached ones)."""
    cached = next((v for k in USAGE_FIELDS["cached"] if (v := last_int(text, k)) is not None), None)
    prompt = last_int(text, "prompt_tokens")
    if prompt is None and (given := last_int(text, "input_tokens")) is not None:
        anthropic = last_int(text, "cache_read_input_tokens") is not None
        prompt = given + (cached or 0) if anthropic else given
    exchange.prompt_tokens, exchange.cached_tokens = prompt, cached
    exchange.tool_called = any(m in text for m in CALL_MARKERS)


def close_when_client_leaves(client: socket.socket, upstream: http.client.HTTPConnection, done: threading.Event,
                             exchange: Exchange) -> None:
    """An agent that gives up on a request (a stream quiet for minutes during a long prefill) closes its
    connection: close the server's too, so that the server aborts the request instead of computing a copy
    nobody reads beside the agent's resend."""
    while not done.wait(0.5):
        readable, _, _ = select.select([client], [], [], 0)
        try:
            gone = bool(readable) and not client.recv(1, socket.MSG_PEEK)
        except OSError:
            gone = True
        if gone:
            exchange.client_left = True
            with contextlib.suppress(OSError):
                upstream.sock.shutdown(socket.SHUT_RDWR)
            return


class Proxy:
    """A threaded HTTP proxy to `upstream` logging each exchange into the current folder (`switch`)."""

    def __init__(self, upstream: str):
        url = urllib.parse.urlsplit(upstream)
        self.host, self.port_up = url.hostname, url.port or 80
        self.exchanges: list[Exchange] = []
        self.folder: Path | None = None
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:   # the table says it all
                pass

            def relay(self) -> None:
                proxy.handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def switch(self, folder: Path) -> list[Exchange]:
        """Log the exchanges from now on into `folder`; returns their list."""
        folder.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.folder, self.exchanges = folder, []
        return self.exchanges

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        start = time.perf_counter()
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        with self.lock:
            exchange = Exchange(len(self.exchanges) + 1, h.command, h.path)
            self.exchanges.append(exchange)
            folder = self.folder
        stem = folder / f"{exchange.number:03d}"
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode(errors="replace")
        if outputs := tool_outputs(parsed):
            exchange.tool_output = "\n".join(outputs)
        stem.with_name(stem.name + "-request.json").write_text(json.dumps(
            {"method": h.command, "path": h.path, "headers": dict(h.headers), "body": parsed}, indent=1))
        up = http.client.HTTPConnection(self.host, self.port_up, timeout=1800)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection", "accept-encoding")}
        reply = bytearray()
        done = threading.Event()
        try:
            up.request(h.command, h.path, body=body or None, headers=headers)
            threading.Thread(target=close_when_client_leaves, args=(h.connection, up, done, exchange),
                             daemon=True).start()
            resp = up.getresponse()
            exchange.status = resp.status
            # the reply goes back close-delimited: streamed events pass through as they come
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    h.send_header(k, v)
            h.send_header("Connection", "close")
            h.end_headers()
            while chunk := resp.read1(65536):
                if exchange.first_byte_s is None:
                    exchange.first_byte_s = time.perf_counter() - start
                reply += chunk
                try:
                    h.wfile.write(chunk)
                    h.wfile.flush()
                except OSError:   # the agent's side: not the server's failure, reported apart
                    exchange.client_left = True
                    break
        except (OSError, http.client.HTTPException) as e:
            if not exchange.client_left:   # else the watcher closed it, as the agent had
                exchange.error = f"proxy: {type(e).__name__}: {e}"
        finally:
            done.set()
            up.close()
            h.close_connection = True
        exchange.total_s = time.perf_counter() - start
        text = reply.decode(errors="replace")
        stem.with_name(stem.name + "-reply.txt").write_text(text)
        read_usage(exchange, text)
        if exchange.status >= 400:
            exchange.error = text[:2000]
        with (folder / "exchanges.jsonl").open("a") as log:   # as it happens: a run cut short keeps its numbers
            log.write(json.dumps(dataclasses.asdict(exchange)) + "\n")

    def close(self) -> None:
        self.server.shutdown()


# ---------------------------------------------------------------- the agents, each pointed at the proxy

def agent_env(home: Path) -> dict[str, str]:
    """A private HOME and XDG folders: the agent reads and writes none of the user's own settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC", "CLAUDE", "CODEX"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), NO_COLOR="1")
    return env


def codex_command(binary: Path, base: str, work: Path, home: Path, prompt: str) -> tuple[list[str], dict]:
    """Codex: a model_providers entry speaking the Responses API (wire_api = "responses")."""
    # it abandons a stream quiet for 5 minutes and sends the request again (a CPU's 8k-token prefill can
    # take longer): wait 30 min
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "bie"\n\n[model_providers.bie]\nname = "bie-trt"\n'
        f'base_url = "{base}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = 1800000\n')
    env = {**agent_env(home), "CODEX_HOME": str(codex_home)}
    return [str(binary), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "-C", str(work), prompt], env


def claude_command(binary: Path, base: str, work: Path, home: Path, prompt: str) -> tuple[list[str], dict]:
    """Claude Code: ANTHROPIC_BASE_URL, any key; print mode with its shell and file tools allowed."""
    # its stream gives up on a first byte that takes minutes (a 10k-token prompt on a CPU does), and on a stream
    # quiet for 5 minutes whatever the first-byte limit says (the idle limit): wait 30 min for both
    env = {**agent_env(home), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-ant-bie-trt",
           "CLAUDE_CONFIG_DIR": str(home / ".claude"), "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS": "1800000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
           "API_TIMEOUT_MS": "1800000"}
    return [str(binary), "-p", prompt, "--model", MODEL, "--allowedTools", "Bash Read"], env


def opencode_command(binary: Path, base: str, work: Path, home: Path, prompt: str) -> tuple[list[str], dict]:
    """OpenCode: a provider of the AI SDK's openai-compatible package, named by `-m provider/model`."""
    config = {"$schema": "https://opencode.ai/config.json", "model": f"bie/{MODEL}", "autoupdate": False,
              "share": "disabled",
              "provider": {"bie": {"npm": "@ai-sdk/openai-compatible", "name": "bie-trt",
                                   # its stream gives up after 5 min without a chunk; a CPU's first prompt
                                   # can take longer
                                   "options": {"baseURL": f"{base}/v1", "apiKey": "bie-trt",
                                               "chunkTimeout": 1800000, "headerTimeout": 1800000},
                                   "models": {MODEL: {"name": MODEL, "limit": {"context": 32768, "output": 4096}}}}}}
    path = home / "opencode.json"
    path.write_text(json.dumps(config, indent=1))
    env = {**agent_env(home), "OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    return [str(binary), "run", "-m", f"bie/{MODEL}", prompt], env


def qwen_command(binary: Path, base: str, work: Path, home: Path, prompt: str) -> tuple[list[str], dict]:
    """Qwen Code: its OpenAI auth type with the base URL and key on the command line."""
    # it resends a request whose stream is quiet for minutes (a 17k-token prompt on a CPU is), and one not done
    # within 15 minutes: no idle limit, no lifetime limit
    env = {**agent_env(home), "QWEN_STREAM_IDLE_TIMEOUT_MS": "0", "QWEN_STREAM_MAX_LIFETIME_MS": "0",
           "QWEN_CODE_API_TIMEOUT_MS": "1800000"}
    # its background memory agent runs after every turn with a 10k-token prompt of its own (minutes of CPU
    # prefill the turn waits for); it is a second agent, not the turn under test: switched off
    settings = home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False}}))
    return [str(binary), "--auth-type", "openai", "--openai-base-url", f"{base}/v1", "--openai-api-key", "bie-trt",
            "-m", MODEL, "--approval-mode", "yolo", "-p", prompt], env


# Turn 2 in turn 1's conversation (--continue-conversation): the flag that resumes the work folder's last
# conversation. Only Claude Code's is here so far, the one agent whose new-session turn 2 misses the cache.
CONTINUE_FLAGS = {"claude": ["--continue"]}

COMMANDS = {"codex": codex_command, "claude": claude_command, "opencode": opencode_command, "qwen": qwen_command}


@dataclass
class Run:
    agent: str
    task: str
    exit_code: int | None
    seconds: float
    exchanges: list[Exchange]
    answer: str
    failures: list[str] = field(default_factory=list)

    @property
    def tool_called(self) -> bool:
        return any(e.tool_called for e in self.exchanges)

    @property
    def carries_tool_output(self) -> bool:
        """The agent ran a tool and sent its output back: a later request carried a tool result holding the
        secret word of hello.txt (the tool task's file). A result without it (a failed call, another file)
        shows the round trip works but not that the tool read the file."""
        word = SECRET.rstrip(".").rsplit(" ", 1)[-1]
        return any(word in (e.tool_output or "") for e in self.exchanges)


def run_agent(agent: str, task: str, agents_dir: Path, proxy: Proxy, out: Path, timeout_s: float,
              more_args: tuple[str, ...] = ()) -> Run:
    # one work folder and HOME per agent, for both its tasks: the prompts (which name the folder) then share
    # their head, as one user's turns do
    folder = out / f"{agent}-{task}"
    shutil.rmtree(folder, ignore_errors=True)
    exchanges = proxy.switch(folder / "http")
    work, home = out / agent / "work", out / agent / "home"
    work.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    (work / "hello.txt").write_text(SECRET + "\n")
    argv, env = COMMANDS[agent](agent_bin(agents_dir, agent), proxy.url, work, home, TASKS[task])
    argv += more_args
    env["PWD"] = str(work)   # OpenCode takes its folder from $PWD, not from the process's working directory
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    seconds = time.perf_counter() - start
    (folder / "stdout.txt").write_text(stdout)
    (folder / "stderr.txt").write_text(stderr)
    run = Run(agent, task, code, seconds, list(exchanges), stdout.strip())
    for e in run.exchanges:
        if e.status >= 400 or e.error:
            run.failures.append(f"{e.method} {e.path} -> {e.status}: {e.error}")
    if code != 0:
        run.failures.append(f"exit {code} after {seconds:.0f} s; stderr tail: {stderr[-1500:]}")
    return run


# ---------------------------------------------------------------- the server

@contextlib.contextmanager
def serving(engine: Path, port: int, extra: list[str], log: Path) -> Iterator[str]:
    """`bie-trt serve ENGINE` in a child process until the block ends, its prefix cache empty at the start."""
    # a disk tier of its own, empty: the default one outlives the server, and would serve an agent's first
    # turn from an earlier run's blocks
    kv_dir = log.parent / "kv-cache"
    shutil.rmtree(kv_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "bie_trt.cli", "serve", "--engine", str(engine), "--port", str(port),
            "--log-level", "warning", "--kv-cache-dir", str(kv_dir), *extra]
    with log.open("w") as sink:
        child = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if child.poll() is not None:
                raise SystemExit(f"bie-trt serve exited {child.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if time.time() > deadline:
                raise SystemExit("bie-trt serve did not come up within 600 s")
            time.sleep(1)
        yield base
    finally:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()


# ---------------------------------------------------------------- the report

def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main_exchange(run: Run) -> Exchange | None:
    """The run's first request that carries the agent's whole prompt: the first answered one of at least half
    the run's largest prompt (so not a title or summary request with a short prompt of its own, nor a copy
    the agent gave up on before its end)."""
    sized = [e for e in run.exchanges if e.prompt_tokens is not None and e.status == 200]
    if not sized:
        return None
    largest = max(e.prompt_tokens for e in sized)
    whole = [e for e in sized if 2 * e.prompt_tokens >= largest]
    return next((e for e in whole if not e.client_left), whole[0])


def turn_summary(run: Run) -> dict:
    """One turn's numbers: the whole run, and its main request's prompt, cache hits and times."""
    main = main_exchange(run)
    return {"task": run.task, "exit": run.exit_code, "seconds": round(run.seconds, 1),
            "requests": len(run.exchanges), "errors": sum(e.status >= 400 for e in run.exchanges),
            "tool_called": run.tool_called, "carries_tool_output": run.carries_tool_output,
            "prompt_tokens": None if main is None else main.prompt_tokens,
            "cached_tokens": None if main is None else main.cached_tokens,
            "first_token_s": None if main is None or main.first_byte_s is None else round(main.first_byte_s, 1),
            "request_s": None if main is None or main.total_s is None else round(main.total_s, 1)}


def agent_summaries(runs: list[Run]) -> dict[str, dict]:
    """Per agent, its turns in order: the reply-only turn is turn 1, the tool task (same work folder and
    HOME, so the same system prompt and tools) turn 2."""
    agents: dict[str, dict] = {}
    for r in runs:
        agents.setdefault(r.agent, {"turns": []})["turns"].append(turn_summary(r))
    return agents


def turns_table(summaries: dict[str, dict]) -> list[str]:
    lines = ["| agent | turn | task | exit | requests | 4xx/5xx | tool called | tool output sent back | prompt tokens | "
             "cached | time to first token s | request s | whole turn s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for agent, s in summaries.items():
        for n, t in enumerate(s["turns"], 1):
            lines.append(f"| {agent} | {n} | {t['task']} | {t['exit']} | {t['requests']} | {t['errors']} | "
                         f"{'yes' if t['tool_called'] else 'no'} | {'yes' if t['carries_tool_output'] else 'no'} | "
                         f"{t['prompt_tokens']} | {t['cached_tokens']} | "
                         f"{seconds(t['first_token_s'])} | {seconds(t['request_s'])} | {t['seconds']:.0f} |")
    return lines


def report(runs: list[Run]) -> str:
    lines = turns_table(agent_summaries(runs))
    lines.append("")
    for r in runs:
        lines.append(f"{r.agent} {r.task}: answer {r.answer[-300:]!r}")
        for e in r.exchanges:
            lines.append(f"  #{e.number} {e.method} {e.path} {e.status} prompt {e.prompt_tokens} cached "
                         f"{e.cached_tokens} first byte {seconds(e.first_byte_s)} s total {seconds(e.total_s)} s"
                         f"{' (tool call)' if e.tool_called else ''}"
                         f"{f' (tool output sent: {e.tool_output[:80]!r})' if e.tool_output else ''}"
                         f"{' (the agent closed the connection first)' if e.client_left else ''}")
        lines += [f"  FAILED: {f}" for f in r.failures]
    return "\n".join(lines)


def results(runs: list[Run], args: argparse.Namespace, commit: str) -> dict:
    """What a run measured, with what it ran on: the summary.json beside report.md."""
    engine = {}
    if args.engine is not None and (args.engine / "manifest.json").exists():
        kv = json.loads((args.engine / "manifest.json").read_text()).get("kv", {})
        engine = {"kv_cache_dtype": kv.get("dtype"), "kv_block_size": kv.get("block_size")}
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": commit, "model": MODEL,
            "engine": engine, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {a: installed_version(args.agents_dir, a) for a in dict.fromkeys(r.agent for r in runs)},
            "agents": agent_summaries(runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="engine directory to serve (bie-trt serve, in a child process)")
    ap.add_argument("--base-url", help="a server already running (instead of --engine)")
    ap.add_argument("--serve-args", default="", help="more `bie-trt serve` options, one string")
    ap.add_argument("--agents-dir", type=Path, default=DEFAULT_AGENTS_DIR)
    ap.add_argument("--agents", default=",".join(PINNED), help="comma-separated, of " + ", ".join(PINNED))
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of " + ", ".join(TASKS))
    ap.add_argument("--out", type=Path, default=Path("agent_check"))
    ap.add_argument("--timeout", type=float, default=900, help="seconds each agent run may take")
    ap.add_argument("--continue-conversation", action="store_true",
                    help="turns after the first continue the agent's conversation (agents: " + ", ".join(CONTINUE_FLAGS)
                         + "); without it each turn is a new session")
    ap.add_argument("--json", type=Path, help="also write the summary (versions, per-agent turns) here")
    ap.add_argument("--install", action="store_true", help="npm install the pinned agents first")
    ap.add_argument("--install-only", action="store_true")
    args = ap.parse_args()
    if args.install or args.install_only:
        if shutil.which("npm") is None:
            raise SystemExit("npm is not installed: install Node.js 20 or newer first")
        args.agents_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(install_command(args.agents_dir), check=True)
        if args.install_only:
            return 0
    agents = args.agents.split(",")
    missing = [a for a in missing_agents(args.agents_dir) if a in agents]
    if missing:
        raise SystemExit(f"agents not installed: {missing}; run `{' '.join(install_command(args.agents_dir))}` "
                         f"(or pass --install)")
    if args.continue_conversation and (cannot := [a for a in agents if a not in CONTINUE_FLAGS]):
        raise SystemExit(f"--continue-conversation is not set up for {cannot}; it is for {list(CONTINUE_FLAGS)}")
    if (args.engine is None) == (args.base_url is None):
        raise SystemExit("give --engine or --base-url")
    args.out.mkdir(parents=True, exist_ok=True)
    # the code the run starts with (the report is written at its end)
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    with contextlib.ExitStack() as stack:
        base = args.base_url or stack.enter_context(serving(args.engine, free_port(), args.serve_args.split(),
                                                            args.out / "server.log"))
        proxy = Proxy(base)
        stack.callback(proxy.close)
        runs = []
        for agent in agents:
            for n, task in enumerate(args.tasks.split(",")):
                more = CONTINUE_FLAGS[agent] if args.continue_conversation and n > 0 else []
                run = run_agent(agent, task, args.agents_dir, proxy, args.out, args.timeout, tuple(more))
                print(f"{agent} {task}: exit {run.exit_code}, {len(run.exchanges)} requests, {run.seconds:.0f} s"
                      f"{'' if not run.failures else ', FAILED'}", flush=True)
                runs.append(run)
    text = report(runs)
    (args.out / "report.md").write_text(text + "\n")
    summary = results(runs, args, commit)
    for path in [args.out / "summary.json", *([args.json] if args.json else [])]:
        path.write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 1 if any(r.failures for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
