"""Layer functions: repeated layers whose code is the same, written once.

The repeated module instances of a model (`model.layers.0`, `model.layers.1`, ...) usually run the
same ops with the same splits and the same communication. Where two or more layers' code is the same
once their local names and their own weights are renamed (nnscaler.codegen.layer_blocks), the code
becomes one method of the generated module,

    def _layer_LlamaDecoderLayer(self, p, add, to, to_1, input_ids_size1):

called once per layer with that layer's weights (`p = _LayerParams(self, "model_layers_3_")`: `p.x`
is `self.model_layers_3_x`) and its inputs, and returning the values later code reads. Layers whose
code differs stay inline. A layer whose only difference is a leading conversion of its input (the
first layer reducing the embedding's partial sums) keeps that conversion inline and calls the function.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nnscaler.codegen.expr import Formatter
from nnscaler.codegen.layer_blocks import (
    Block,
    StatementList,
    analyse_block,
    find_blocks,
    layer_style,
    signature,
)
from nnscaler.codegen.layer_call import FreeName, LayerCall, is_random
from nnscaler.codegen.layer_names import (
    GROUP_NAME,
    function_source,
    module_globals,
    readable_names,
    scan_names,
)
from nnscaler.codegen.lines import CodeLine, plain_line
from nnscaler.codegen.liveness import add_dels
from nnscaler.codegen.safe_text import docstring_text
from nnscaler.codegen.sections import write_body
from nnscaler.graph.ir import Ref

__all__ = ["LayerFunction", "LayerFunctions", "StatementList"]


@dataclass
class LayerFunction:
    """One layer function as the template writes it."""

    name: str
    params: str
    doc: str
    prologue: list[str]
    lines: list[CodeLine]
    return_code: str
    free: list[str]
    """Names the calls pass after the layer's inputs (input sizes the code reads)."""
    uses_checkpoint: bool = False


def _ops(block: Block) -> tuple[str, ...]:
    return tuple(s.op for s in block.statements)


def _describe(paths: list[str]) -> str:
    bases = {p.rsplit(".", 1)[0] for p in paths}
    indices = [int(p.rsplit(".", 1)[1]) for p in paths]
    if len(bases) == 1 and indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{paths[0]} .. {paths[-1]}"
    shown = ", ".join(paths[:3])
    return shown if len(paths) <= 3 else f"{shown}, ... ({len(paths)} layers)"


def build_function(name: str, members: list[Block], fmt: Formatter) -> LayerFunction:
    """The function running the members' shared code, written from the first whole member's statements."""
    rep = next((m for m in members if not m.peeled), members[0])
    own = {n: f"p.{a}" for n, a in rep.own.items()}
    first = write_body(rep.statements, rep.outputs, rep.inner_recompute, layer_style(rep, fmt.renamed(own)))
    lines = [line for s in first.sections for line in s.lines]
    used, outside = scan_names(function_source(["self", "p", *rep.inputs], lines))
    values = [*rep.inputs, *rep.defined]
    known = module_globals(rep.statements)
    reserved = (used - set(values)) | known | {"self", "p"}
    names = readable_names(values, reserved)
    body = write_body(
        rep.statements, rep.outputs, rep.inner_recompute, layer_style(rep, fmt.renamed({**names, **own}))
    )
    returned = [names[o] for o in rep.outputs]
    add_dels(body.sections, returned, lambda code, indent: plain_line(code, indent), body.alias_of)
    groups = sorted(n for n in outside if GROUP_NAME.fullmatch(n))
    free = sorted(n for n in outside if n not in known and not GROUP_NAME.fullmatch(n))
    params = ["self", "p", *(names[n] for n in rep.inputs), *free]
    example = next(iter(rep.own.values()), None)
    weights = f" (for {rep.path}, p.{example} is self.{rep.prefix}{example})" if example else ""
    doc = docstring_text(
        f"{_describe([m.path for m in members])} ({rep.module_class}), one call each; p: the layer's weights{weights}."
    )
    return LayerFunction(
        name,
        ", ".join(params),
        doc,
        [f'{g} = self.group("{g}")' for g in groups],
        [line for s in body.sections for line in s.lines],
        ", ".join(returned),
        free,
        body.uses_checkpoint,
    )


class LayerFunctions:
    """The layer functions of one generated file, shared by its forward or its stage methods."""

    def __init__(self, fmt: Formatter, enabled: bool = True):
        self.fmt = fmt
        self.enabled = enabled
        self.functions: list[LayerFunction] = []

    def fold(self, bodies: Sequence[StatementList]) -> list[list]:
        """Each body's statements, with every layer that shares its code with another layer (in any of
        the bodies) replaced by a LayerCall."""
        if not self.enabled:
            return [list(b.statements) for b in bodies]
        calls: dict[tuple[int, int], tuple[LayerCall, int]] = {}
        order = {id(b): i for i, b in enumerate(bodies)}
        for members in self._groups(bodies).values():
            if len(members) < 2:
                continue
            members.sort(key=lambda b: (order[id(b.body)], b.start))
            fn = build_function(self._name(members[0].module_class), members, self.fmt)
            self.functions.append(fn)
            for b in members:
                calls[(id(b.body), b.start)] = (self._call(fn, b), b.end)
        out = []
        for body in bodies:
            stmts, i = [], 0
            while i < len(body.statements):
                call, end = calls.get((id(body), i), (None, i + 1))
                stmts.append(call if call is not None else body.statements[i])
                i = end
            out.append(stmts)
        return out

    def _groups(self, bodies: Sequence[StatementList]) -> dict[tuple, list[Block]]:
        """Blocks by signature. Only blocks running the same ops as another are rendered to compare."""
        params = self.fmt.param_names
        by_ops: dict[tuple, list[Block]] = {}
        for body in bodies:
            for path, start, end in find_blocks(body):
                block = analyse_block(body, path, start, end, params)
                if block is not None:
                    by_ops.setdefault(_ops(block), []).append(block)
        for same in list(by_ops.values()):
            if len(same) == 1:
                core = self._core(same[0])
                if core is not None and _ops(core) in by_ops:
                    same.clear()
                    by_ops[_ops(core)].append(core)
        groups: dict[tuple, list[Block]] = {}
        for same in by_ops.values():
            for block in same if len(same) > 1 else ():
                block.signature = signature(block, self.fmt)
                groups.setdefault(block.signature, []).append(block)
        return groups

    def _core(self, block: Block) -> Block | None:
        """The layer without its leading conversions (kept inline before the call), or None."""
        stmts = block.body.statements
        start = block.start
        while start < block.end and stmts[start].kind == "comm":
            start += 1
        if start == block.start:
            return None
        core = analyse_block(block.body, block.path, start, block.end, self.fmt.param_names)
        if core is not None:
            core.peeled = True
        return core

    def _name(self, module_class: str) -> str:
        base = "_layer_" + re.sub(r"\W", "_", module_class.rsplit(".", 1)[-1])
        base = base if base.isidentifier() else "_layer"
        taken = {f.name for f in self.functions}
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        return name

    @staticmethod
    def _call(fn: LayerFunction, block: Block) -> LayerCall:
        args = (*(Ref(n) for n in block.inputs), *(FreeName(n) for n in fn.free))
        uses_rng = any(is_random(s) for s in block.statements)
        return LayerCall(
            fn.name, block.prefix, args, list(block.outputs), block.path, block.module_class, uses_rng
        )
