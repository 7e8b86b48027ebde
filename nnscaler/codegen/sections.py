"""Forward body layout: one section per block, source lines as comments, recompute regions as
nested functions run under torch.utils.checkpoint, and a `del` after each intermediate's last use
(nnscaler.codegen.liveness) so the forward holds no more memory than the eager module."""

from __future__ import annotations

import re
from collections.abc import Callable

from nnscaler.codegen.expr import Formatter, statement_code
from nnscaler.codegen.liveness import add_dels, aliasing_op
from nnscaler.codegen.safe_text import comment_text
from nnscaler.graph.ir import Ref, iter_refs
from nnscaler.partition import Program, Statement

__all__ = ["build_sections"]


def section_of(path: str) -> str:
    """The block a statement belongs to: the module path up to and including its first layer index."""
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def _region_of(path: str, recompute: tuple[str, ...]) -> str | None:
    for r in recompute:
        if r == "" or path == r or path.startswith(r + "."):
            return r
    return None


def _reads(s: Statement) -> list[str]:
    return [r.name for r in iter_refs((s.args, s.kwargs))]


def build_sections(
    program: Program, fmt: Formatter, trailing: Callable[[Statement], str], line_cls, section_cls
):
    """Sections of CodeLines for the forward; returns (sections, uses_checkpoint)."""
    recompute = tuple(getattr(program, "recompute", ()))
    stmts = program.statements
    last_use: dict[str, int] = {}
    for i, s in enumerate(stmts):
        for name in _reads(s):
            last_use[name] = i
    for r in iter_refs(program.outputs):
        last_use[r.name] = len(stmts)
    sections: list = []
    state = {"source": None}
    uses_checkpoint = False
    alias_of: dict[int, str] = {}  # id(line) -> the name its outputs are views of

    def new_line(s: Statement, indent: int) -> None:
        title = section_of(s.module_path)
        if not sections or sections[-1].key != title:
            cls = program.module_classes.get(title, s.module_class)
            heading = comment_text(f"{title} ({cls})") if title else "top level"
            sections.append(section_cls(heading, key=title))
            state["source"] = None
        comments = []
        if s.source and s.source != state["source"]:
            comments.append(comment_text(s.source))
            state["source"] = s.source
        context = "rng.shard_rng(tp, self.device)" if s.shard_rng else ""
        line = line_cls(comments, statement_code(s, fmt), trailing(s), s.no_grad, context, indent)
        sections[-1].lines.append(line)
        base = s.args[0] if s.args else None
        if (
            s.kind == "op"
            and isinstance(base, Ref)
            and base.name not in fmt.param_names
            and aliasing_op(s.op)
        ):
            alias_of[id(line)] = base.name

    i = 0
    while i < len(stmts):
        region = _region_of(stmts[i].module_path, recompute) if recompute else None
        j = i + 1
        while region is not None and j < len(stmts) and _region_of(stmts[j].module_path, recompute) == region:
            j += 1
        block = stmts[i:j]
        if region is None:
            new_line(stmts[i], 0)
            i += 1
            continue
        defined = [o for s in block for o in s.outputs]
        defined_set = set(defined)
        ins = list(
            dict.fromkeys(
                n for s in block for n in _reads(s) if n not in defined_set and n not in fmt.param_names
            )
        )
        outs = [o for o in defined if last_use.get(o, -1) >= j]
        if not outs:
            for s in block:
                new_line(s, 0)
            i = j
            continue
        uses_checkpoint = True
        fn = "recompute_" + (re.sub(r"\W", "_", region) or "model")
        new_line(block[0], 1)  # opens the block's section; the def line goes in front of it
        first = sections[-1].lines.pop()
        note = comment_text(
            f"recomputed in backward (pas_config recompute_modules): {region or 'the whole model'}"
        )
        sections[-1].lines.append(line_cls([note], f"def {fn}({', '.join(ins)}):", "", False, "", 0))
        sections[-1].lines.append(first)
        for s in block[1:]:
            new_line(s, 1)
        ret = ", ".join(outs)
        sections[-1].lines.append(line_cls([], f"return {ret}", "", False, "", 1))
        extra = ["use_reentrant=False"]
        if any(s.shard_rng or s.op.startswith("rng.") for s in block):
            # the shard generator is not one torch.utils.checkpoint restores: replay it explicitly
            extra.append("context_fn=rng.recompute_contexts(tp, self.device)")
        call_args = ", ".join([fn, *ins, *extra])
        sections[-1].lines.append(line_cls([], f"{ret} = ckpt.checkpoint({call_args})", "", False, "", 0))
        i = j
    # free each intermediate after its last use; what the return line reads stays
    keep = {n for r in iter_refs(program.outputs) for n in (r.name, fmt(r))}
    add_dels(sections, keep, lambda code, indent: line_cls([], code, "", False, "", indent), alias_of)
    return sections, uses_checkpoint
