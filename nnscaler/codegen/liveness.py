"""Liveness of local names in the generated forward: which names to `del` after which line, so that the
forward frees each intermediate after its last use, as eager Python frees a temporary once nothing
refers to it.

Two layers:
- `dels_after(lines, keep, alias_of)`: straight-line code given as the names each line reads and binds.
- `add_dels(sections, ...)`: the forward body as codegen builds it (sections of CodeLines, with nested
  `def recompute_...(...):` blocks indented one level); each `def` is its own scope, and what it reads
  from the enclosing scope is never deleted there (torch.utils.checkpoint runs the function again in
  backward, long after the enclosing forward returned).

Names are deleted only if the code analysed binds them first: names bound before (forward arguments,
input sizes, `self`, modules) are never deleted, nor are the names in `keep` (what the code after the
analysed lines reads: the return line).

A view does not own memory: deleting it frees nothing while its base lives. So a name whose line makes
a view of another local name (`alias_of`) is deleted together with that base, in one `del` after the
last use of any of them; this keeps the `del` lines few and where memory is really released.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Uses", "line_uses", "dels_after", "add_dels", "aliasing_op"]

Uses = tuple[list[str], list[str]]
"""(names a line reads, names it binds), each in order of appearance."""

# ops whose schema says "may alias" but which copy depending on the input (reshape of a transposed
# tensor, `.contiguous()`, `.to(dtype)`): grouping them with their input could keep memory eager frees
_MAY_COPY = frozenset(
    {"reshape", "reshape_as", "flatten", "contiguous", "to", "type_as", "_to_copy", "lift_fresh"}
)


@functools.cache
def aliasing_op(op: str) -> bool:
    """Whether the aten op `op` (`aten.view.default`) always returns views of its first argument."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten" or parts[1] in _MAY_COPY:
        return False
    try:
        import torch

        overload = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
        returns = overload._schema.returns
    except (AttributeError, RuntimeError):
        return False
    return bool(returns) and all(r.alias_info is not None for r in returns)


def line_uses(code: str) -> Uses:
    """The names one line of Python code reads and binds (`self.x` reads `self`). A `def` header (with
    or without a body) binds the function's name and reads nothing here."""
    if code.rstrip().endswith(":"):
        code = code + "\n    pass"
    tree = ast.parse(code)
    reads: list[str] = []
    writes: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            writes.append(stmt.name)
            continue
        # right-hand side first: `a = f(a)` reads the old a, then binds the new one
        names = [n for n in ast.walk(stmt) if isinstance(n, ast.Name)]
        names.sort(key=lambda n: (n.lineno, n.col_offset))
        targets = {id(n) for n in names if isinstance(n.ctx, ast.Store | ast.Del)}
        reads += [n.id for n in names if id(n) not in targets]
        writes += [n.id for n in names if id(n) in targets]
    return list(dict.fromkeys(reads)), list(dict.fromkeys(writes))


