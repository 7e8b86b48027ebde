"""Costs as functions of the input sizes. The traced graph keeps, for every tensor dim that may change
between calls, the expression of its size over the inputs' sizes (TensorMeta.sym, e.g. 'idx_size0'
or 'idx_size1 // 2'); sympy reads them so that

- `flops_expr` gives the model's forward FLOPs as a polynomial of those sizes (batch, sequence), and
- `graph_at_sizes` gives the graph at other sizes without tracing again, so that `recost` prices a
  saved plan for a new batch size or sequence length at once.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import sympy

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, TensorMeta
from nnscaler.policies.autodist.cost import node_flops
from nnscaler.policies.plan import Plan

__all__ = ["size_symbols", "symbolic_shape", "flops_expr", "graph_at_sizes", "recost"]


def size_symbols(graph: Graph) -> dict[str, sympy.Symbol]:
    """The size names the graph's shapes are written in (e.g. idx_size0), as positive integer symbols."""
    names: set[str] = set()
    for value in graph.values.values():
        for expr in (value.meta.sym or ()) if value.meta is not None else ():
            if expr is not None:
                names |= {s.name for s in _parse(expr, ()).free_symbols}
    return {n: sympy.Symbol(n, integer=True, positive=True) for n in sorted(names)}


@functools.lru_cache(maxsize=4096)
def _parse(expr: str, names: tuple[str, ...]) -> sympy.Expr:
    local = {n: sympy.Symbol(n, integer=True, positive=True) for n in names}
    return sympy.sympify(expr, locals=local)


def symbolic_shape(meta: TensorMeta, symbols: dict[str, sympy.Symbol]) -> tuple:
    """The shape with every dim that may change as its sympy expression (fixed dims stay ints)."""
    if not meta.sym:
        return tuple(meta.shape)
    names = tuple(symbols)
    return tuple(d if e is None else _parse(e, names) for d, e in zip(meta.shape, meta.sym))


def _with_shapes(graph: Graph, shape_of) -> Graph:
    """A new graph like `graph` whose tensor metas have the shapes `shape_of(meta)` (nodes are shared;
    facts cached for the original are not, being per graph object)."""
    values = {
        name: (replace(v, meta=replace(v.meta, shape=shape_of(v.meta))) if v.meta is not None else v)
        for name, v in graph.values.items()
    }
    return replace(graph, values=values)


def flops_expr(graph: Graph) -> sympy.Expr:
    """Forward FLOPs of one call as a polynomial of the input sizes (see cost.node_flops)."""
    symbols = size_symbols(graph)
    sym_graph = _with_shapes(graph, lambda meta: symbolic_shape(meta, symbols))
    total = sum((node_flops(n, sym_graph) for n in graph.nodes), sympy.Integer(0))
    return sympy.expand(sympy.nsimplify(total, rational=True))  # whole coefficients, not 2.0 * ...


def graph_at_sizes(graph: Graph, sizes: dict[str, int]) -> Graph:
    """The graph as if traced with inputs of `sizes` (size name -> value; names not given keep their
    traced values). Raises PlanError naming unknown sizes."""
    symbols = size_symbols(graph)
    unknown = sorted(set(sizes) - set(symbols))
    if unknown:
        raise PlanError(f"sizes {unknown} are not sizes of this graph's inputs; its sizes: {sorted(symbols)}")
    traced = _traced_sizes(graph, symbols)
    subs = {symbols[n]: int(sizes.get(n, traced[n])) for n in symbols}

    def shape_of(meta: TensorMeta) -> tuple[int, ...]:
        return tuple(int(sympy.sympify(d).subs(subs)) for d in symbolic_shape(meta, symbols))

    return _with_shapes(graph, shape_of)


def _traced_sizes(graph: Graph, symbols: dict[str, sympy.Symbol]) -> dict[str, int]:
    """Each size name's traced value, read off an input dim that is exactly that name."""
    out: dict[str, int] = {}
    for value in graph.values.values():
        if value.meta is None or not value.meta.sym:
            continue
        for dim, expr in zip(value.meta.shape, value.meta.sym):
            if expr in symbols and expr not in out:
                out[expr] = dim
    missing = sorted(set(symbols) - set(out))
    if missing:
        raise PlanError(f"cannot read the traced value of sizes {missing} off the graph's tensors")
    return out


def recost(graph: Graph, cfg: ComputeConfig, plan: Plan, sizes: dict[str, int]):
    """The predicted step time and memory (a search.Candidate) of `plan` at input `sizes`, without
    tracing again: the graph's shapes are re-evaluated and the plan is costed on them."""
    from nnscaler.policies.autodist.cp_search import evaluate_any_plan
    from nnscaler.policies.autodist.policy import planner_setup

    resized = graph_at_sizes(graph, sizes)
    return evaluate_any_plan(resized, planner_setup(resized, cfg), plan)
