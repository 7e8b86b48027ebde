"""Sizes that may change between calls: torch.export's symbols renamed after the inputs they come from.

With dynamic dims, torch.export describes every size derived from an input's shape as a sympy
expression over symbols (`s95 * s75`). The generated forward binds one name per input dim
(`idx_size0 = idx.shape[0]`), so each symbol is renamed after the first input dim that carries it
and expressions are printed as Python code over those names. Conditions export found on the sizes
(value ranges, assertions) become ShapeRules that the generated forward checks before it runs.
"""

from __future__ import annotations

import logging
from typing import Any

import sympy
import torch

from nnscaler.errors import TraceError
from nnscaler.graph.ir import ShapeRule, SymExpr

__all__ = ["SizeNames", "dynamic_shapes_spec"]

logger = logging.getLogger(__name__)

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def dynamic_shapes_spec(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch.export `dynamic_shapes` marking every dim of every tensor input Dim.AUTO (export keeps a
    dim fixed where the model needs it fixed, e.g. a feature dim matched against a weight).

    A dim of size 0 or 1 is left fixed: export would fix it anyway (its 0/1 specialization) and warn
    "dimension ... 0/1 specialized; Dim.AUTO was specified" for every such input on every trace. One
    debug line of the `nnscaler` logger names those dims instead.
    """
    from torch.export import Dim
    from torch.utils import _pytree as pytree

    fixed: list[str] = []

    def spec(name: str, v: Any) -> Any:
        def leaf(path: Any, t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.dim():
                return None
            small = [i for i, size in enumerate(t.shape) if size in (0, 1)]
            fixed.extend(f"{name}{pytree.keystr(path)} dim {i}" for i in small)
            return {i: Dim.AUTO for i in range(t.dim()) if i not in small}

        return pytree.tree_map_with_path(leaf, v)

    out = {k: spec(k, v) for k, v in kwargs.items()}
    if fixed:
        logger.debug(
            "dummy inputs with size 0 or 1 are traced with that size fixed (calls must use it): %s",
            ", ".join(fixed),
        )
    return out


def _printer():
    try:  # torch's printer knows its own sympy functions (FloorDiv, PythonMod, ...)
        from torch.utils._sympy.printers import PythonPrinter

        return PythonPrinter()
    except ImportError:  # pragma: no cover - older torch: sympy's own rendering
        return None


class SizeNames:
    """Maps export's size symbols to names of input dims and renders expressions as Python code."""

    def __init__(self) -> None:
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}
        self.names: dict[str, list] = {}  # size name -> [input value, dim]
        self._printer = _printer()

    def bind_input(self, value_name: str, tensor: torch.Tensor) -> None:
        """Name the symbols first seen in this input's dims `<input>_size<dim>`."""
        for d, size in enumerate(tensor.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in self.symbols:
                    name = f"{value_name}_size{d}"
                    self.symbols[expr] = sympy.Symbol(name, integer=True, positive=True)
                    self.names[name] = [value_name, d]

    def code(self, expr: Any, what: str) -> str:
        """Python code of a sympy expression over the bound size names."""
        expr = sympy.sympify(expr)
        unknown = [s for s in expr.free_symbols if s not in self.symbols]
        if unknown:
            raise TraceError(
                f"{what} depends on the values in a tensor (size symbol {unknown[0]}), not only on input "
                "shapes; nnscaler cannot compute it before running the op. Make the size independent of "
                "tensor values (e.g. pad to a fixed length) or trace with ComputeConfig(constant_folding=True)"
            )
        renamed = expr.xreplace(self.symbols)
        return self._printer.doprint(renamed) if self._printer is not None else str(renamed)

    def value(self, val: Any, what: str) -> Any:
        """A SymInt / SymFloat / SymBool as a SymExpr; other values unchanged."""
        if not isinstance(val, _SYM_TYPES):
            return val
        node = val.node
        expr = node.expr
        if isinstance(expr, (sympy.Integer, sympy.Float)) or expr in (sympy.true, sympy.false):
            return _plain(expr)
        hint = node.hint if node.hint is not None else node.shape_env.size_hint(expr)
        kind = bool if isinstance(val, torch.SymBool) else float if isinstance(val, torch.SymFloat) else int
        return SymExpr(self.code(expr, what), kind(hint))

    def dim_codes(self, tensor: torch.Tensor, what: str) -> tuple[str | None, ...] | None:
        """Per dim: the code of a size that may change (None for a fixed one); None if all are fixed."""
        codes = []
        for size in tensor.shape:
            if isinstance(size, torch.SymInt) and not isinstance(size.node.expr, sympy.Integer):
                codes.append(self.code(size.node.expr, what))
            else:
                codes.append(None)
        return tuple(codes) if any(c is not None for c in codes) else None

    def range_rules(self, range_constraints: dict) -> list[ShapeRule]:
        """Bounds export found on the sizes (a model's own checks, branches taken on sizes).

        export assumes dynamic sizes are at least 2 (sizes 0 and 1 broadcast differently); that lower
        bound is not a rule here: the generated code computes every size at run time, so 1 works.
        """
        rules = []
        for sym, vr in range_constraints.items():
            if sym not in self.symbols:
                continue
            name = self.symbols[sym].name
            where = f"{self.names[name][0]} dim {self.names[name][1]}"
            lower, upper = vr.lower, vr.upper
            if isinstance(lower, sympy.Integer) and int(lower) > 2:
                rules.append(ShapeRule(f"{name} >= {int(lower)}", f"{where}: a bound found when tracing"))
            if isinstance(upper, sympy.Integer) and int(upper) < 2**62:
                rules.append(
                    ShapeRule(
                        f"{name} <= {int(upper)}",
                        f"{where}: a bound found when tracing (a size check in the model)",
                    )
                )
        return rules


def _plain(expr: Any) -> Any:
    if expr is sympy.true:
        return True
    if expr is sympy.false:
        return False
    if isinstance(expr, sympy.Integer):
        return int(expr)
    return float(expr)
