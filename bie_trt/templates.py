"""Render the jinja2 templates in the repository's `templates/` folder (shipped in the wheel
through the link `bie_trt/data/templates`)."""
from __future__ import annotations

from pathlib import Path

import jinja2

TEMPLATES_DIR = Path(__file__).parent / "data" / "templates"


def render(name: str, **context) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(name).render(**context)