def _def_params(code: str) -> list[str]:
    fn = ast.parse(code + "\n    pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    params += [x for x in (a.vararg, a.kwarg) if x is not None]
    return [p.arg for p in params]


def dels_after(
    lines: Sequence[Uses],
    keep: Iterable[str] = (),
    alias_of: Sequence[str | None] | None = None,
) -> list[list[str]]:
    """For each line, the names to delete right after it.

    A name is deleted if the lines bind it before any line reads it, it is not in `keep` (returned,
    captured by a closure, read by code after these lines) and no later line reads it; a name bound and
    never read is deleted right after the line that binds it. `alias_of[i]`: the name whose storage the
    names line i binds are views of (None: fresh tensors); a view and its base, both deleted here and
    bound once, are deleted together after the last use of either.
    """
    keep = set(keep)
    seen: set[str] = set()
    local: set[str] = set()
    nbind: dict[str, int] = {}
    for reads, writes in lines:
        seen.update(reads)
        for n in writes:
            if n not in seen:
                local.add(n)
            seen.add(n)
            nbind[n] = nbind.get(n, 0) + 1
    local -= keep

    # backward scan: the line after which each binding of a local name is dead
    live: set[str] = set()
    dies: list[list[str]] = [[] for _ in lines]
    for i in range(len(lines) - 1, -1, -1):
        reads, writes = lines[i]
        dies[i] = [n for n in dict.fromkeys([*reads, *writes]) if n in local and n not in live]
        live.difference_update(writes)
        live.update(reads)

    # views: union each (single-binding) view with its base; a group is freed once all members are dead
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    for i, (_, writes) in enumerate(lines):
        base = alias_of[i] if alias_of is not None else None
        if base is None or base not in local or nbind[base] != 1:
            continue  # a view of a name not deleted here (or rebound) is freed on its own
        for n in writes:
            if n != base and n in local and nbind[n] == 1 and find(n) != find(base):
                parent[find(n)] = find(base)
    groups: dict[str, list[str]] = {}
    for n in local:
        groups.setdefault(find(n), []).append(n)
    death = {n: i for i, names in enumerate(dies) for n in names}

    out: list[list[str]] = [[] for _ in lines]
    for i, names in enumerate(dies):
        for n in names:
            root = find(n)
            members = groups.get(root, [n])
            if len(members) == 1:
                out[i].append(n)
            else:
                out[max(death.get(m, i) for m in members)].append(n)
    order: dict[str, int] = {}
    for _, writes in lines:
        for n in writes:
            order.setdefault(n, len(order))
    return [sorted(names, key=lambda n: order.get(n, 0)) for names in out]


def _scope(items: list[Any], start: int, indent: int) -> tuple[list[Any], int]:
    """Lines from `start` on at `indent` or deeper, grouped: a `def` line and its body become one
    ("def", line, body) item. Returns (items, index of the first line outside)."""
    out: list[Any] = []
    i = start
    while i < len(items) and items[i].indent >= indent:
        line = items[i]
        if line.code.startswith("def ") and line.code.rstrip().endswith(":"):
            body, i = _scope(items, i + 1, line.indent + 1)
            out.append(("def", line, body))
        else:
            out.append(("line", line))
            i += 1
    return out, i


def _line_reads(line: Any) -> Uses:
    reads, writes = line_uses(line.code)
    if getattr(line, "context", ""):
        reads = list(dict.fromkeys([*line_uses(line.context)[0], *reads]))
    return reads, writes


def _analyse(
    scope: list[Any],
    keep: set[str],
    alias_of: dict[int, str],
    dels: dict[int, list[str]],
) -> Uses:
    """Fill `dels` (id(line) -> names to delete after it) for a scope and its nested functions; return
    the names the scope reads from outside it and the names it binds."""
    uses: list[Uses] = []
    aliases: list[str | None] = []
    anchors: list[Any] = []
    keep = set(keep)
    for item in scope:
        if item[0] == "def":
            _, header, body = item
            params = _def_params(header.code)
            returned = {
                n
                for it in body
                if it[0] == "line" and it[1].code.startswith("return ")
                for n in _line_reads(it[1])[0]
            }
            inner_reads, inner_writes = _analyse(body, returned, alias_of, dels)
            free = [n for n in inner_reads if n not in params and n not in inner_writes]
            name = line_uses(header.code)[1]
            keep.update(free)  # read again when backward recomputes: never deleted out here
            keep.update(name)
            uses.append((free, name))
            aliases.append(None)
            anchors.append(None)
        else:
            line = item[1]
            uses.append(_line_reads(line))
            aliases.append(alias_of.get(id(line)))
            anchors.append(line)
    for anchor, names in zip(anchors, dels_after(uses, keep, aliases)):
        if names and anchor is not None and not anchor.code.startswith("return "):
            dels[id(anchor)] = names
    reads = list(dict.fromkeys(n for r, _ in uses for n in r))
    writes = list(dict.fromkeys(n for _, w in uses for n in w))
    return reads, writes


def add_dels(
    sections: Sequence[Any],
    keep: Iterable[str],
    make_del: Callable[[str, int], Any],
    alias_of: dict[int, str] | None = None,
) -> None:
    """Insert `del` lines into `sections` (objects with `.lines` of CodeLine-like objects: `.code`,
    `.indent`, `.context`) after the last use of each local name. `keep`: names read after the sections
    (the return line). `make_del(code, indent)` makes a line. `alias_of`: id(line) -> the name the
    line's outputs are views of."""
    flat = [line for s in sections for line in s.lines]
    scope, end = _scope(flat, 0, 0)
    assert end == len(flat), "a line is indented less than the body"
    dels: dict[int, list[str]] = {}
    _analyse(scope, set(keep), alias_of or {}, dels)
    for s in sections:
        lines = []
        for line in s.lines:
            lines.append(line)
            names = dels.get(id(line))
            if names:
                lines.append(make_del("del " + ", ".join(names), line.indent))
        s.lines[:] = lines
