"""Make the captured graph follow train()/eval(): trace in both modes and mark what differs.

torch.export bakes the module's mode into the program: dropout's `train` and batch norm's
`training` arguments are literals, and batch norm's `num_batches_tracked += 1` appears only when
traced in train mode. The module is traced once in each mode and the two programs are compared
node by node. Where they differ only in literal arguments, those become ModeValues (rendered as
`self.training` in generated code) and train mode's extra buffer counters are added `1 if training
else 0`; the train-mode program is kept, because eval mode's dropout returns its input and can
leave consumers wired to the dropout instead of its input.

Where the programs differ in their ops or wiring, forward branches in Python on `self.training`: the
generated code cannot follow that branch. The program of the module's own mode is kept with the mode
baked in, and a ModeWarning names the source lines where the two modes part.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
import torch.fx

from nnscaler.errors import TraceError
from nnscaler.graph.capture.mode_probe import modes_trace_alike
from nnscaler.graph.capture.mode_reads import reads_training
from nnscaler.graph.ir import ModeValue

__all__ = ["ModeWarning", "mark_mode_arguments", "trace_both_modes"]

_MISSING = object()
_SCALARS = (bool, int, float, type(None))
# ops that return their input as-is when their mode argument is False (eval mode)
_IDENTITY_IN_EVAL = {
    "aten.dropout.default": 2,
    "aten.alpha_dropout.default": 2,
    "aten.feature_dropout.default": 2,
    "aten.feature_alpha_dropout.default": 2,
}
# ops that return their input's values, which a trace records only where the layout asks for them
_PASSTHROUGH = {"aten.contiguous.default", "aten.alias.default"}
_COUNTER_OPS = {"aten.add_.Tensor", "aten.add_.Scalar"}


class ModeWarning(UserWarning):
    """forward branches in Python on self.training: the compiled module runs in its traced mode only."""


class _Differ(Exception):
    """The two traces part here."""


def _source(node: torch.fx.Node | None) -> str:
    if node is None:
        return "the end of forward"
    trace = node.meta.get("stack_trace") or ""
    found = list(re.finditer(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace))
    user = [m for m in found if "/torch/" not in m.group(1)]
    if not (user or found):
        return f"node {node.name} ({node.target})"
    m = (user or found)[-1]
    return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} `{m.group(3).strip()}` ({node.target})"


def _walk(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every node, with the bodies of higher-order ops (get_attr submodules) inlined after them."""
    out = []
    for node in gm.graph.nodes:
        out.append(node)
        if node.op == "call_function":
            for a in node.args:
                if isinstance(a, torch.fx.Node) and a.op == "get_attr":
                    sub = getattr(gm, str(a.target), None)
                    if isinstance(sub, torch.fx.GraphModule):
                        out.extend(_walk(sub))
    return out


def _schema_values(node: torch.fx.Node) -> list[tuple[Any, Any]] | None:
    """(schema argument, value or _MISSING) per argument of an aten-style op; None for other targets."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            value = _MISSING
        out.append((arg, value))
    return out


class _Comparison:
    def __init__(self, train: torch.export.ExportedProgram, eval_: torch.export.ExportedProgram):
        self.train, self.eval = train, eval_
        self.match: dict[torch.fx.Node, torch.fx.Node] = {}
        self.root: dict[torch.fx.Node, torch.fx.Node] = {}
        self.edits: list[tuple[torch.fx.Node, int | str, ModeValue]] = []
        self.counters: list[torch.fx.Node] = []
        buffers = {s.arg.name for s in train.graph_signature.input_specs if s.kind.name == "BUFFER"}
        self.buffers = buffers

    def run(self) -> tuple[torch.fx.Node | None, torch.fx.Node | None] | None:
        """None when the programs agree up to literal arguments; else the first nodes that differ."""
        t_nodes, e_nodes = _walk(self.train.graph_module), _walk(self.eval.graph_module)
        i = j = 0
        while i < len(t_nodes) or j < len(e_nodes):
            t = t_nodes[i] if i < len(t_nodes) else None
            e = e_nodes[j] if j < len(e_nodes) else None
            if t is not None and e is not None and t.op == e.op and self._same_target(t, e):
                try:
                    self._compare(t, e)
                except _Differ:
                    return t, e
                i, j = i + 1, j + 1
            elif t is not None and self._is_counter(t):
                self.counters.append(t)  # num_batches_tracked += 1: train mode only
                i += 1
            elif t is not None and self._is_passthrough(t) and t.args[0] in self.match:
                self.match[t] = self.match[t.args[0]]  # x.contiguous() on a tensor laid out otherwise
                i += 1
            elif e is not None and self._is_passthrough(e):
                self.root[e] = self.root.get(e.args[0], e.args[0])
                j += 1
            else:
                return t, e
        return None

    def _same_target(self, t: torch.fx.Node, e: torch.fx.Node) -> bool:
        if t.op in ("placeholder", "output", "get_attr"):
            return True
        return t.target == e.target

    def _is_counter(self, t: torch.fx.Node) -> bool:
        return (
            str(t.target) in _COUNTER_OPS
            and isinstance(t.args[0], torch.fx.Node)
            and t.args[0].name in self.buffers
            and isinstance(t.args[1], (int, float))
            and not t.users
        )

    def _is_passthrough(self, n: torch.fx.Node) -> bool:
        """An op that returns its input's values (recorded in one mode only when layouts differ)."""
        return str(n.target) in _PASSTHROUGH and isinstance(n.args[0], torch.fx.Node)

    def _compare(self, t: torch.fx.Node, e: torch.fx.Node) -> None:
        self.match[t] = e
        self.root[e] = e
        if t.op != "call_function":
            if t.op == "output":
                self._value(t.args, e.args)
            return
        t_schema, e_schema = _schema_values(t), _schema_values(e)
        if t_schema is None:
            self._value(t.args, e.args)
            self._value(t.kwargs, e.kwargs)
            return
        for pos, ((arg, tv), (_, ev)) in enumerate(zip(t_schema, e_schema)):
            new = self._value(tv, ev)
            if isinstance(new, ModeValue):
                self.edits.append((t, arg.name if arg.kwarg_only else pos, new))
        flag = _IDENTITY_IN_EVAL.get(str(e.target))
        if flag is not None and e_schema[flag][1] is False and isinstance(e.args[0], torch.fx.Node):
            self.root[e] = self.root.get(e.args[0], e.args[0])  # eval-mode dropout: its input as-is

    def _value(self, tv: Any, ev: Any) -> Any:
        if isinstance(tv, torch.fx.Node) or isinstance(ev, torch.fx.Node):
            if not (isinstance(tv, torch.fx.Node) and isinstance(ev, torch.fx.Node)) or tv not in self.match:
                raise _Differ
            if self.root.get(self.match[tv], self.match[tv]) != self.root.get(ev, ev):
                raise _Differ
            return tv
        if isinstance(tv, (list, tuple)) and isinstance(ev, (list, tuple)):
            if len(tv) != len(ev):
                raise _Differ
            for a, b in zip(tv, ev):
                if isinstance(self._value(a, b), ModeValue):
                    raise _Differ  # a mode-dependent literal inside a list: not supported
            return tv
        if isinstance(tv, dict) and isinstance(ev, dict):
            if tv.keys() != ev.keys():
                raise _Differ
            for k in tv:
                if isinstance(self._value(tv[k], ev[k]), ModeValue):
                    raise _Differ
            return tv
        if type(tv) is type(ev) and (tv == ev or (tv != tv and ev != ev)):
            return tv
        if isinstance(tv, _SCALARS) and isinstance(ev, _SCALARS):
            return ModeValue(tv, ev)
        raise _Differ


