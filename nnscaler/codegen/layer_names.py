"""Names inside a layer function: which names its code reads from outside (module globals, the calling
method's input sizes and process groups), and readable local names (`linear`, `linear_1`, ... as in the
first layer of a forward, whatever layer the code was taken from)."""

from __future__ import annotations

import builtins
import keyword
import re
import symtable
from collections.abc import Iterable, Sequence

from nnscaler.codegen.layer_call import PARAMS_CLASS
from nnscaler.codegen.lines import CodeLine
from nnscaler.graph.capture.input_keys import TEMPLATE_GLOBALS
from nnscaler.graph.ops import op_module
from nnscaler.graph.ops.leaf import is_leaf_op

__all__ = ["GROUP_NAME", "module_globals", "scan_names", "readable_names", "function_source"]

GROUP_NAME = re.compile(r"(tp|dp|tp_axis\d+)")
"""Process groups a generated method binds first (`tp = self.group("tp")`)."""

_MODULE_NAMES = TEMPLATE_GLOBALS | {PARAMS_CLASS}
_BUILTINS = frozenset(dir(builtins))
_DERIVED = re.compile(r"(.+)_([A-Za-z]+)")


def module_globals(statements: Iterable) -> set[str]:
    """Names a generated file binds at module level that `statements` may use: its imports (the
    modules of custom ops and autograd Functions included) and the builtins."""
    names = set(_MODULE_NAMES | _BUILTINS)
    for s in statements:
        if s.kind == "special" and "." in s.op:  # a runtime module the file imports (rng, context_parallel)
            names.add(s.op.split(".", 1)[0])
            continue
        if s.kind != "op" or s.op.startswith("aten."):
            continue
        if ":" in s.op:  # a custom autograd Function: module:Qualname.apply
            names.add(s.op.split(":", 1)[0].split(".", 1)[0])
        elif not is_leaf_op(s.op):
            module = op_module(s.op)
            if module:
                names.add(module.split(".", 1)[0])
    return names


def function_source(params: Sequence[str], lines: Sequence[CodeLine]) -> str:
    """The lines as the body of `def _f(<params>):` (comments left out), for scope analysis."""
    out = [f"def _f({', '.join(params)}):"]
    for line in lines:
        pad = "    " * (1 + line.indent)
        context = line.context or ("torch.no_grad()" if line.no_grad else "")
        if context:
            out += [f"{pad}with {context}:", f"{pad}    {line.code}"]
        else:
            out.append(pad + line.code)
    return "\n".join(out) + "\n"


def scan_names(source: str) -> tuple[set[str], set[str]]:
    """(every name the function in `source` and its nested functions use, the names they read from the
    module scope)."""
    tables = list(symtable.symtable(source, "<layer function>", "exec").get_children())
    names: set[str] = set()
    outside: set[str] = set()
    while tables:
        table = tables.pop()
        for sym in table.get_symbols():
            names.add(sym.get_name())
            if sym.is_global() and sym.is_referenced():
                outside.add(sym.get_name())
        tables.extend(table.get_children())
    return names, outside


def _fresh(base: str, used: set[str]) -> str:
    name, k = base, 0
    while name in used or keyword.iskeyword(name) or not name.isidentifier():
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def readable_names(names: Sequence[str], reserved: set[str]) -> dict[str, str]:
    """A new name for each of `names` (distinct values' names): numbered afresh by kind (`mul_16` ->
    `mul`, the next mul -> `mul_1`), a name made from another (`mul_16_tp`) made from the other's new
    name (`mul_tp`); none of them in `reserved`."""
    known = set(names)
    used = set(reserved)
    out: dict[str, str] = {}
    derived: list[tuple[str, str, str]] = []
    for n in names:
        m = _DERIVED.fullmatch(n)
        if m and m.group(1) in known:
            derived.append((n, m.group(1), m.group(2)))
            continue
        out[n] = _fresh(re.sub(r"(_\d+)+$", "", n) or n, used)
    for n, root, suffix in derived:
        out[n] = _fresh(f"{out.get(root, root)}_{suffix}", used)
    return out
