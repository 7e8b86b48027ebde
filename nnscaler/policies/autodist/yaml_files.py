"""Reading the planner's YAML files (cluster descriptions, partition constraints): a file that does not
parse is a ConfigError naming the file, the line and column, and what the parser expected."""

from __future__ import annotations

from pathlib import Path

import yaml

from nnscaler.errors import ConfigError

__all__ = ["read_yaml", "yaml_problem"]


def yaml_problem(exc: yaml.YAMLError) -> str:
    """'line L, column C: <what is wrong>' from a YAML error (1-based, as editors count), with where the
    construct the parser was reading began."""
    mark, context_mark = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
    if mark is None:
        return str(exc).replace("\n", " ")
    out = f"line {mark.line + 1}, column {mark.column + 1}: {problem or 'not valid YAML'}"
    if context:
        started = (
            f" started at line {context_mark.line + 1}, column {context_mark.column + 1}"
            if context_mark
            else ""
        )
        out += f" ({context}{started})"
    return out


def read_yaml(path: Path, what: str) -> object:
    """The parsed contents of `path`; `what` says what the file is for ('cluster file')."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML at {yaml_problem(exc)}") from exc
