"""Repeated layers in a statement list, and what their code would look like written once.

A block is the run of statements one repeated module instance ran (its module path ends in a layer
index: `model.layers.3`). Its canonical code is its lines rendered with its own names replaced by
placeholders: each value it defines by `$v<i>` (definition order), each value it reads from before
by `$a<j>` (order of first read), each of its own weights by `$p.<name>`. `$` cannot appear in a
name, so two blocks with the same canonical code (and the same ops) compute the same thing from
corresponding inputs and weights: one function can run both.
"""

from __future__ import annotations

import keyword
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nnscaler.codegen.expr import Formatter
from nnscaler.codegen.sections import BodyStyle, reads_of, section_of, write_body
from nnscaler.partition import Statement

__all__ = ["Block", "StatementList", "find_blocks", "analyse_block", "layer_style", "signature"]


@dataclass
class StatementList:
    """One body to fold: its statements, the value names read after them, how its lines end."""

    statements: Sequence[Statement]
    keep: list[str]
    trailing: Callable[[Statement], str]
    recompute: tuple[str, ...] = ()
    module_classes: dict[str, str] = field(default_factory=dict)
    last_use: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, s in enumerate(self.statements):
            for name in reads_of(s):
                self.last_use[name] = i
        for name in self.keep:
            self.last_use[name] = len(self.statements)


@dataclass
class Block:
    body: StatementList
    start: int
    end: int
    path: str
    module_class: str
    prefix: str
    """Local names of the layer's own weights start with this (`model_layers_3_`)."""
    inputs: list[str] = field(default_factory=list)
    defined: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    own: dict[str, str] = field(default_factory=dict)
    """Weight name -> its name on the layer's parameter object p."""
    inner_recompute: tuple[str, ...] = ()
    signature: tuple = ()
    peeled: bool = False
    """The layer's leading conversions stay inline, before the call (see layer_functions)."""

    @property
    def statements(self) -> Sequence[Statement]:
        return self.body.statements[self.start : self.end]


def _numbered(path: str) -> bool:
    last = path.rsplit(".", 1)[-1]
    return bool(path) and last.isascii() and last.isdigit()


def find_blocks(body: StatementList) -> list[tuple[str, int, int]]:
    """(layer path, start, end) of each repeated layer whose statements form one run."""
    runs: list[list] = []
    for i, s in enumerate(body.statements):
        key = section_of(s.module_path)
        if runs and runs[-1][0] == key:
            runs[-1][2] = i + 1
        else:
            runs.append([key, i, i + 1])
    count = Counter(r[0] for r in runs)
    return [(k, a, b) for k, a, b in runs if _numbered(k) and count[k] == 1]


def _own_name(name: str, prefix: str) -> str | None:
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    if not tail.isidentifier() or keyword.iskeyword(tail) or tail.startswith("_"):
        return None
    return tail


def _recompute_inside(path: str, recompute: tuple[str, ...]) -> tuple[str, ...] | None:
    """The recompute regions inside the layer; None when regions both enclose and split it."""
    inner = tuple(r for r in recompute if r.startswith(path + "."))
    outer = any(r == "" or path == r or path.startswith(r + ".") for r in recompute)
    return None if inner and outer else inner


def analyse_block(body: StatementList, path: str, start: int, end: int, params: set[str]) -> Block | None:
    """The block's inputs, values, outputs and own weights; None when it cannot be a function."""
    inner = _recompute_inside(path, body.recompute)
    if inner is None or start >= end:
        return None
    first = body.statements[start]
    cls = body.module_classes.get(path, first.module_class)
    block = Block(body, start, end, path, cls, re.sub(r"\W", "_", path) + "_", inner_recompute=inner)
    defined: dict[str, None] = {}
    inputs: dict[str, None] = {}
    for s in block.statements:
        for name in reads_of(s):
            if name in params:
                attr = _own_name(name, block.prefix)
                if attr is not None:
                    block.own[name] = attr
            elif name not in defined:
                inputs[name] = None
        defined.update(dict.fromkeys(s.outputs))
    if {"p", "self"} & (inputs.keys() | defined.keys()):
        return None  # the layer function's own parameters: such a layer stays inline
    block.inputs, block.defined = list(inputs), list(defined)
    block.outputs = [n for n in block.defined if body.last_use.get(n, -1) >= end]
    return block


def layer_style(block: Block, fmt: Formatter) -> BodyStyle:
    """How a layer's body is written: one section, recompute functions named inside the layer."""
    cut = len(block.path) + 1

    def region_name(region: str) -> tuple[str, str]:
        inner = region[cut:]
        return "recompute_" + re.sub(r"\W", "_", inner), f"the layer's {inner}"

    return BodyStyle(fmt, block.body.trailing, None, region_name)


def signature(block: Block, fmt: Formatter) -> tuple:
    """The block's canonical code (see the module docstring), its ops and which values it returns."""
    names = {n: f"$v{i}" for i, n in enumerate(block.defined)}
    names.update({n: f"$a{j}" for j, n in enumerate(block.inputs)})
    names.update({n: f"$p.{attr}" for n, attr in block.own.items()})
    rendered = write_body(
        block.statements, block.outputs, block.inner_recompute, layer_style(block, fmt.renamed(names))
    )
    lines = tuple(
        (line.code, line.trailing, tuple(line.comments), line.no_grad, line.context, line.indent)
        for section in rendered.sections
        for line in section.lines
    )
    ops = tuple(s.op for s in block.statements)
    returned = tuple(block.defined.index(o) for o in block.outputs)
    return lines, ops, returned, len(block.inputs)
