"""The lines a generated file is made of, as plain data: shard registrations and forward code lines."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ShardLine", "CodeLine", "Section"]


@dataclass
class ShardLine:
    code: str
    comment: str
    indent: int = 0
    """Extra indentation levels (inside a `for i in range(...)` loop over repeated layers)."""


@dataclass
class CodeLine:
    comments: list[str]
    code: str
    trailing: str = ""
    no_grad: bool = False
    context: str = ""
    """A `with` block around the line (torch.no_grad(), the shard generator)."""
    indent: int = 0
    """Extra indentation levels (inside a recompute function)."""


@dataclass
class Section:
    title: str
    lines: list[CodeLine] = field(default_factory=list)
    key: str = ""


def plain_line(code: str, indent: int = 0, comments: list[str] | None = None) -> CodeLine:
    """A line without trailing comment or `with` block."""
    return CodeLine(comments or [], code, "", False, "", indent)
