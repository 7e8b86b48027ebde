"""Opaque leaves: a method or submodule the trace cannot capture runs as one op, eagerly, in generated code.

A leaf is chosen two ways. The user names it: `pas_config={"leaf_modules": ["visual"]}` (module paths,
class names, or methods as `"model.get_image_features()"`). Or capture finds it: when torch.export
fails on data-dependent Python (`for n in sizes.tolist()`), the innermost function on the failing call
stack that is a method of a module of the model (a submodule's forward included, the top module's
forward never: leaf_regions.py) and takes and returns tensors (pytrees of tensors and literals)
becomes a leaf, and so does every other region a real run on the dummy inputs sees reading sizes from
values; then the export is retried, as often as it takes.

Each leaf traces as one `nnscaler_leaf::call` node (leaf_op.py) taking its tensor arguments and its
parameters and buffers (a leaf method: those of its module it was seen to use, leaf_records.py),
lifted under their original names, so checkpoints, merges and the gradient reducer see them; the plan
replicates it; generated code calls `nnscaler.runtime.leaf.call`, which runs the module (or method)
with `torch.func.functional_call` on the generated module's own tensors, so autograd gives its
parameters their gradients. A LeafModuleWarning names every leaf and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.errors import ConfigError, TraceError
from nnscaler.graph.capture.export import is_data_dependent
from nnscaler.graph.capture.leaf_op import (
    LEAF_OP,
    LeafSession,
    LeafUnsuitable,
    leaf_session,
    split_key,
)
from nnscaler.graph.capture.leaf_records import ensure_records, is_meta, real_run, suitable
from nnscaler.graph.capture.leaf_regions import (
    SIZE_READS,
    failure_chain,
    owner_of,
    stack_regions,
    trace_regions,
    value_reads,
)
from nnscaler.graph.capture.user_frames import user_frame
from nnscaler.graph.ir import Graph, Node

__all__ = ["LeafModuleWarning", "resolve_leaf_modules", "capture_with_leaves", "mark_leaf_nodes"]

_MAX_RETRIES = 16


class LeafModuleWarning(UserWarning):
    """A submodule runs as one opaque op (eager PyTorch, replicated on every device of the plan)."""


def resolve_leaf_modules(root: torch.nn.Module, names: Sequence[str]) -> dict[str, str]:
    """Module path -> why, for each name (a module path, or a class name: every outermost submodule
    of that class). A name that matches nothing raises ConfigError naming it and the closest paths."""
    modules = dict(root.named_modules())
    chosen: dict[str, str] = {}
    for name in names:
        if name in modules and name != "":
            chosen[name] = "named in pas_config['leaf_modules']"
            continue
        owner, method = split_key(name)
        if method is not None and owner in modules and callable(getattr(modules[owner], method, None)):
            chosen[name] = "named in pas_config['leaf_modules']"
            continue
        by_class = [
            p
            for p, m in modules.items()
            if p
            and name
            in (type(m).__name__, type(m).__qualname__, f"{type(m).__module__}.{type(m).__qualname__}")
        ]
        if not by_class:
            close = difflib.get_close_matches(name, [p for p in modules if p], n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"pas_config['leaf_modules'] names {name!r}, which is neither a submodule path (as in "
                f"model.named_modules(), e.g. 'model.visual'), a method of one ('model.get_image_features()') "
                f"nor the class name of a submodule of "
                f"{type(root).__name__}{hint}"
            )
        for path in by_class:
            chosen[path] = f"its class {name} is named in pas_config['leaf_modules']"
    return chosen


def _outermost(paths: Sequence[str]) -> list[str]:
    return [p for p in paths if not any(_inside(p, q) for q in paths if q != p)]


def _reads(root: torch.nn.Module, kwargs: dict[str, Any]) -> list[tuple[list[str], str, str]]:
    """Every read of tensor values in a real run: (regions, source line, read); none on the meta device."""
    return [] if is_meta(root, kwargs) else value_reads(root, lambda: real_run(root, kwargs))


def _outside(regions: list[str], chosen: Sequence[str]) -> bool:
    return not any(r in chosen or any(_inside(r, q) for q in chosen) for r in regions)


def _user_line(exc: BaseException) -> str:
    f = user_frame(traceback.extract_tb(exc.__traceback__))
    if f is not None:
        return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} `{(f.line or '').strip()}`"
    return "an unknown line"


def _causes(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _reads_values(program: Any, root: torch.nn.Module) -> tuple[list[str], str] | None:
    """A traced program that computes with tensor values as Python numbers (`.tolist()`, `.item()`): the
    keys of the regions around the first such node (innermost first) and its source line."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(program, torch.export.ExportedProgram):
        return None
    for node in program.graph.nodes:
        if not any(free_unbacked_symbols(v) for v in pytree.tree_leaves(node.meta.get("val"))):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        paths = [str(p) for p, _ in stack.values() if p][::-1]
        lines = re.findall(
            r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', node.meta.get("stack_trace") or ""
        )
        user = [m for m in lines if "/torch/" not in m[0] and "/nnscaler/" not in m[0]]
        where = (
            f"{user[-1][0].rsplit('/', 1)[-1]}:{user[-1][1]} `{user[-1][2].strip()}`"
            if user
            else "an unknown line"
        )
        return trace_regions(node.meta.get("stack_trace") or "", paths, root), where
    return None


