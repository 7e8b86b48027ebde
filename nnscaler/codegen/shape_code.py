"""Lines of the generated forward that deal with sizes that may change between calls.

The forward first binds one name per input dim whose size may vary (`idx_size0`), checking fixed
dims against their traced size; then it checks the rules the trace and the plan put on those sizes
(`idx_size0 % 2 == 0` when the batch is split two ways). Every size the code computes (view shapes,
arange ends) is an expression over these names.

With constant_folding=True (Program.static_shapes) the sizes the code computes with are written as
their traced values instead, and the input dims they read are fixed to their traced sizes
(`folded_sizes`); dims the code never computes with, and the rules that only check sizes, stay open.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from nnscaler.graph.ir import ShapeRule, TensorMeta
from nnscaler.graph.ir.code_fields import sym_codes

__all__ = [
    "folded_sizes",
    "size_check_lines",
    "rule_check_lines",
    "shape_code",
    "sizes_read",
    "uses_math",
]

_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _names_in(code: str) -> list[str]:
    return list(dict.fromkeys(_NAME.findall(code)))


def folded_sizes(
    fold: bool, statements: Iterable[Any], others: Iterable[Any], size_names: dict[str, list]
) -> frozenset[str]:
    """constant_folding=True: the size names read by the run-time sizes the code computes with (the
    statements' arguments, `others`: outputs and TensorMetas of buffers the code allocates), each
    written as its traced value; else none."""
    if not fold:
        return frozenset()
    objs: list[Any] = [(s.args, s.kwargs) for s in statements]
    for obj in others:
        objs += [c for c in obj.sym or () if c is not None] if isinstance(obj, TensorMeta) else [obj]
    return frozenset(sizes_read(objs, size_names))


def size_check_lines(
    input_meta: dict[str, TensorMeta | None],
    size_names: dict[str, list],
    static: bool,
    folded: frozenset[str] = frozenset(),
) -> list[str]:
    """`a_size0, _ = self.input_sizes("a", a, (None, 16))` per tensor input, in input order.

    `static` (constant_folding=True): dims whose size names are in `folded` must have their traced
    size (`static=(0,)` names them for the error message); when no dim may change at all, every size
    is fixed (`static=True`)."""
    lines: list[str] = []
    extra: list[ShapeRule] = []
    bound: set[str] = set()
    all_fixed = static and not any(m is not None and m.sym for m in input_meta.values())
    for name, meta in input_meta.items():
        if meta is None:
            continue
        targets, expected, fixed = [], [], []
        for d, size in enumerate(meta.shape):
            code = None if meta.sym is None else meta.sym[d]
            if code is not None and folded.intersection(_names_in(code)):
                fixed.append(d)
            if code is None:
                targets.append("_")
                expected.append(str(size))
            elif size_names.get(code) == [name, d]:
                targets.append(code)
                expected.append(str(size) if code in folded else "None")
            elif all(n in bound for n in _names_in(code) if n in size_names):
                targets.append("_")
                expected.append(code)
            else:  # equal to a size of this same input: compared once it is bound
                targets.append("_")
                expected.append("None")
                extra.append(ShapeRule(f"{name}.shape[{d}] == {code}", f"dims of {name} that must be equal"))
        bound.update(t for t in targets if t != "_")
        tuple_code = "(" + ", ".join(expected) + ("," if len(expected) == 1 else "") + ")"
        how = ", static=True" if all_fixed else f", static={tuple(fixed)}" if fixed else ""
        call = f'self.input_sizes("{name}", {name}, {tuple_code}{how})'
        if any(t != "_" for t in targets):
            lhs = ", ".join(targets) + ("," if len(targets) == 1 else "")
            lines.append(f"{lhs} = {call}")
        else:
            lines.append(call)
    return lines + rule_check_lines(extra, size_names, input_meta)


def rule_check_lines(
    rules: Iterable[ShapeRule], size_names: dict[str, list], input_names: Iterable[str] = ()
) -> list[str]:
    """`self.check_shape(<rule>, "<rule>", "<why>", {inputs it reads})` per rule, without repeats."""
    lines = []
    inputs_named = set(input_names)
    for rule in dict.fromkeys(rules):
        names = _names_in(rule.code)
        inputs = [
            size_names[n][0] if n in size_names else n for n in names if n in size_names or n in inputs_named
        ]
        inputs = list(dict.fromkeys(inputs))
        given = "{" + ", ".join(f'"{n}": {n}' for n in inputs) + "}"
        lines.append(f"self.check_shape({rule.code}, {rule.code!r}, {rule.why!r}, {given})")
    return lines


def shape_code(meta: TensorMeta, fold: bool = False) -> str:
    """A tuple expression of a tensor's full shape (run-time sizes by name; `fold`: traced sizes)."""
    dims = [
        str(s) if fold or meta.sym is None or meta.sym[d] is None else meta.sym[d]
        for d, s in enumerate(meta.shape)
    ]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def sizes_read(objs: Iterable[Any], size_names: dict[str, list]) -> list[str]:
    """The size names the run-time sizes in `objs` (statement args, metas' codes) read, sorted."""
    found = set()
    for obj in objs:
        codes = [obj] if isinstance(obj, str) else sym_codes(obj)
        for code in codes:
            found.update(n for n in _names_in(code) if n in size_names)
    return sorted(found)


def uses_math(objs: Iterable[Any]) -> bool:
    """Whether any run-time size expression calls the math module (ceil, floor, sqrt)."""
    return any("math." in code for obj in objs for code in sym_codes(obj))
