"""`parallelize(..., verify=...)`: check at compile time that the captured program computes what the
module computes.

After capture, the graph's single-device code (real codegen, `dp` on one device; see verify_program)
and the eager module run forward and backward on the dummy inputs from the same RNG seed; outputs and
the gradients of every parameter that requires grad must agree within fp32 tolerance
(verify_compare). Where the graph follows train()/eval() (it holds ModeValues) the other mode is
checked too, forward only (its backward runs the same ops' gradients; this keeps the check near the
cost of capture). Neither run changes the module: buffers, train/eval flags, `.grad` and the caller's RNG
stream are as before. A difference raises CompileError naming the first module whose values differ,
the node and source line, and an in-place write capture may have lost (verify_locate).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.errors import CompileError, ConfigError
from nnscaler.graph.ir import Graph, ModeValue
from nnscaler.graph.ops.custom import op_emitter
from nnscaler.parallel.verify_compare import difference
from nnscaler.parallel.verify_locate import Finding, first_module, first_node, lost_writes
from nnscaler.parallel.verify_program import SingleDevice, build_single_device
from nnscaler.parallel.verify_runs import LineRecorder, ModuleRecorder, RunResult, run_once
from nnscaler.runtime.checkpoint.files import load_file

__all__ = ["VERIFY_MAX_PARAMS", "VerifyReport", "should_verify", "unverifiable", "verify_capture"]

_log = logging.getLogger(__name__)

VERIFY_MAX_PARAMS = 200_000_000
"""`verify=None` checks models with fewer parameters than this (the model runs twice on its device)."""

_FIX = "To compile anyway, pass verify=False to parallelize."

GRAD_FLOOR = 1e-2
"""A gradient is compared with an absolute tolerance of at least this share of the largest gradient's
magnitude (times verify_compare's atol_scale: 1e-7 of it in float32): a gradient that is round-off only
(an attention key bias, which softmax ignores) differs by round-off when attention runs fused."""


@dataclass
class VerifyReport:
    """What was checked: the modes, whether gradients were compared, and the seconds it took."""

    modes: list[str] = field(default_factory=list)
    backward: bool = False
    seconds: float = 0.0
    skipped: str = ""
    """Why nothing was checked (verify=None on a program the check cannot run), or ''."""


def _meta_names(module: torch.nn.Module) -> list[str]:
    tensors = (*module.named_parameters(), *module.named_buffers())
    return [name for name, t in tensors if t.is_meta]


def _meta_inputs(dummy_forward_args: dict[str, Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(dummy_forward_args))


def should_verify(verify: bool | None, module: torch.nn.Module, dummy_forward_args: dict[str, Any]) -> bool:
    """Whether to run the check: `verify` True or False as given; None when the weights and the dummy
    inputs are real (not meta) and the model has fewer than VERIFY_MAX_PARAMS parameters."""
    if verify is not None and not isinstance(verify, bool):
        raise ConfigError(f"verify={verify!r}: pass True, False or None (check when the model is small)")
    if verify is False:
        return False
    meta = _meta_names(module)
    if verify and (meta or _meta_inputs(dummy_forward_args)):
        what = (
            f"weights are on the meta device (e.g. {meta[0]})"
            if meta
            else "dummy inputs are on the meta device"
        )
        raise ConfigError(
            f"verify=True runs the model on the dummy inputs to check the captured program, but its {what}: "
            "build the model with real weights and pass real dummy inputs, or pass verify=None (checks only "
            "when it can) or verify=False"
        )
    if verify:
        return True
    if meta or _meta_inputs(dummy_forward_args):
        _log.info("verify skipped: the model's weights or the dummy inputs are on the meta device")
        return False
    count = sum(p.numel() for p in module.parameters())
    if count >= VERIFY_MAX_PARAMS:
        _log.info(
            "verify skipped: %d parameters (verify=None checks models under %d)", count, VERIFY_MAX_PARAMS
        )
        return False
    return True


def _device(module: torch.nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _constants(graph: Graph, outdir: Path | None) -> dict[str, torch.Tensor]:
    """The graph's constants; read from the output directory when the graph was loaded from JSON."""
    if all(v is not None for v in graph.constants.values()):
        return dict(graph.constants)
    from nnscaler.parallel.savedir import CONSTANTS_FILE

    if outdir is None or not (outdir / CONSTANTS_FILE).exists():
        raise ConfigError(
            "verify needs the values of the graph's constants: pass outdir holding constants.pt"
        )
    return load_file(outdir / CONSTANTS_FILE, weights_only=True, fix="generate again (reuse='override')")


def _reads_mode(graph: Graph) -> bool:
    def has_mode(obj: Any) -> bool:
        if isinstance(obj, ModeValue):
            return True
        if isinstance(obj, (list, tuple)):
            return any(has_mode(x) for x in obj)
        if isinstance(obj, dict):
            return any(has_mode(x) for x in obj.values())
        return False

    return any(has_mode(n.args) or has_mode(n.kwargs) for n in graph.nodes)


def unverifiable(graph: Graph) -> str:
    """Why the single-device code cannot run in this process ('' when it can): ops registered with an
    `emit_fn` write their call for a rank of a running job (they may ask the process group)."""
    emitted = sorted({n.op for n in graph.nodes if op_emitter(n.op) is not None})
    if emitted:
        return f"{', '.join(emitted)} registered with an emit_fn (its call is written for a rank of a running job)"
    return ""


def _run_generated(single: SingleDevice, *args: Any, **kwargs: Any) -> RunResult:
    try:
        return run_once(single.module, *args, **kwargs)
    except Exception as exc:
        raise CompileError(
            f"verify: the single-device code generated from the captured program raised {type(exc).__name__}: "
            f"{exc}. This is a bug in capture or codegen; please report it with the model's code. {_FIX}"
        ) from exc


def _run_eager(module: torch.nn.Module, *args: Any, **kwargs: Any) -> RunResult:
    try:
        return run_once(module, *args, **kwargs)
    except Exception as exc:
        raise CompileError(
            f"verify: the model itself raised {type(exc).__name__} when run on (copies of) the dummy inputs: "
            f"{exc}. The check runs forward and backward of the model on them in the modes the captured "
            f"program follows; if the model cannot run so, {_FIX[0].lower()}{_FIX[1:]}"
        ) from exc


def _differences(eager: RunResult, got: RunResult) -> tuple[list[str], bool]:
    """(what differs, in words; whether the forward outputs differ)."""
    if eager.spec != got.spec:
        return [f"the outputs are structured as {got.spec} where eager returns {eager.spec}"], True
    out = []
    for i, (g, e) in enumerate(zip(got.leaves, eager.leaves)):
        diff = difference(g, e)
        if diff is not None:
            out.append(f"output {i} ({diff})")
    forward = bool(out)
    floats = [
        e for e in eager.grads.values() if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()
    ]
    floor = GRAD_FLOOR * max((float(e.detach().abs().max()) for e in floats), default=0.0)
    for name, e in eager.grads.items():
        g = got.grads.get(name)
        if e is None and g is None:
            continue
        if e is None or g is None:
            out.append(
                f"gradient of {name} ({'none' if g is None else 'one'} where eager has {'one' if g is None else 'none'})"
            )
            continue
        diff = difference(g, e, floor)
        if diff is not None:
            out.append(f"gradient of {name} ({diff})")
    return out, forward


def _module_label(graph: Graph, path: str) -> str:
    cls = graph.module_classes.get(path) or graph.module_class.rsplit(".", 1)[-1]
    return f"`{path}` ({cls})" if path else f"the top-level module ({cls})"


def _node_label(node) -> str:
    return f"`{node.name}` ({node.op}) at {node.source or 'an unknown line'}"


def _locate(
    graph: Graph,
    module: torch.nn.Module,
    single: SingleDevice,
    kwargs: dict,
    device: torch.device,
    training: bool,
) -> Finding | None:
    """Run both once more, recording, and find the first differing module, node and lost write."""
    recorder = ModuleRecorder(module)
    try:
        run_once(module, kwargs, {}, device, training, backward=False)
    finally:
        recorder.close()
    single.recorder.on = True
    try:
        _run_generated(single, kwargs, {}, device, training, backward=False)
    finally:
        single.recorder.on = False
    finding = first_module(graph, single.values, recorder.seen)
    path = finding.node.module_path if finding is not None else ""
    try:
        lines = LineRecorder(module, path)
    except AttributeError:  # the node's module path names no module of the eager model
        return finding
    try:
        run_once(module, kwargs, {}, device, training, backward=False, watch=lines)
    finally:
        lines.close()
    refined = first_node(graph, single.values, path, lines.calls)
    lost = lost_writes(graph, path, lines.calls)
    if finding is None and refined is None and not lost:
        return None
    if finding is None:
        node = refined[0] if refined else None
        finding = Finding(node.outputs[0] if node else "", node, -1, "", refined[1] if refined else None)  # type: ignore[arg-type]
    finding.lost = lost
    if refined is not None:
        finding.line_node, finding.line_diff = refined
    return finding


def _grad_readers(graph: Graph, problems: list[str]) -> str:
    """Where the gradients first part from eager: backward runs from the end of forward, so of the
    parameters whose gradient differs, the one read last in the graph is nearest the fault."""
    found = []
    for problem in problems:
        if not problem.startswith("gradient of "):
            continue
        name = problem[len("gradient of ") :].split(" ", 1)[0]
        value = next((v.name for v in graph.values.values() if v.target == name or name in v.aliases), None)
        readers = [(i, n) for i, n in enumerate(graph.nodes) if value in n.input_names()]
        if readers:
            found.append((readers[-1][0], name, [n for _, n in readers]))
    if not found:
        return ""
    _, name, readers = max(found, key=lambda f: f[0])
    where = "; ".join(f"{_module_label(graph, n.module_path)}: {_node_label(n)}" for n in readers[-3:])
    return f"  the forward matches; the gradients part first at {name}, which is read by {where}\n"


def _message(
    graph: Graph, training: bool, problems: list[str], forward: bool, finding: Finding | None
) -> str:
    mode = "train" if training else "eval"
    text = (
        f"verify: the captured program of {graph.module_class} does not compute what the module computes "
        f"on the dummy inputs ({mode} mode).\n"
    )
    if finding is not None and finding.node is not None:
        node = finding.line_node or finding.node
        module = _module_label(graph, finding.node.module_path)
        text += f"  first module whose values differ: {module}, at {node.source or 'an unknown line'}\n"
        if finding.line_node is not None:
            text += f"  first differing graph node: {_node_label(finding.line_node)}: {finding.line_diff}\n"
        if finding.where and finding.line_node is not finding.node:
            text += f"  seen at a module boundary: value `{finding.value}` of node {_node_label(finding.node)}, {finding.where}: {finding.diff}\n"
    elif forward:
        text += "  the outputs differ, but no module boundary or source line showed where\n"
    else:
        text += _grad_readers(graph, problems)
    for write in finding.lost if finding is not None else []:
        text += f"  eager writes into a tensor at {write}, and the captured program has no op from that line: a lost in-place write?\n"
    more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
    text += f"  differs in the end: {'; '.join(problems[:4])}{more}\n"
    return (
        text
        + f"This is a bug in capture (or an op it models wrongly); please report it with the model's code. {_FIX}"
    )


def verify_capture(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    graph: Graph,
    outdir: Path | None = None,
    backward: bool = True,
    required: bool = True,
) -> VerifyReport:
    """Run `graph`'s single-device code and `module` on the dummy inputs and compare; raise CompileError
    naming where they part. `backward=False` compares the forward only; `required=False` (verify=None)
    skips programs the check cannot run here (see `unverifiable`)."""
    t0 = time.perf_counter()
    why = "" if required else unverifiable(graph)
    if why:
        _log.info("verify skipped: %s", why)
        return VerifyReport(skipped=why)
    device = _device(module)
    kwargs = {k: dummy_forward_args[k] for k in graph.forward_args if k in dummy_forward_args}
    single = build_single_device(graph, module, _constants(graph, outdir), device)
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    backward = backward and bool(params)
    report = VerifyReport(backward=backward)
    modes = [module.training] + ([not module.training] if _reads_mode(graph) else [])
    mine = {name: single.param(name) for name in params}
    for training in modes:
        grads = backward and training == module.training  # the other mode: forward only (see docs)
        eager = _run_eager(module, kwargs, params, device, training, grads)
        got = _run_generated(single, kwargs, mine, device, training, grads)
        problems, forward = _differences(eager, got)
        if problems:
            finding = _locate(graph, module, single, kwargs, device, training) if forward else None
            raise CompileError(_message(graph, training, problems, forward, finding))
        report.modes.append("train" if training else "eval")
    report.seconds = time.perf_counter() - t0
    _log.info(
        "verify: %s matches eager (%s; %.2fs)", graph.module_class, ", ".join(report.modes), report.seconds
    )
    return report