class _ReadsValues(TraceError):
    """An export that worked computes with tensor values as Python numbers: (paths, source line)."""

    def __init__(self, found: tuple[list[str], str]):
        super().__init__(f"the program reads tensor values at {found[1]}")
        self.found = found


def _checked(export: Callable[[], Any], root: torch.nn.Module) -> Callable[[], Any]:
    def run() -> Any:
        program = export()
        found = _reads_values(program, root)
        if found is not None:  # before the other mode's export: it would only read them again
            raise _ReadsValues(found)
        return program

    return run


def capture_with_leaves(
    root: torch.nn.Module,
    kwargs: dict[str, Any],
    export: Callable[[], Any],
    trace: Callable[[Callable[[], Any]], Any] = lambda export: export(),
    leaf_modules: Sequence[str] = (),
    auto: bool = True,
) -> tuple[Any, dict[str, str]]:
    """`trace(export)` (one export, or one per mode) with the named leaves opaque, adding a leaf and
    retrying after each data-dependent failure inside a submodule (when `auto`). Returns what trace
    returned and {leaf path: why}."""
    chosen = resolve_leaf_modules(root, leaf_modules)
    named = set(chosen)
    fallbacks: dict[str, list[str]] = {}  # an automatic leaf -> the next candidates of its failure
    session = LeafSession()
    for _ in range(_MAX_RETRIES):
        paths = _outermost(list(chosen))
        session.leaves = {p: owner_of(root, p) for p in paths}
        if paths:  # one real run serves every module leaf found later (a new leaf method: one more)
            ensure_records(root, kwargs, session, paths)
        session.called, session.fixed = set(), set()  # what this attempt's trace does
        held, retry = io.StringIO(), False  # torch prints the partial graph of a failed export to stderr
        try:
            failure: TraceError | None = None
            try:
                with leaf_session(session), contextlib.redirect_stderr(held):
                    result = trace(_checked(export, root))
            except _ReadsValues as exc:
                # a real run shows the method around the first read outside the leaves (sizes first:
                # a truth test may be a value check, which traces)
                reads = [r for r in _reads(root, kwargs) if r[0] and _outside(r[0], list(chosen))]
                reads.sort(key=lambda r: r[2] not in SIZE_READS)
                found = reads[0][:2] if reads else exc.found
                if not auto:
                    raise TraceError(_reads_values_message(found[1], "auto_leaf_modules is False")) from None
            except TraceError as exc:
                unsuitable = next((e for e in _causes(exc) if isinstance(e, LeafUnsuitable)), None)
                if unsuitable is not None:
                    bad = next(
                        (p for p in paths if p not in named and str(unsuitable).startswith(p + " ")), None
                    )
                    if bad is None or not fallbacks.get(bad):
                        raise unsuitable from exc
                    nxt, *rest = fallbacks.pop(bad)  # the next region out from the same failure
                    chosen[nxt], fallbacks[nxt] = _why(nxt, chosen.pop(bad)), rest
                    retry = True
                    continue
                if not auto or not is_data_dependent(exc):
                    raise
                found, failure = (stack_regions(exc, root), _user_line(failure_chain(exc)[-1])), exc
            else:
                used = {p: chosen[p] for p in paths if p in session.called}
                _warn(root, session, used)
                return result, used
            if not _choose(root, kwargs, session, chosen, fallbacks, *found):
                if failure is not None:
                    raise failure
                raise TraceError(
                    _reads_values_message(found[1], "no function around it can run as an opaque op")
                )
            _choose_size_reads(root, kwargs, session, chosen, fallbacks)
            retry = True
        finally:
            if not retry:  # what this attempt printed is the user's to see; a retried one's is not
                sys.stderr.write(held.getvalue())
    raise TraceError(f"capture gave up after making {len(chosen)} regions opaque: {sorted(chosen)}")


def _choose(
    root: torch.nn.Module,
    kwargs: dict[str, Any],
    session: LeafSession,
    chosen: dict[str, str],
    fallbacks: dict[str, list[str]],
    regions: list[str],
    where: str,
) -> bool:
    """Make the innermost of `regions` (innermost first) that can run as an opaque op a leaf, the
    others its fallbacks; False when none can."""
    around = [p for p in regions if p not in chosen and not any(_inside(p, q) for q in chosen)]
    if around:  # which of them take and return tensors: a real run says
        ensure_records(root, kwargs, session, around)
    candidates = [p for p in around if suitable(p, session.records)]
    if not candidates:
        return False
    chosen[candidates[0]] = _why(candidates[0], f"has data-dependent control flow at {where}")
    fallbacks[candidates[0]] = candidates[1:]
    return True


