"""`bie-trt serve` (and its alias `run`) refuses bad options before loading the engine, each with one
line naming the option, and every option has help."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.engine_format import read_manifest


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("args, fragment", [
    (["--port", "99999"], "Invalid value for '--port': 99999 is not in the range 1<=x<=65535"),
    (["--port", "0"], "Invalid value for '--port'"),
    (["--max-num-seqs", "0"], "Invalid value for '--max-num-seqs': 0 is not in the range x>=1"),
    (["--max-num-seqs", "100"], "Invalid value for '--max-num-seqs': 100 is above this engine's {max_num_seqs}"),
    (["--max-model-len", "100000"],
     "Invalid value for '--max-model-len': 100000 is above this engine's {max_model_len}"),
    (["--device", "tpu"], "device 'tpu' is unknown; choose auto"),
    (["--gpu-memory-utilization", "1.5"], "Invalid value for '--gpu-memory-utilization'"),
    (["--max-waiting", "-1"], "Invalid value for '--max-waiting'"),
    (["--request-timeout", "0"], "Invalid value for '--request-timeout'"),
])
@pytest.mark.parametrize("command", ["serve", "run"])
def test_bad_options_are_refused_before_the_engine_loads(smollm2_engine, monkeypatch, command, args, fragment):
    def no_load(*a, **k):
        raise AssertionError("the engine was loaded before the options were checked")

    monkeypatch.setattr("bie_trt.BieEngine", no_load)
    result = CliRunner().invoke(main, [command, str(smollm2_engine), *args])
    assert result.exit_code == 2, result.output
    assert fragment.format(**vars(read_manifest(smollm2_engine))) in result.output


def test_the_engine_is_given_once(smollm2_engine):
    both = CliRunner().invoke(main, ["serve", str(smollm2_engine), "--engine", str(smollm2_engine)])
    neither = CliRunner().invoke(main, ["serve"])
    for result in (both, neither):
        assert result.exit_code == 2 and "give the engine directory once" in result.output


@pytest.mark.parametrize("command", ["serve", "run"])
def test_every_option_has_help(command):
    cmd = main.get_command(None, command)
    missing = [p.name for p in cmd.params if getattr(p, "help", "") == "" or
               (p.param_type_name == "option" and not p.help)]
    assert not missing


def test_the_manifest_is_read_once_before_the_engine_loads(smollm2_engine, monkeypatch):
    """The option checks and the default max_num_seqs come from one read of manifest.json."""
    import bie_trt.engine_format as ef

    reads, loaded = [], []
    real_read = ef.read_manifest

    def counted(engine_dir):
        reads.append(engine_dir)
        return real_read(engine_dir)

    def stop_at_load(config):
        loaded.append((len(reads), config.max_num_seqs))
        raise KeyboardInterrupt   # ends the command before any server starts

    monkeypatch.setattr(ef, "read_manifest", counted)
    monkeypatch.setattr("bie_trt.BieEngine", stop_at_load)
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--max-model-len", "64", "--port", free_port()])
    assert loaded == [(1, real_read(smollm2_engine).max_num_seqs)]


def test_chat_template_and_skip_verify_reach_the_engine(smollm2_engine, monkeypatch, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    loaded = []

    def stop_at_load(config):
        loaded.append(config)
        raise KeyboardInterrupt   # ends the command before any server starts

    monkeypatch.setattr("bie_trt.BieEngine", stop_at_load)
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--chat-template", str(template), "--skip-verify",
                              "--port", free_port()])
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--port", free_port()])
    assert [(c.chat_template, c.skip_verify) for c in loaded] == [(str(template), True), (None, False)]


def fake_engine(config):
    """What serve reads of an engine before it builds the app."""
    return SimpleNamespace(config=config, model_name="m", max_model_len=1, max_num_seqs=1, close=lambda: None)


def test_the_disk_tier_is_on_by_default_and_its_options_reach_the_engine(tiny_engine, monkeypatch, tmp_path):
    """Under the user cache unless told; --kv-cache-dir (or its variable) moves it and turns on the cache-file
    routes; --disk-kv-cache-gb bounds it, 0 turns it off."""
    seen = []

    def stop_at_app(engine, options):
        seen.append((engine.config.kv_cache_dir, engine.config.disk_kv_cache_gb, options.kv_cache_dir))
        raise KeyboardInterrupt   # ends the command before any server starts

    monkeypatch.setattr("bie_trt.BieEngine", fake_engine)
    monkeypatch.setattr("bie_trt.server.app.create_app", stop_at_app)
    monkeypatch.delenv("BIE_TRT_KV_CACHE_DIR")
    monkeypatch.setenv("BIE_TRT_CACHE", str(tmp_path / "cache"))
    serve = ["serve", str(tiny_engine), "--port", free_port()]
    CliRunner().invoke(main, serve)
    CliRunner().invoke(main, serve + ["--kv-cache-dir", str(tmp_path / "kv"), "--disk-kv-cache-gb", "0.5"])
    CliRunner().invoke(main, serve + ["--disk-kv-cache-gb", "0"])
    monkeypatch.setenv("BIE_TRT_KV_CACHE_DIR", str(tmp_path / "env"))
    CliRunner().invoke(main, serve)
    default = str(tmp_path / "cache" / "kv-cache")
    assert seen == [(default, None, None), (str(tmp_path / "kv"), 0.5, str(tmp_path / "kv")), (default, 0.0, None),
                    (str(tmp_path / "env"), None, str(tmp_path / "env"))]


def test_template_variables_and_reasoning_parser_reach_the_server(smollm2_engine, monkeypatch):
    """--chat-template by a shipped name, --chat-template-kwargs and --reasoning-parser into the engine (its
    thinking budgets and the server's split use that one parser); a bad JSON object is refused before anything
    loads."""
    seen = []

    def stop_at_app(engine, options):
        seen.append((engine.config.chat_template, engine.config.chat_template_kwargs, engine.config.reasoning_parser))
        raise KeyboardInterrupt   # ends the command before any server starts

    monkeypatch.setattr("bie_trt.BieEngine", fake_engine)
    monkeypatch.setattr("bie_trt.server.app.create_app", stop_at_app)
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--chat-template", "qwen3", "--chat-template-kwargs",
                              '{"enable_thinking": false}', "--reasoning-parser", "deepseek_r1", "--port", free_port()])
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--port", free_port()])
    assert seen == [("qwen3", {"enable_thinking": False}, "deepseek_r1"), (None, None, "auto")]
    r = CliRunner().invoke(main, ["serve", str(smollm2_engine), "--chat-template-kwargs", '"x"', "--port", free_port()])
    assert r.exit_code == 2 and "'--chat-template-kwargs': must be a JSON object of chat template variables" in r.output


def test_a_port_in_use_is_refused_before_the_engine_loads(smollm2_engine, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the engine was loaded before the port was taken")

    monkeypatch.setattr("bie_trt.BieEngine", no_load)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        r = CliRunner().invoke(main, ["serve", str(smollm2_engine), "--port", port])
    assert r.exit_code == 2, r.output
    assert f"port {port} on 127.0.0.1 is already in use; stop what listens there or pick another --port." in r.output


def test_json_schema_mode_reaches_the_server(smollm2_engine, monkeypatch):
    seen = []

    def stop_at_app(engine, options):
        seen.append(options.json_schema_mode)
        raise KeyboardInterrupt   # ends the command before any server starts

    monkeypatch.setattr("bie_trt.BieEngine", fake_engine)
    monkeypatch.setattr("bie_trt.server.app.create_app", stop_at_app)
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--json-schema-mode", "lenient", "--port", free_port()])
    CliRunner().invoke(main, ["serve", str(smollm2_engine), "--port", free_port()])
    assert seen == ["lenient", "closed"]
    bad = CliRunner().invoke(main, ["serve", str(smollm2_engine), "--json-schema-mode", "loose"])
    assert bad.exit_code == 2 and "Invalid value for '--json-schema-mode'" in bad.output
