"""run: the OpenAI-compatible server."""
from __future__ import annotations

import click

from . import main
from .options import speculative_config


@main.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine directory made by `bie-trt build`.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--max-num-seqs", default=8, show_default=True, type=int, help="Concurrent sequences (at most the engine's).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@speculative_config
def run(engine_dir: str, host: str, port: int, device: str, max_num_seqs: int, log_level: str, speculative) -> None:
    """Serve an engine over OpenAI-compatible HTTP.

    \b
    Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
    (add "stream": true for server-sent events). Try:
      curl http://127.0.0.1:8080/v1/completions -H 'content-type: application/json' \\
           -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
    """
    import uvicorn

    from .. import BieEngine, EngineConfig
    from ..server.app import create_app

    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device=device, max_num_seqs=max_num_seqs,
                                    speculative=speculative))
    click.echo(f"serving {engine.model_name} (max_model_len {engine.max_model_len}) on http://{host}:{port}", err=True)
    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)