def _choose_size_reads(
    root: torch.nn.Module,
    kwargs: dict[str, Any],
    session: LeafSession,
    chosen: dict[str, str],
    fallbacks: dict[str, list[str]],
) -> None:
    """Before tracing again: every other read of sizes from tensor values (`.tolist()`, `int(t)`) that a
    real run meets outside the leaves would fail the trace (or leave it reading values) too, so its
    region becomes a leaf now (two real runs, instead of one failed export per read). Truth tests
    (`if x.max() >= n: raise`) are left to the trace: they may be value checks (value_checks.py)."""
    reads = [(regions, where) for regions, where, read in _reads(root, kwargs) if read in SIZE_READS]
    candidates = {r for regions, _ in reads if _outside(regions, list(chosen)) for r in regions}
    ensure_records(root, kwargs, session, sorted(candidates))  # one real run for all their methods
    for regions, where in reads:
        if _outside(regions, list(chosen)):
            _choose(root, kwargs, session, chosen, fallbacks, regions, where)


def _why(key: str, why: str) -> str:
    """'forward has ...' / 'get_image_features() has ...' (`why`: either, or just 'has ...')."""
    method = split_key(key)[1]
    rest = why[4:] if why.startswith("has ") else why.split(" has ", 1)[-1] if " has " in why else why
    return f"{'forward' if method is None else method + '()'} has {rest}"


def _inside(key: str, other: str) -> bool:
    """Whether leaf `key` can only run inside leaf module `other` (a method of it or of a submodule of
    it, or a submodule). Whether a method calls a module is not known here: the trace finds out."""
    owner, method = split_key(key)
    if split_key(other)[1] is not None:
        return False
    return (method is not None and owner == other) or owner.startswith(other + ".")


def _reads_values_message(where: str, why: str) -> str:
    return (
        f"forward has data-dependent control flow at {where}: it computes with tensor values as Python numbers "
        f"(`.tolist()`, `.item()`, a loop or `if` on them), which the compiled code cannot follow, and {why}. "
        "Rewrite it with tensor ops (torch.where, masking), or name the submodule that holds it in "
        "pas_config['leaf_modules'] to run it eagerly as one op (docs/inputs.md)"
    )


def _warn(root: torch.nn.Module, session: LeafSession, leaves: dict[str, str]) -> None:
    for path, why in leaves.items():
        params = [t for _, t in session.state(path) if isinstance(t, torch.nn.Parameter)]
        numel = sum(p.numel() for p in params)
        how = (
            f"name it in pas_config['leaf_modules'] ({path!r}) to skip the failed trace, or rewrite that code "
            "with tensor ops to let it split"
            if "data-dependent" in why
            else "remove it from pas_config['leaf_modules'] to let it split"
        )
        sizes = (
            ". Its output sizes depend on input values: they are fixed to those of the dummy inputs"
            if path in session.fixed
            else ""
        )
        weights = f"{len(params)} parameters ({numel} elements)"
        if split_key(path)[1] is None:
            weights = f"its {weights}"
        elif path in session.used:
            weights = f"the {weights} it uses"
        else:  # no real run (meta weights or inputs) to see which it uses
            weights = f"all {weights} of its module (no real run on the dummy inputs showed which it uses)"
        warnings.warn(
            f"{session.describe(path)} runs as one opaque op: {why}. Generated code runs it eagerly "
            f"(PyTorch autograd) on every device of the plan, so its computation and {weights} are "
            f"replicated, not split; {how}{sizes}",
            LeafModuleWarning,
            stacklevel=4,
        )


def mark_leaf_nodes(graph: Graph, leaves: dict[str, str]) -> Graph:
    """Give each leaf node its flat tensor arguments (inputs, then state) and what codegen needs."""
    if not any(node.op == LEAF_OP for node in graph.nodes):
        return graph
    nodes = [_leaf_node(graph, node, leaves) if node.op == LEAF_OP else node for node in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes)


def _leaf_node(graph: Graph, node: Node, leaves: dict[str, str]) -> Node:
    path, spec, inputs, state = node.args
    info = json.loads(spec)
    return dataclasses.replace(
        node,
        args=(*inputs, *state),
        kwargs={
            "leaf": path,
            "in_spec": info["in_spec"],
            "constants": info["constants"],
            "inputs": len(inputs),
            "state": info["state"],
            "why": leaves.get(path, ""),
        },
        module_path=split_key(path)[0],
        source=info.get("source") or node.source,
        module_class=graph.module_classes.get(split_key(path)[0], node.module_class),
    )
