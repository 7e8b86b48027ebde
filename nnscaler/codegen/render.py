"""Render gencode{rank}.py with Jinja (StrictUndefined) and check it parses before writing."""

from __future__ import annotations

import ast
from pathlib import Path

import jinja2

from nnscaler.codegen.view_model import ModuleView
from nnscaler.errors import CodegenError

__all__ = ["render_module"]

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


def render_module(view: ModuleView) -> str:
    text = _ENV.get_template("gencode.py.j2").render(view=view)
    try:
        ast.parse(text)
    except SyntaxError as exc:
        raise CodegenError(f"generated code for rank {view.rank} does not parse: {exc}") from exc
    return text