def _apply(comparison: _Comparison) -> None:
    """Write the ModeValues into the train-mode program's nodes."""
    for node, where, value in comparison.edits:
        if isinstance(where, str):
            node.kwargs = {**node.kwargs, where: value}
            continue
        args = list(node.args)
        schema = node.target._schema.arguments
        while len(args) <= where:  # the argument was left at its default in train mode
            default = schema[len(args)]
            args.append(default.default_value if default.has_default_value() else None)
        args[where] = value
        node.args = tuple(args)
    for node in comparison.counters:
        node.args = (node.args[0], ModeValue(node.args[1], 0), *node.args[2:])


def mark_mode_arguments(
    train: torch.export.ExportedProgram, eval_: torch.export.ExportedProgram
) -> tuple[torch.fx.Node | None, torch.fx.Node | None] | None:
    """Mark the train-mode program's mode-dependent literals as ModeValues.

    Returns None on success; otherwise changes nothing and returns the first train and eval nodes
    where the programs part (None for a program that ended first).
    """
    comparison = _Comparison(train, eval_)
    differ = comparison.run()
    if differ is None:
        _apply(comparison)
    return differ


def trace_both_modes(
    module: torch.nn.Module, export, kwargs: dict[str, Any] | None = None
) -> torch.export.ExportedProgram:
    """`export()` the module in its own mode and in the other one; return a program that follows the
    mode at run time where possible (see the module docstring), else the own-mode program. With the
    forward `kwargs`, a cheap run in each mode first (mode_probe) can show the traces would be equal."""
    if not reads_training(module):
        return export()  # no code it runs reads the mode: both traces would be equal
    if kwargs is not None and modes_trace_alike(module, kwargs):
        return export()  # it reads the mode but calls the same ops on the same values in both
    was_training = module.training
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen batch norm)
    own = export()
    try:
        module.train(not was_training)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = export()
    except TraceError as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        warnings.warn(
            f"{type(module).__name__} could not be traced in {'eval' if was_training else 'train'} mode "
            f"({first}); the compiled module runs as in {'train' if was_training else 'eval'} mode "
            "whatever train()/eval() says",
            ModeWarning,
            stacklevel=3,
        )
        return own
    finally:
        for m, training in modes.items():
            m.training = training
    train, eval_ = (own, other) if was_training else (other, own)
    differ = mark_mode_arguments(train, eval_)
    if differ is None:
        return train
    t, e = differ
    mode = "train" if was_training else "eval"
    warnings.warn(
        f"{type(module).__name__}.forward takes another path in train mode than in eval mode: train mode runs "
        f"{_source(t)} where eval mode runs {_source(e)} (a Python branch on self.training, or on something "
        f"train()/eval() changes). The compiled module runs as in {mode} mode whatever train()/eval() says "
        "(dropout and batch norm included): compile another instance in the other mode for that mode, or "
        "choose through an op argument instead (e.g. F.dropout(x, p, self.training))",
        ModeWarning,
        stacklevel=3,
    )
    return own
