"""serve (alias: run): the OpenAI-compatible server, with the options vLLM users type by habit."""
from __future__ import annotations

import copy

import click

from ..config import EngineConfig
from ..engine_format import Manifest
from ..errors import SettingsError
from ..resolve import resolve
from .group import main
from .options import (chat_template_kwargs_option, chat_template_option, device_option, host_kv_cache_option,
                      reasoning_parser_option, speculative_config)


def _check_against_engine(config: EngineConfig, manifest: Manifest, gpu_memory_utilization: float | None) -> None:
    """Refuse what the engine cannot honour before loading it (which takes a while), one replica or many."""
    try:
        resolve(config, manifest)
    except SettingsError as e:   # named as the option that set it
        raise click.BadParameter(e.detail, param_hint=f"'--{e.setting.replace('_', '-')}'") from None
    device = config.device
    if gpu_memory_utilization is not None and device != "cpu":
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            total = torch.cuda.get_device_properties(index).total_memory
            budget = manifest.plan.budget_bytes
            if budget > gpu_memory_utilization * total:
                raise click.BadParameter(
                    f"this engine's memory plan needs {budget / 2**30:.2f} GiB, more than {gpu_memory_utilization} "
                    f"of this GPU's {total / 2**30:.2f} GiB; raise it or build for a smaller profile.",
                    param_hint="'--gpu-memory-utilization'")


@click.command()
@click.argument("engine", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--engine", "engine_opt", type=click.Path(exists=True, file_okay=False),
              help="Engine directory made by `bie-trt build` (or give it as the first argument).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 serves other machines (set --api-key then).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="TCP port.")
@device_option
@click.option("--served-model-name", help="The model name /v1/models lists and every reply's model field carries "
                                          "(default: the engine's). Requests may send any name: the one engine "
                                          "answers them all.")
@click.option("--max-model-len", type=click.IntRange(min=2),
              help="Longest prompt plus completion, in tokens (default and maximum: the engine's).")
@click.option("--max-num-seqs", type=click.IntRange(min=1),
              help="Sequences decoded together (default and maximum: the engine's).")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True),
              help="Fraction of GPU memory this server may use. The memory plan is fixed when the engine is "
                   "built; serving refuses to start when that plan needs more (ignored on CPU).")
@click.option("--api-key", envvar="BIE_TRT_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer <key>' on /v1 routes (/health and /metrics stay open).")
@click.option("--max-waiting", type=click.IntRange(min=0),
              help="Requests that may wait beyond the running batch; more get 503 with Retry-After "
                   "(default: unbounded).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True),
              help="Seconds a request may run before it is aborted with 408 (default: no limit).")
@click.option("--max-request-bytes", type=click.IntRange(min=1),
              help="Request bodies above this many bytes get 413 before they are read "
                   "(default: 1 MiB plus 64 bytes a token of --max-model-len).")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM/SIGINT, seconds in-flight requests get to finish before they are aborted.")
