"""Forward body layout: one section per block, source lines as comments, recompute regions as
nested functions run under torch.utils.checkpoint, and a `del` after each intermediate's last use
(nnscaler.codegen.liveness) so the forward holds no more memory than the eager module.

The same writer lays out a layer function's body (nnscaler.codegen.layer_functions): one section,
its recompute regions named relative to the layer."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from nnscaler.codegen.expr import Formatter, statement_code
from nnscaler.codegen.layer_call import LayerCall, is_random
from nnscaler.codegen.lines import CodeLine, Section, plain_line
from nnscaler.codegen.liveness import add_dels, aliasing_op
from nnscaler.codegen.safe_text import comment_text
from nnscaler.graph.ir import Ref, iter_refs
from nnscaler.partition import Program, Statement

__all__ = ["BodyStyle", "Body", "build_sections", "section_of", "write_body", "reads_of"]


def section_of(path: str) -> str:
    """The block a statement belongs to: the module path up to and including its first layer index."""
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def default_region_name(region: str) -> tuple[str, str]:
    """(name of the recompute function, what the comment above it says it recomputes)."""
    return "recompute_" + (re.sub(r"\W", "_", region) or "model"), region or "the whole model"


def _region_of(path: str, recompute: tuple[str, ...]) -> str | None:
    for r in recompute:
        if r == "" or path == r or path.startswith(r + "."):
            return r
    return None


def reads_of(s) -> list[str]:
    """The value names a statement (or layer call) reads."""
    return [r.name for r in iter_refs((s.args, s.kwargs))]


@dataclass
class BodyStyle:
    """How one body is written: the formatter (its names), the trailing comment of a statement, the
    section headings (module classes; None: one untitled section) and the recompute functions' names."""

    fmt: Formatter
    trailing: Callable[[Statement], str]
    module_classes: dict[str, str] | None = field(default_factory=dict)
    region_name: Callable[[str], tuple[str, str]] = default_region_name


@dataclass
class Body:
    sections: list[Section]
    alias_of: dict[int, str]
    """id(line) -> the local name its outputs are views of (for liveness)."""
    uses_checkpoint: bool = False


class _Writer:
    def __init__(self, style: BodyStyle):
        self.style = style
        self.body = Body([], {})
        self.source: str | None = None

    def _section(self, s) -> None:
        classes = self.style.module_classes
        title = section_of(s.module_path) if classes is not None else ""
        sections = self.body.sections
        if not sections or sections[-1].key != title:
            cls = (classes or {}).get(title, s.module_class)
            heading = comment_text(f"{title} ({cls})") if title else "top level"
            sections.append(Section(heading, key=title))
            self.source = None

    def line(self, s, indent: int) -> None:
        self._section(s)
        fmt = self.style.fmt
        comments = []
        if s.source and s.source != self.source:
            comments.append(comment_text(s.source))
            self.source = s.source
        if isinstance(s, LayerCall):
            line = CodeLine(comments, s.code(fmt), "", False, "", indent)
        else:
            context = "rng.shard_rng(tp, self.device)" if s.shard_rng else ""
            line = CodeLine(
                comments, statement_code(s, fmt), self.style.trailing(s), s.no_grad, context, indent
            )
        self.body.sections[-1].lines.append(line)
        base = s.args[0] if s.args else None
        if (
            s.kind == "op"
            and isinstance(base, Ref)
            and base.name not in fmt.param_names
            and aliasing_op(s.op)
        ):
            self.body.alias_of[id(line)] = fmt.local(base.name)

    def region(self, block: list, region: str, outs: list[str]) -> None:
        """`block` recomputed in backward: a nested function run under torch.utils.checkpoint."""
        fmt = self.style.fmt
        self.body.uses_checkpoint = True
        defined = {o for s in block for o in s.outputs}
        params = fmt.param_names
        ins = list(
            dict.fromkeys(n for s in block for n in reads_of(s) if n not in defined and n not in params)
        )
        extra, checkpoint = ["use_reentrant=False"], "ckpt.checkpoint"
        if any(is_random(s) for s in block):
            # the shard generator is not one torch.utils.checkpoint restores: replay it explicitly
            # (rng.checkpoint: the same call, left eager by torch.compile, which takes no context_fn)
            extra.append("context_fn=rng.recompute_contexts(tp, self.device)")
            checkpoint = "rng.checkpoint"
        ret = ", ".join(fmt.local(o) for o in outs)
        fn, label = self.style.region_name(region)
        note = [comment_text(f"recomputed in backward (pas_config recompute_modules): {label}")]
        if len(block) == 1 and isinstance(block[0], LayerCall):  # a whole layer: checkpoint its function
            call = block[0]
            self._section(call)
            code = f"{call.lhs(fmt)} = {checkpoint}({', '.join([*call.call_args(fmt), *extra])})"
            self.body.sections[-1].lines.append(plain_line(code, 0, note))
            return
        names = [fmt(Ref(n)) for n in ins]
        self.line(block[0], 1)  # opens the block's section; the def line goes in front of it
        lines = self.body.sections[-1].lines
        first = lines.pop()
        lines += [plain_line(f"def {fn}({', '.join(names)}):", 0, note), first]
        for s in block[1:]:
            self.line(s, 1)
        lines = self.body.sections[-1].lines
        lines.append(plain_line(f"return {ret}", 1))
        lines.append(plain_line(f"{ret} = {checkpoint}({', '.join([fn, *names, *extra])})"))


def write_body(stmts: Sequence, keep: Iterable[str], recompute: tuple[str, ...], style: BodyStyle) -> Body:
    """Lines for `stmts` (statements and layer calls) without `del`s; `keep`: value names read after them."""
    last_use: dict[str, int] = {}
    for i, s in enumerate(stmts):
        for name in reads_of(s):
            last_use[name] = i
    for name in keep:
        last_use[name] = len(stmts)
    writer = _Writer(style)
    i = 0
    while i < len(stmts):
        region = _region_of(stmts[i].module_path, recompute) if recompute else None
        j = i + 1
        while region is not None and j < len(stmts) and _region_of(stmts[j].module_path, recompute) == region:
            j += 1
        block = stmts[i:j]
        outs = [o for s in block for o in s.outputs if last_use.get(o, -1) >= j]
        if region is None or not outs:
            for s in block:
                writer.line(s, 0)
        else:
            writer.region(list(block), region, outs)
        i = j
    return writer.body


def build_sections(
    program: Program, fmt: Formatter, trailing: Callable[[Statement], str], statements: Sequence | None = None
) -> tuple[list[Section], bool]:
    """Sections of CodeLines for the forward; returns (sections, uses_checkpoint). `statements`: the
    program's statements with repeated layers folded into layer calls (default: the statements)."""
    stmts = program.statements if statements is None else statements
    keep_values = [r.name for r in iter_refs(program.outputs)]
    style = BodyStyle(fmt, trailing, program.module_classes)
    body = write_body(stmts, keep_values, tuple(getattr(program, "recompute", ())), style)
    # free each intermediate after its last use; what the return line reads stays
    keep = {n for r in iter_refs(program.outputs) for n in (r.name, fmt(r))}
    add_dels(body.sections, keep, lambda code, indent: plain_line(code, indent), body.alias_of)
    return body.sections, body.uses_checkpoint
