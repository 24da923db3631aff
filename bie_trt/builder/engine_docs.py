"""The engine directory's README and the CI workflow that builds engines, rendered from the repository's
jinja2 templates (`templates/*.j2`)."""
from __future__ import annotations

import jinja2

from ..chat.templates import TEMPLATES_DIR


def render(name: str, **context) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(name).render(**context)