@chat_template_option("The chat template of /v1/chat/completions instead of the checkpoint's own.")
@chat_template_kwargs_option
@reasoning_parser_option
@click.option("--skip-verify", is_flag=True,
              help="Do not check each file's sha256 against the manifest before loading (it is remembered "
                   "per file once checked, so only the first load after a change pays for it).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="Server log verbosity.")
@click.option("--json-schema-mode", default="closed", show_default=True, type=click.Choice(["closed", "lenient"]),
              help="How JSON schemas (response_format, structured_outputs, tool_choice) become grammars. closed: "
                   "no keys a schema does not declare, integers within int64, numbers within 1e15 and 6 "
                   "decimals, json.dumps' whitespace, so replies end; lenient: the schema as JSON Schema reads "
                   "it (llguidance's form). A request may say otherwise with \"json_schema_mode\".")
@host_kv_cache_option
@click.option("--kv-cache-dir", type=click.Path(file_okay=False), envvar="BIE_TRT_KV_CACHE_DIR", show_envvar=True,
              help="Directory of the KV cache's disk tier: every prompt's blocks are persisted there (one "
                   "subdirectory per engine) and read back by a later request, also after a restart. Given "
                   "here, it also turns on POST /v1/cache/save and /v1/cache/restore, which keep named cache "
                   "files in it. [default: the disk tier in ~/.cache/bie-trt/kv-cache (under $BIE_TRT_CACHE "
                   "when set), the routes off]")
@click.option("--disk-kv-cache-gb", type=click.FloatRange(min=0), metavar="GIB",
              help="Bound of the disk tier, over every engine's blocks in --kv-cache-dir: the least recently "
                   "used go first. 0 turns the disk tier off. [default: 8 GiB, at most a quarter of the free "
                   "space at start]")
@click.option("--response-store-size", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Responses API responses kept in memory (this process only, the oldest dropped first) for "
                   "previous_response_id and GET /v1/responses/{id}.")
@click.option("--reasoning-key", envvar="BIE_TRT_REASONING_KEY", show_envvar=True,
              help="The key that seals Responses API reasoning items (include: [\"reasoning.encrypted_content\"]) "
                   "for stateless clients. Default: a random key made at start, shared by this server's "
                   "replicas; items sealed before a restart then no longer open (400). Give one to keep them.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(min=1),
              help="Engine replicas behind this one endpoint, on Ray Serve (a local Ray instance unless "
                   "--ray-address), each request routed by its prompt's leading KV blocks. 1 without "
                   "--ray-address: this process serves the engine itself, without Ray.")
@click.option("--ray-address", help="Join this Ray cluster (`ray start --head` prints it) instead of starting "
                                    "one; replicas are placed on its machines, one GPU each on GPU profiles.")
@click.option("--router", "router", default="prefix-affinity", show_default=True,
              type=click.Choice(["prefix-affinity", "power-of-two"]),
              help="How replicas are picked: by the prompt's cached prefix (least-loaded when its replica is "
                   "overloaded or none holds it), or Ray Serve's default power-of-two choices.")
@click.option("--state-snapshot-interval", default=0, show_default=True, type=click.IntRange(min=0), metavar="TOKENS",
              help="A model with linear-attention layers (Qwen3.5): besides each prompt's last block boundary, save "
                   "their state every this many prompt tokens (a multiple of the KV block size) for prefix hits "
                   "of longer prompts that start the same; 0: only there. The plan fixes how many are kept.")
@speculative_config
def serve(engine: str | None, engine_opt: str | None, host: str, port: int, device: str,
          served_model_name: str | None, max_model_len: int | None, max_num_seqs: int | None,
          gpu_memory_utilization: float | None, api_key: str | None, max_waiting: int | None,
          request_timeout: float | None, max_request_bytes: int | None, shutdown_timeout: float,
          chat_template: str | None, chat_template_kwargs: dict | None, reasoning_parser: str, skip_verify: bool,
          json_schema_mode: str,
          log_level: str, host_kv_cache_gb: float | None, kv_cache_dir: str | None,
          disk_kv_cache_gb: float | None, response_store_size: int,
          reasoning_key: str | None, replicas: int, ray_address: str | None, router: str,
          state_snapshot_interval: int, speculative) -> None:
    """Serve an engine over OpenAI-compatible HTTP.

    \b
    Routes: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
    POST /v1/chat/completions, Anthropic's POST /v1/messages (and /v1/messages/count_tokens), OpenAI's
    POST /v1/responses (add "stream": true for server-sent events). Without max_tokens, a
    chat reply runs to the end of the context or the end-of-sequence token, a completion to 16 tokens
    (OpenAI's legacy default). Try:
      bie-trt serve engines/smollm2 --port 8080
      curl http://127.0.0.1:8080/v1/completions -H 'content-type: application/json' \\
           -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
    """
    if (engine is None) == (engine_opt is None):
        raise click.UsageError("give the engine directory once: as the first argument or as --engine.")
    engine_dir = engine or engine_opt
    from ..user_cache import cache_dir
    from ..engine_format import read_manifest

    manifest = read_manifest(engine_dir)
    config = EngineConfig(engine_dir=engine_dir, device=device, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs or manifest.max_num_seqs, speculative=speculative,
                          chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                          reasoning_parser=reasoning_parser, skip_verify=skip_verify, host_kv_cache_gb=host_kv_cache_gb,
                          kv_cache_dir=kv_cache_dir or str(cache_dir() / "kv-cache"),
                          disk_kv_cache_gb=disk_kv_cache_gb, state_snapshot_interval=state_snapshot_interval)
    _check_against_engine(config, manifest, gpu_memory_utilization)
    if replicas == 1 and ray_address is None and router != "prefix-affinity":
        raise click.UsageError("--router picks among replicas; give --replicas 2 or more (or --ray-address).")
    if replicas > 1 or ray_address is not None:
        from ..scale_out.cluster import require_ray

        require_ray(f"--replicas {replicas}" if replicas > 1 else "--ray-address")

    from .. import BieEngine
    from ..server.app import ServerOptions, create_app
    from ..server.sealing import new_key
    from ..server.serve import bind, serve as run_server

    options = ServerOptions(served_model_name=served_model_name, api_key=api_key, max_waiting=max_waiting,
                            request_timeout=request_timeout, max_request_bytes=max_request_bytes,
                            kv_cache_dir=kv_cache_dir,
                            response_store_size=response_store_size, json_schema_mode=json_schema_mode,
                            reasoning_key=reasoning_key or new_key())
    listener = bind(host, port)   # before the engines load: a port in use fails now, not minutes later
    try:
        if replicas == 1 and ray_address is None:
            bie = BieEngine(config)
            click.echo(f"serving {served_model_name or bie.model_name} (max_model_len {bie.max_model_len}, "
                       f"max_num_seqs {bie.max_num_seqs}) on http://{host}:{port}", err=True)
            try:
                run_server(create_app(bie, options), host, port, log_level, shutdown_timeout, sock=listener)
            finally:
                bie.close()   # the disk tier's writes handed over so far land before the process ends
            return
        from ..scale_out.cluster import ScaleOut, ScaleOutOptions

        cluster = ScaleOut(config, options, ScaleOutOptions(replicas, ray_address, router,
                                                            shutdown_timeout=shutdown_timeout))
        try:
            app = cluster.start()
            click.echo(f"serving {served_model_name or manifest.model_name} on {replicas} replicas "
                       f"({router} routing) on http://{host}:{port}", err=True)
            run_server(app, host, port, log_level, shutdown_timeout, sock=listener)
        finally:
            cluster.stop()
    finally:
        listener.close()

main.add_command(serve)
run = copy.copy(serve)   # the name earlier releases used
run.name, run.short_help = "run", "Same as `serve` (kept for scripts that use this name)."
main.add_command(run)
